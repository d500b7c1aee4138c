// jodc_nvshmem_read_accumulator / jodc_nvshmem_zero_accumulator: PE d's own accumulator (plus its landing slots,
// summed in source order: the same order and fp32 arithmetic as the CUDA and CPU backends) and zeroing it. Local
// memory only: the symmetric addresses are this PE's device memory.
#include "nvshmem/handlers.cuh"
#include "nvshmem/ops.cuh"

namespace jodc::nvshmem_backend {
namespace {

__global__ void __launch_bounds__(kThreads)
    ReadKernel(SymBucketView view, HeapControl* control, const int32_t* device_operand, const int32_t* token_in,
               int32_t* token_out, float* out) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!cuda::ValidDevice(device_operand, l.world, control, cuda::OpCode::kReadAccumulator, token_in, token_out,
                         &device))
    return;
  const int64_t n = l.shard_numel;
  for (int64_t i = cuda::StrideStart(); i < n; i += cuda::StrideStep()) {
    float sum = view.accumulator[i];
    if (view.landing_slots) {
      for (int32_t s = 0; s < l.world; ++s) sum += view.landing[static_cast<int64_t>(s) * n + i];
    }
    out[i] = sum;
  }
  cuda::AdvanceToken(token_in, token_out);
}

__global__ void __launch_bounds__(kThreads)
    ZeroKernel(SymBucketView view, HeapControl* control, const int32_t* device_operand, const int32_t* token_in,
               int32_t* token_out) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!cuda::ValidDevice(device_operand, l.world, control, cuda::OpCode::kZeroAccumulator, token_in, token_out,
                         &device))
    return;
  const int64_t n = l.shard_numel;
  for (int64_t i = cuda::StrideStart(); i < n; i += cuda::StrideStep()) {
    view.accumulator[i] = 0.f;
    if (view.landing_slots) {
      for (int32_t s = 0; s < l.world; ++s) view.landing[static_cast<int64_t>(s) * n + i] = 0.f;
    }
  }
  __threadfence_system();  // peers' next updates land on zeros
  cuda::AdvanceToken(token_in, token_out);
}

ffi::Error ReadImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::S32>> token_out,
                    int64_t heap_id, int64_t bucket_id) {
  Target t;
  if (ffi::Error e = Prepare("read_accumulator", stream, device, token, heap_id, bucket_id, &t); e.failure())
    return e;
  const SymBucketView& v = t.bucket->view;
  if (static_cast<int64_t>(out->element_count()) != v.layout.shard_numel)
    return ffi::Error::InvalidArgument("jodc read_accumulator: output has " + std::to_string(out->element_count()) +
                                       " elements, the shard has " + std::to_string(v.layout.shard_numel));
  ReadKernel<<<Blocks(v.layout.shard_numel), kThreads, 0, stream>>>(v, t.heap->control, device.typed_data(),
                                                                     token.typed_data(), token_out->typed_data(),
                                                                     out->typed_data());
  return Launched("read_accumulator");
}

ffi::Error ZeroImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                    ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  Target t;
  if (ffi::Error e = Prepare("zero_accumulator", stream, device, token, heap_id, bucket_id, &t); e.failure())
    return e;
  const SymBucketView& v = t.bucket->view;
  ZeroKernel<<<Blocks(v.layout.shard_numel), kThreads, 0, stream>>>(v, t.heap->control, device.typed_data(),
                                                                     token.typed_data(), token_out->typed_data());
  return Launched("zero_accumulator");
}

ffi::Error Read(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id,
                int64_t bucket_id) {
  return AbortOnError(heap_id, ReadImpl(stream, device, token, out, token_out, heap_id, bucket_id));
}

ffi::Error Zero(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  return AbortOnError(heap_id, ZeroImpl(stream, device, token, token_out, heap_id, bucket_id));
}

}  // namespace
}  // namespace jodc::nvshmem_backend

JODC_NVSHMEM_HANDLER(ReadAccumulator, jodc::nvshmem_backend::Read);
JODC_NVSHMEM_HANDLER(ZeroAccumulator, jodc::nvshmem_backend::Zero);
