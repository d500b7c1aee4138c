// jodc_nvshmem_scatter_accumulate: PE d adds each owner's slice of a full-size gradient into that owner's fp32
// accumulator: nvshmemx_float_atomic_add per element (atomic mode), or get-add-put into d's own landing slot on the
// owner (landing-slot mode: only d writes that slot, and d's kernels run in stream order). Ends with nvshmem_quiet
// per thread, so the barrier that follows finds every update complete at its target.
#include "nvshmem/handlers.cuh"
#include "nvshmem/ops.cuh"

namespace jodc::nvshmem_backend {
namespace {

template <typename Src>
__global__ void __launch_bounds__(kThreads)
    ScatterKernel(SymBucketView view, HeapControl* control, const int32_t* device_operand, const int32_t* token_in,
                  int32_t* token_out, const Src* grad) {
  int32_t device;
  const BucketLayout& l = view.layout;
  if (!cuda::ValidDevice(device_operand, l.world, control, cuda::OpCode::kScatterAccumulate, token_in, token_out,
                         &device))
    return;
  const int32_t owner = (device + 1 + static_cast<int32_t>(blockIdx.y)) % l.world;
  const int64_t n = l.valid(owner);
  const Src* slice = grad + l.begin(owner);
  for (int64_t i = cuda::StrideStart(); i < n; i += cuda::StrideStep()) {
    const float v = cuda::ToF32(slice[i]);
    if (view.landing_slots) {
      float* slot = view.landing + static_cast<int64_t>(device) * l.shard_numel + i;
      nvshmem_float_p(slot, nvshmem_float_g(slot, owner) + v, owner);
    } else {
      nvshmemx_float_atomic_add(view.accumulator + i, v, owner);
    }
  }
  nvshmem_quiet();
  cuda::AdvanceToken(token_in, token_out);
}

// Any error poisons the heap on every PE (RunOp), so their barriers stop waiting for this one.
ffi::Error Scatter(cudaStream_t stream, Scalar device, ffi::AnyBuffer grad, Scalar token, TokenOut token_out,
                   int64_t heap_id, int64_t bucket_id) {
  return RunOp("scatter_accumulate", stream, device, token, heap_id, bucket_id, [&](const Target& t) -> ffi::Error {
    const SymBucketView& v = t.bucket->view;
    ErrorOr<Dtype> grad_t = CheckFullBucket("scatter_accumulate", "gradient", grad, v.layout, bucket_id);
    if (!grad_t.has_value()) return grad_t.error();
    const dim3 grid(Blocks(v.layout.shard_numel / 4 + 1), v.layout.world);
    cuda::WithElement(*grad_t, [&](auto grad_elem) {
      using T = typename decltype(grad_elem)::type;
      ScatterKernel<T><<<grid, kThreads, 0, stream>>>(v, t.heap->control, device.typed_data(), token.typed_data(),
                                                      token_out->typed_data(),
                                                      static_cast<const T*>(grad.untyped_data()));
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jodc::nvshmem_backend

JODC_NVSHMEM_HANDLER(ScatterAccumulate, jodc::nvshmem_backend::Scatter);
