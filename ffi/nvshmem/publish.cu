// jodc_nvshmem_publish: PE d overwrites its own master shard (local symmetric memory) so peers can gather it.
#include "nvshmem/handlers.cuh"
#include "nvshmem/ops.cuh"

namespace jodc::nvshmem_backend {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads)
    PublishKernel(SymBucketView view, HeapControl* control, const int32_t* device_operand, const int32_t* token_in,
                  int32_t* token_out, const T* shard) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!cuda::ValidDevice(device_operand, l.world, control, cuda::OpCode::kPublish, token_in, token_out, &device))
    return;
  T* own = static_cast<T*>(view.shard);
  for (int64_t i = cuda::StrideStart(); i < l.shard_numel; i += cuda::StrideStep()) own[i] = shard[i];
  __threadfence_system();
  cuda::AdvanceToken(token_in, token_out);
}

ffi::Error PublishImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::AnyBuffer shard,
                       ffi::Buffer<ffi::S32> token, ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id,
                       int64_t bucket_id) {
  Target t;
  if (ffi::Error e = Prepare("publish", stream, device, token, heap_id, bucket_id, &t); e.failure()) return e;
  const SymBucketView& v = t.bucket->view;
  const bool f32 = shard.element_type() == ffi::DataType::F32;
  if ((v.master == Dtype::kF32) != f32 || (!f32 && shard.element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument(std::string("jodc publish: shard must have the bucket's master dtype ") +
                                       DtypeName(v.master));
  if (static_cast<int64_t>(shard.element_count()) != v.layout.shard_numel)
    return ffi::Error::InvalidArgument("jodc publish: shard has " + std::to_string(shard.element_count()) +
                                       " elements, the bucket's shards have " + std::to_string(v.layout.shard_numel));
  const unsigned blocks = Blocks(v.layout.shard_numel);
  if (f32) {
    PublishKernel<float><<<blocks, kThreads, 0, stream>>>(v, t.heap->control, device.typed_data(), token.typed_data(),
                                                          token_out->typed_data(),
                                                          static_cast<const float*>(shard.untyped_data()));
  } else {
    PublishKernel<cuda::Bf16Bits><<<blocks, kThreads, 0, stream>>>(
        v, t.heap->control, device.typed_data(), token.typed_data(), token_out->typed_data(),
        static_cast<const cuda::Bf16Bits*>(shard.untyped_data()));
  }
  return Launched("publish");
}

ffi::Error Publish(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::AnyBuffer shard,
                   ffi::Buffer<ffi::S32> token, ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id,
                   int64_t bucket_id) {
  return AbortOnError(heap_id, PublishImpl(stream, device, shard, token, token_out, heap_id, bucket_id));
}

}  // namespace
}  // namespace jodc::nvshmem_backend

JODC_NVSHMEM_HANDLER(Publish, jodc::nvshmem_backend::Publish);
