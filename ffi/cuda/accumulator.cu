// accumulator: device d reads (as fp32) or zeroes the gradient accumulated into its own shard of a bucket.
// With landing slots the read is the deterministic reduction: accumulator (the host-settable base) + slot of
// source 0 + slot of source 1 + ..., in that fixed order whatever the timing of the pushes; the same order as the
// CPU side, so both give bit-identical sums from the same pushes.
#include "cuda/device_util.cuh"
#include "cuda/handler_util.cuh"
#include "cuda/handlers.cuh"

namespace jodc::cuda {
namespace {

__global__ void __launch_bounds__(kThreadsPerBlock)
    ReadAccumulatorKernel(BucketView view, HeapControl* control, const int32_t* device_operand,
                          const int32_t* token_in, int32_t* token_out, float* out, bool vectorized) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!ValidDevice(device_operand, l.world, control, OpCode::kReadAccumulator, token_in, token_out, &device)) return;
  SumInSourceOrder(out, view.accumulator[device], view.landing[device], view.landing_slots ? l.world : 0,
                   l.shard_numel, vectorized);
  AdvanceToken(token_in, token_out);
}

// Zeroes device d's accumulator (grid row y = 0) and, with landing slots, its world slots (row y = 1 + source).
// Shards are whole multiples of 64 bytes on 256-byte aligned allocations, so 16-byte stores always fit.
__global__ void __launch_bounds__(kThreadsPerBlock)
    ZeroAccumulatorKernel(BucketView view, HeapControl* control, const int32_t* device_operand,
                          const int32_t* token_in, int32_t* token_out) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!ValidDevice(device_operand, l.world, control, OpCode::kZeroAccumulator, token_in, token_out, &device)) return;
  ZeroRegions(view.accumulator[device], view.landing[device], l.shard_numel, /*vectorized=*/true);
  AdvanceToken(token_in, token_out);
}

// Any error aborts the heap, so peers spinning in a barrier for this device fail at once (both ops).
ffi::Error ReadAcc(cudaStream_t stream, Scalar device, Scalar token, ffi::Result<ffi::Buffer<ffi::F32>> out,
                   TokenOut token_out, int64_t heap_id, int64_t bucket_id) {
  return RunOp("read_accumulator", stream, device, token, heap_id, bucket_id, [&](const OpTarget& t) -> ffi::Error {
    const BucketView& view = t.bucket->view;
    if (ffi::Error e = CheckAccumulatorOut(*out, view.layout); e.failure()) return e;
    float* dst = out->typed_data();
    const dim3 grid(BlocksFor((view.layout.shard_numel + kPack - 1) / kPack, t.gpu, 1));
    ReadAccumulatorKernel<<<grid, kThreadsPerBlock, 0, stream>>>(view, t.heap->control_dev, device.typed_data(),
                                                                  token.typed_data(), token_out->typed_data(), dst,
                                                                  Aligned16(dst));
    return ffi::Error::Success();
  });
}

ffi::Error ZeroAcc(cudaStream_t stream, Scalar device, Scalar token, TokenOut token_out, int64_t heap_id,
                   int64_t bucket_id) {
  return RunOp("zero_accumulator", stream, device, token, heap_id, bucket_id, [&](const OpTarget& t) -> ffi::Error {
    const BucketView& view = t.bucket->view;
    const unsigned regions = view.landing_slots ? 1u + static_cast<unsigned>(view.layout.world) : 1u;
    const dim3 grid(BlocksFor((view.layout.shard_numel + 3) / 4, t.gpu, static_cast<int32_t>(regions)), regions);
    ZeroAccumulatorKernel<<<grid, kThreadsPerBlock, 0, stream>>>(view, t.heap->control_dev, device.typed_data(),
                                                                  token.typed_data(), token_out->typed_data());
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jodc::cuda

JODC_CUDA_HANDLER(ReadAccumulator, jodc::cuda::ReadAcc);
JODC_CUDA_HANDLER(ZeroAccumulator, jodc::cuda::ZeroAcc);
