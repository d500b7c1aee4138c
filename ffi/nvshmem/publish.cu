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

// Any error poisons the heap on every PE (RunOp), so their barriers stop waiting for this one.
ffi::Error Publish(cudaStream_t stream, Scalar device, ffi::AnyBuffer shard, Scalar token, TokenOut token_out,
                   int64_t heap_id, int64_t bucket_id) {
  return RunOp("publish", stream, device, token, heap_id, bucket_id, [&](const Target& t) -> ffi::Error {
    const SymBucketView& v = t.bucket->view;
    if (ffi::Error e = CheckShard(shard, v.layout, v.master); e.failure()) return e;
    const unsigned blocks = Blocks(v.layout.shard_numel);
    cuda::WithElement(v.master, [&](auto master_t) {
      using T = typename decltype(master_t)::type;
      PublishKernel<T><<<blocks, kThreads, 0, stream>>>(v, t.heap->control, device.typed_data(), token.typed_data(),
                                                        token_out->typed_data(),
                                                        static_cast<const T*>(shard.untyped_data()));
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jodc::nvshmem_backend

JODC_NVSHMEM_HANDLER(Publish, jodc::nvshmem_backend::Publish);
