// jodc_nvshmem_read_accumulator / jodc_nvshmem_zero_accumulator: PE d's own accumulator (plus its landing slots,
// summed in source order: the same order and fp32 arithmetic as the CUDA and CPU backends) and zeroing it. Local
// memory only: the symmetric addresses are this PE's device memory.
#include "nvshmem/handlers.cuh"
#include "nvshmem/ops.cuh"

namespace jodc::nvshmem_backend {
namespace {

__global__ void __launch_bounds__(kThreads)
    ReadKernel(SymBucketView view, HeapControl* control, const int32_t* device_operand, const int32_t* token_in,
               int32_t* token_out, float* out, bool vectorized) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!cuda::ValidDevice(device_operand, l.world, control, cuda::OpCode::kReadAccumulator, token_in, token_out,
                         &device))
    return;
  cuda::SumInSourceOrder(out, view.accumulator, view.landing, view.landing_slots ? l.world : 0, l.shard_numel,
                         vectorized);
  cuda::AdvanceToken(token_in, token_out);
}

__global__ void __launch_bounds__(kThreads)
    ZeroKernel(SymBucketView view, HeapControl* control, const int32_t* device_operand, const int32_t* token_in,
               int32_t* token_out, bool vectorized) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!cuda::ValidDevice(device_operand, l.world, control, cuda::OpCode::kZeroAccumulator, token_in, token_out,
                         &device))
    return;
  cuda::ZeroRegions(view.accumulator, view.landing, l.shard_numel, vectorized);  // fences: peers' updates land on zeros
  cuda::AdvanceToken(token_in, token_out);
}

// Any error poisons the heap on every PE (RunOp), so their barriers stop waiting for this one (both ops).
ffi::Error Read(cudaStream_t stream, Scalar device, Scalar token, ffi::Result<ffi::Buffer<ffi::F32>> out,
                TokenOut token_out, int64_t heap_id, int64_t bucket_id) {
  return RunOp("read_accumulator", stream, device, token, heap_id, bucket_id, [&](const Target& t) -> ffi::Error {
    const SymBucketView& v = t.bucket->view;
    if (ffi::Error e = CheckAccumulatorOut(*out, v.layout); e.failure()) return e;
    float* dst = out->typed_data();
    const bool vectorized = cuda::Aligned16(dst) && cuda::Aligned16(v.accumulator) && cuda::Aligned16(v.landing);
    ReadKernel<<<Blocks(v.layout.shard_numel / cuda::kPack + 1), kThreads, 0, stream>>>(
        v, t.heap->control, device.typed_data(), token.typed_data(), token_out->typed_data(), dst, vectorized);
    return ffi::Error::Success();
  });
}

ffi::Error Zero(cudaStream_t stream, Scalar device, Scalar token, TokenOut token_out, int64_t heap_id,
                int64_t bucket_id) {
  return RunOp("zero_accumulator", stream, device, token, heap_id, bucket_id, [&](const Target& t) -> ffi::Error {
    const SymBucketView& v = t.bucket->view;
    // grid row 0: the accumulator; row 1 + s: landing slot s
    const dim3 grid(Blocks(v.layout.shard_numel / 4 + 1), v.landing_slots ? 1 + v.layout.world : 1);
    const bool vectorized = cuda::Aligned16(v.accumulator) && cuda::Aligned16(v.landing);
    ZeroKernel<<<grid, kThreads, 0, stream>>>(v, t.heap->control, device.typed_data(), token.typed_data(),
                                              token_out->typed_data(), vectorized);
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jodc::nvshmem_backend

JODC_NVSHMEM_HANDLER(ReadAccumulator, jodc::nvshmem_backend::Read);
JODC_NVSHMEM_HANDLER(ZeroAccumulator, jodc::nvshmem_backend::Zero);
