// gather: device d pulls every owner's shard of a bucket into one full vector in the requested compute dtype.
// One kernel for the whole bucket: grid dimension y walks the owners (starting at d, so concurrent gathers read
// different owners first), dimension x copies one owner's slice with 16-byte loads straight from the owner's GPU
// memory over the peer mapping, converting fp32 <-> bf16 on the fly.
#include "cuda/device_util.cuh"
#include "cuda/handler_util.cuh"
#include "cuda/handlers.cuh"

namespace jodc::cuda {
namespace {

template <typename Src, typename Dst>
__global__ void __launch_bounds__(kThreadsPerBlock)
    GatherKernel(BucketView view, HeapControl* control, const int32_t* device_operand, const int32_t* token_in,
                 int32_t* token_out, Dst* out, bool vectorized) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!ValidDevice(device_operand, l.world, control, OpCode::kGather, token_in, token_out, &device)) return;
  const int32_t owner = (device + static_cast<int32_t>(blockIdx.y)) % l.world;
  const int64_t n = l.valid(owner);
  if (n > 0) CopyRange(out + l.begin(owner), static_cast<const Src*>(view.shard[owner]), n, vectorized);
  AdvanceToken(token_in, token_out);
}

template <typename Src, typename Dst>
void LaunchGather(cudaStream_t stream, const OpTarget& t, const int32_t* device, const int32_t* token_in,
                  int32_t* token_out, void* out) {
  const BucketView& view = t.bucket->view;
  const dim3 grid(BlocksFor((view.layout.shard_numel + kPack - 1) / kPack, t.gpu, view.layout.world),
                  view.layout.world);
  GatherKernel<Src, Dst><<<grid, kThreadsPerBlock, 0, stream>>>(view, t.heap->control_dev, device, token_in, token_out,
                                                                 static_cast<Dst*>(out), Aligned16(out));
}

// Any error aborts the heap, so peers spinning in a barrier for this device fail at once.
ffi::Error Gather(cudaStream_t stream, Scalar device, Scalar token, ffi::Result<ffi::AnyBuffer> out, TokenOut token_out,
                  int64_t heap_id, int64_t bucket_id) {
  return RunOp("gather", stream, device, token, heap_id, bucket_id, [&](const OpTarget& t) -> ffi::Error {
    const BucketView& view = t.bucket->view;
    ErrorOr<Dtype> out_dtype = CheckFullBucket("gather", "output", *out, view.layout, bucket_id);
    if (!out_dtype.has_value()) return out_dtype.error();
    const Dtype out_t = *out_dtype;
    const int32_t* dev = device.typed_data();
    const int32_t* tok = token.typed_data();
    int32_t* tok_out = token_out->typed_data();
    void* dst = out->untyped_data();
    WithElement(view.master, [&](auto src_t) {
      WithElement(out_t, [&](auto dst_t) {
        LaunchGather<typename decltype(src_t)::type, typename decltype(dst_t)::type>(stream, t, dev, tok, tok_out, dst);
      });
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jodc::cuda

JODC_CUDA_HANDLER(Gather, jodc::cuda::Gather);
