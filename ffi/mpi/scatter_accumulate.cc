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

Error ScatterBody(const OpTarget& t, int32_t device, const ffi::AnyBuffer& grad, int64_t bucket_id) {
  Heap& h = *t.heap;
  const Bucket& b = *t.bucket;
  ErrorOr<Dtype> grad_dtype = CheckFullBucket("scatter_accumulate", "gradient", grad, b.layout, bucket_id);
  if (!grad_dtype.has_value()) return grad_dtype.error();
  const Dtype grad_t = *grad_dtype;
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
  return Error::Success();
}

Error ScatterAccumulate(Scalar device, ffi::AnyBuffer grad, Scalar token, TokenOut token_out, int64_t heap_id,
                        int64_t bucket_id) {
  return RunOp("scatter_accumulate", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) { return ScatterBody(t, d, grad, bucket_id); });
}

}  // namespace
}  // namespace jodc::mpi

JODC_MPI_HANDLER(ScatterAccumulate, jodc::mpi::ScatterAccumulate);
