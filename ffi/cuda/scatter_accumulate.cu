// scatter_accumulate: device d adds each owner's slice of a full-size gradient into that owner's fp32 accumulator,
// writing straight into the owner's GPU memory over the peer mapping. Race-free either way:
//   * atomic mode (NVLink, non-deterministic heap): float atomics (RED.ADD) into the owner's accumulator, so any
//     number of devices may push into one owner at once; the summation order follows arrival timing.
//   * landing-slot mode (deterministic heap, or GPUs without native peer atomics): device d adds into its own slot
//     on each owner with plain loads and stores. Nobody else writes that slot and one device's kernels run in
//     stream order, so no atomics are needed; read_accumulator reduces the slots in source order.
// Grid dimension y walks the owners starting after d (own shard last: remote owners are served first).
#include "cuda/device_util.cuh"
#include "cuda/handler_util.cuh"
#include "cuda/handlers.cuh"

namespace jodc::cuda {
namespace {

template <typename Src>
__global__ void __launch_bounds__(kThreadsPerBlock)
    ScatterAccumulateKernel(BucketView view, HeapControl* control, const int32_t* device_operand,
                            const int32_t* token_in, int32_t* token_out, const Src* grad, bool vectorized) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!ValidDevice(device_operand, l.world, control, OpCode::kScatterAccumulate, token_in, token_out, &device))
    return;
  const int32_t owner = (device + 1 + static_cast<int32_t>(blockIdx.y)) % l.world;
  const int64_t n = l.valid(owner);
  if (n > 0) {
    const Src* slice = grad + l.begin(owner);
    if (view.landing_slots) {
      AddRange(view.landing[owner] + static_cast<int64_t>(device) * l.shard_numel, slice, n, vectorized);
    } else {
      AtomicAddRange(view.accumulator[owner], slice, n, vectorized);
    }
  }
  FenceWritesForPeers();
  AdvanceToken(token_in, token_out);
}

template <typename Src>
void LaunchScatter(cudaStream_t stream, const OpTarget& t, const int32_t* device, const int32_t* token_in,
                   int32_t* token_out, const void* grad) {
  const BucketView& view = t.bucket->view;
  const dim3 grid(BlocksFor((view.layout.shard_numel + kPack - 1) / kPack, t.gpu, view.layout.world),
                  view.layout.world);
  ScatterAccumulateKernel<Src><<<grid, kThreadsPerBlock, 0, stream>>>(
      view, t.heap->control_dev, device, token_in, token_out, static_cast<const Src*>(grad), Aligned16(grad));
}

// Any error aborts the heap, so peers spinning in a barrier for this device fail at once.
ffi::Error ScatterAccumulate(cudaStream_t stream, Scalar device, ffi::AnyBuffer grad, Scalar token, TokenOut token_out,
                             int64_t heap_id, int64_t bucket_id) {
  return RunOp("scatter_accumulate", stream, device, token, heap_id, bucket_id, [&](const OpTarget& t) -> ffi::Error {
    ErrorOr<Dtype> grad_t = CheckFullBucket("scatter_accumulate", "gradient", grad, t.bucket->view.layout, bucket_id);
    if (!grad_t.has_value()) return grad_t.error();
    WithElement(*grad_t, [&](auto src_t) {
      LaunchScatter<typename decltype(src_t)::type>(stream, t, device.typed_data(), token.typed_data(),
                                                    token_out->typed_data(), grad.untyped_data());
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jodc::cuda

JODC_CUDA_HANDLER(ScatterAccumulate, jodc::cuda::ScatterAccumulate);
