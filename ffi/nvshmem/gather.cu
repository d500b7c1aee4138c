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

ffi::Error GatherImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id,
                      int64_t bucket_id) {
  Target t;
  if (ffi::Error e = Prepare("gather", stream, device, token, heap_id, bucket_id, &t); e.failure()) return e;
  const SymBucketView& v = t.bucket->view;
  const bool out_f32 = out->element_type() == ffi::DataType::F32;
  if (!out_f32 && out->element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("jodc gather: output must be float32 or bfloat16");
  if (static_cast<int64_t>(out->element_count()) != v.layout.numel)
    return ffi::Error::InvalidArgument("jodc gather: output has " + std::to_string(out->element_count()) +
                                       " elements, bucket " + std::to_string(bucket_id) + " has " +
                                       std::to_string(v.layout.numel));
  const int32_t* dev = device.typed_data();
  const int32_t* tok = token.typed_data();
  int32_t* tok_out = token_out->typed_data();
  void* dst = out->untyped_data();
  using cuda::Bf16Bits;
  if (v.master == Dtype::kF32 && out_f32) Launch<float, float>(stream, t, dev, tok, tok_out, dst);
  else if (v.master == Dtype::kF32) Launch<float, Bf16Bits>(stream, t, dev, tok, tok_out, dst);
  else if (out_f32) Launch<Bf16Bits, float>(stream, t, dev, tok, tok_out, dst);
  else Launch<Bf16Bits, Bf16Bits>(stream, t, dev, tok, tok_out, dst);
  return Launched("gather");
}

ffi::Error Gather(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                  ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id,
                  int64_t bucket_id) {
  return AbortOnError(heap_id, GatherImpl(stream, device, token, out, token_out, heap_id, bucket_id));
}

}  // namespace
}  // namespace jodc::nvshmem_backend

JODC_NVSHMEM_HANDLER(Gather, jodc::nvshmem_backend::Gather);
