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

// Any error aborts the heap, so peers spinning in a barrier for this device fail at once.
ffi::Error Publish(cudaStream_t stream, Scalar device, ffi::AnyBuffer shard, Scalar token, TokenOut token_out,
                   int64_t heap_id, int64_t bucket_id) {
  return RunOp("publish", stream, device, token, heap_id, bucket_id, [&](const OpTarget& t) -> ffi::Error {
    const BucketView& view = t.bucket->view;
    if (ffi::Error e = CheckShard(shard, view.layout, view.master); e.failure()) return e;
    const void* src = shard.untyped_data();
    const dim3 grid(BlocksFor((view.layout.shard_numel + kPack - 1) / kPack, t.gpu, 1));
    WithElement(view.master, [&](auto master_t) {
      using T = typename decltype(master_t)::type;
      PublishKernel<T><<<grid, kThreadsPerBlock, 0, stream>>>(view, t.heap->control_dev, device.typed_data(),
                                                               token.typed_data(), token_out->typed_data(),
                                                               static_cast<const T*>(src), Aligned16(src));
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jodc::cuda

JODC_CUDA_HANDLER(Publish, jodc::cuda::Publish);
