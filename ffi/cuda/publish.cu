// publish: device d overwrites its own master shard of a bucket (after its optimizer step) so peers gather it.
// A plain vectorised copy in the master dtype; ordering against peers' gathers is the barrier's job.
#include "cuda/device_util.cuh"
#include "cuda/handler_util.cuh"
#include "cuda/handlers.cuh"

namespace jodc::cuda {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock)
    PublishKernel(BucketView view, HeapControl* control, const int32_t* device_operand, const int32_t* token_in,
                  int32_t* token_out, const T* shard, bool vectorized) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!ValidDevice(device_operand, l.world, control, OpCode::kPublish, token_in, token_out, &device)) return;
  CopyRange(static_cast<T*>(view.shard[device]), shard, l.shard_numel, vectorized);
  FenceWritesForPeers();
  AdvanceToken(token_in, token_out);
}

ffi::Error PublishImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::AnyBuffer shard,
                       ffi::Buffer<ffi::S32> token, ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id,
                       int64_t bucket_id) {
  OpTarget t;
  if (ffi::Error e = Prepare("publish", stream, device, token, heap_id, bucket_id, &t); e.failure()) return e;
  const BucketView& view = t.bucket->view;
  Dtype in_t;
  if (!ToDtype(shard.element_type(), &in_t) || in_t != view.master) {
    return InvalidArgument(std::string("jodc publish: shard must have the bucket's master dtype ") +
                           DtypeName(view.master));
  }
  if (static_cast<int64_t>(shard.element_count()) != view.layout.shard_numel) {
    return InvalidArgument("jodc publish: shard has " + std::to_string(shard.element_count()) +
                           " elements, the bucket's shards have " + std::to_string(view.layout.shard_numel));
  }
  const void* src = shard.untyped_data();
  const dim3 grid(BlocksFor((view.layout.shard_numel + kPack - 1) / kPack, t.gpu, 1));
  if (view.master == Dtype::kF32) {
    PublishKernel<float><<<grid, kThreadsPerBlock, 0, stream>>>(view, t.heap->control_dev, device.typed_data(),
                                                                 token.typed_data(), token_out->typed_data(),
                                                                 static_cast<const float*>(src), Aligned16(src));
  } else {
    PublishKernel<Bf16Bits><<<grid, kThreadsPerBlock, 0, stream>>>(view, t.heap->control_dev, device.typed_data(),
                                                                    token.typed_data(), token_out->typed_data(),
                                                                    static_cast<const Bf16Bits*>(src),
                                                                    Aligned16(src));
  }
  return Launched("publish", stream, t);
}

// Any error aborts the heap, so peers spinning in a barrier for this device fail at once.
ffi::Error Publish(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::AnyBuffer shard,
                   ffi::Buffer<ffi::S32> token, ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id,
                   int64_t bucket_id) {
  return AbortOnError(heap_id, PublishImpl(stream, device, shard, token, token_out, heap_id, bucket_id));
}

}  // namespace
}  // namespace jodc::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcPublishCuda, jodc::cuda::Publish,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::AnyBuffer>()              // new local shard, master dtype
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));
