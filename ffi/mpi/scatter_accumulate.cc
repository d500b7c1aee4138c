// scatter_accumulate (MPI): device d adds each owner's slice of a full-size gradient into that owner's fp32
// accumulator with MPI_Accumulate(MPI_SUM), its own process's owners included (MPI makes concurrent accumulates to
// one location atomic only among accumulate operations). Deterministic mode accumulates into the (owner, d) landing
// slot, written by d alone, so the owner's source-ordered reduction is independent of timing. Every target is
// flushed before returning: the pushes are complete at the owners before this device can enter a barrier.
#include <vector>

#include "mpi/handler_util.h"
#include "mpi/handlers.h"

namespace jodc::mpi {
namespace {

ffi::Error ScatterAccumulate(ffi::Buffer<ffi::S32> device_buf, ffi::AnyBuffer grad, ffi::Buffer<ffi::S32> token,
                             ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadDeviceAndToken("scatter_accumulate", device_buf, token, &device, &tok, &err)) return InvalidArgument(err);
  OpTarget t;
  if (!ResolveTarget("scatter_accumulate", heap_id, bucket_id, device, true, &t, &err)) return InvalidArgument(err);
  Heap& h = *t.heap;
  const Bucket& b = *t.bucket;
  Dtype grad_t;
  if (!ToDtype(grad.element_type(), &grad_t))
    return InvalidArgument("jodc scatter_accumulate: gradient must be float32 or bfloat16");
  if (static_cast<int64_t>(grad.element_count()) != b.layout.numel) {
    return InvalidArgument("jodc scatter_accumulate: gradient has " + std::to_string(grad.element_count()) +
                           " elements, bucket " + std::to_string(bucket_id) + " has " +
                           std::to_string(b.layout.numel));
  }
  const char* src = static_cast<const char*>(grad.untyped_data());
  // bf16 gradients are widened once (MPI has no bf16 sum); fp32 ones are sent from XLA's buffer directly.
  std::vector<float> widened;
  const float* f32 = reinterpret_cast<const float*>(src);
  if (grad_t != Dtype::kF32) {
    widened.resize(b.layout.numel);
    CopyConvert(widened.data(), Dtype::kF32, src, grad_t, b.layout.numel);
    f32 = widened.data();
  }
  const int32_t world = b.layout.world;
  std::vector<char> touched(h.nprocs, 0);
  for (int32_t k = 1; k <= world; ++k) {
    const int32_t owner = (device + k) % world;  // own shard last: remote owners are served first
    const int64_t n = b.layout.valid(owner);
    if (n <= 0) continue;
    const int32_t r = h.dev_rank[owner], slot = h.dev_slot[owner];
    const int64_t disp = h.deterministic ? b.landing_disp(r, slot, device) : b.acc_disp(r, slot);
    int rc = AccumulateF32(f32 + b.layout.begin(owner), n, r, disp, MPI_SUM, b.win);
    if (rc != MPI_SUCCESS) return MpiFailure(h, "scatter_accumulate", "MPI_Accumulate", rc);
    touched[r] = 1;
  }
  for (int32_t r = 0; r < h.nprocs; ++r) {
    if (!touched[r]) continue;
    int rc = MPI_Win_flush(r, b.win);
    if (rc != MPI_SUCCESS) return MpiFailure(h, "scatter_accumulate", "MPI_Win_flush", rc);
  }
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jodc::mpi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcScatterAccumulateMpi, jodc::mpi::ScatterAccumulate,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::AnyBuffer>()              // full-size gradient (f32 / bf16)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));
