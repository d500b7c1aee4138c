// jodc_nvshmem_gather: PE d pulls every owner's shard of a bucket into one full vector (compute dtype). Same dtype:
// nvshmemx_getmem_block per owner (grid row y = owner, starting at d); fp32 <-> bf16: element gets, converted.
#include "nvshmem/handlers.cuh"
#include "nvshmem/ops.cuh"

namespace jodc::nvshmem_backend {
namespace {

template <typename Src, typename Dst>
__global__ void __launch_bounds__(kThreads)
    GatherKernel(SymBucketView view, HeapControl* control, const int32_t* device_operand, const int32_t* token_in,
                 int32_t* token_out, Dst* out) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!cuda::ValidDevice(device_operand, l.world, control, cuda::OpCode::kGather, token_in, token_out, &device))
    return;
  const int32_t owner = (device + static_cast<int32_t>(blockIdx.y)) % l.world;
  const int64_t n = l.valid(owner);
  if (n > 0) {
    const Src* shard = static_cast<const Src*>(view.shard);
    if constexpr (std::is_same_v<Src, Dst>) {
      // each block copies a contiguous chunk of the owner's slice
      const int64_t chunk = (n + gridDim.x - 1) / gridDim.x;
      const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
      const int64_t count = begin < n ? (n - begin < chunk ? n - begin : chunk) : 0;
      if (count > 0) nvshmemx_getmem_block(out + l.begin(owner) + begin, shard + begin, count * sizeof(Src), owner);
    } else {
      for (int64_t i = cuda::StrideStart(); i < n; i += cuda::StrideStep()) {
        Src v;
        nvshmem_getmem(&v, shard + i, sizeof(Src), owner);
        out[l.begin(owner) + i] = cuda::Convert<Dst>(v);
      }
    }
  }
  cuda::AdvanceToken(token_in, token_out);
}

template <typename Src, typename Dst>
void Launch(cudaStream_t stream, const Target& t, const int32_t* dev, const int32_t* tok, int32_t* tok_out,
            void* out) {
  const SymBucketView& v = t.bucket->view;
  const dim3 grid(Blocks(v.layout.shard_numel / 8 + 1), v.layout.world);
  GatherKernel<Src, Dst><<<grid, kThreads, 0, stream>>>(v, t.heap->control, dev, tok, tok_out, static_cast<Dst*>(out));
}

// Any error poisons the heap on every PE (RunOp), so their barriers stop waiting for this one.
ffi::Error Gather(cudaStream_t stream, Scalar device, Scalar token, ffi::Result<ffi::AnyBuffer> out,
                  TokenOut token_out, int64_t heap_id, int64_t bucket_id) {
  return RunOp("gather", stream, device, token, heap_id, bucket_id, [&](const Target& t) -> ffi::Error {
    const SymBucketView& v = t.bucket->view;
    ErrorOr<Dtype> out_dtype = CheckFullBucket("gather", "output", *out, v.layout, bucket_id);
    if (!out_dtype.has_value()) return out_dtype.error();
    const int32_t* dev = device.typed_data();
    const int32_t* tok = token.typed_data();
    int32_t* tok_out = token_out->typed_data();
    void* dst = out->untyped_data();
    cuda::WithElement(v.master, [&](auto src_t) {
      cuda::WithElement(*out_dtype, [&](auto dst_t) {
        Launch<typename decltype(src_t)::type, typename decltype(dst_t)::type>(stream, t, dev, tok, tok_out, dst);
      });
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jodc::nvshmem_backend

JODC_NVSHMEM_HANDLER(Gather, jodc::nvshmem_backend::Gather);
