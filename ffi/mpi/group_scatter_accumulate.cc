// group_scatter_accumulate (MPI): device d adds slice i of [k, shard] into the fp32 accumulator of the i-th member of a
// group named at run time with MPI_Accumulate(MPI_SUM) (deterministic mode: into the (member, d) landing slot), and
// flushes every process it touched before returning, so the pushes are complete before d enters a barrier.
#include <vector>

#include "common/group.h"
#include "mpi/handler_util.h"
#include "mpi/handlers.h"

namespace jodc::mpi {
namespace {

Error GroupScatterBody(const OpTarget& t, int32_t device, const Scalar& members, const ffi::AnyBuffer& slices) {
  Heap& h = *t.heap;
  const Bucket& b = *t.bucket;
  ErrorOr<GroupMembers> group = ReadMembers("group_scatter_accumulate", members, h.world, device);
  if (!group.has_value()) return group.error();
  const int32_t k = group->size();
  ErrorOr<Dtype> in_dtype = CheckGroupSlots("group_scatter_accumulate", "slices", slices, b.layout, k);
  if (!in_dtype.has_value()) return in_dtype.error();
  const int64_t n = b.layout.shard_numel;
  // bf16 slices are widened once (MPI has no bf16 sum); fp32 ones are sent from XLA's buffer directly.
  std::vector<float> widened;
  const float* f32 = static_cast<const float*>(slices.untyped_data());
  if (*in_dtype != Dtype::kF32) {
    widened.resize(n * k);
    CopyConvert(widened.data(), Dtype::kF32, slices.untyped_data(), *in_dtype, n * k);
    f32 = widened.data();
  }
  std::vector<char> touched(h.nprocs, 0);
  for (int32_t j = 1; j <= k; ++j) {
    const int32_t i = (group->caller + j) % k, owner = group->devices[i];  // own slot last
    const int32_t r = h.dev_rank[owner], slot = h.dev_slot[owner];
    const int64_t disp = h.deterministic ? b.landing_disp(r, slot, device) : b.acc_disp(r, slot);
    int rc = AccumulateF32(f32 + i * n, n, r, disp, MPI_SUM, b.win);
    if (rc != MPI_SUCCESS) return MpiFailure(h, "group_scatter_accumulate", "MPI_Accumulate", rc);
    touched[r] = 1;
  }
  for (int32_t r = 0; r < h.nprocs; ++r) {
    if (!touched[r]) continue;
    int rc = MPI_Win_flush(r, b.win);
    if (rc != MPI_SUCCESS) return MpiFailure(h, "group_scatter_accumulate", "MPI_Win_flush", rc);
  }
  return Error::Success();
}

Error GroupScatterAccumulate(Scalar device, Scalar members, ffi::AnyBuffer slices, Scalar token, TokenOut token_out,
                             int64_t heap_id, int64_t bucket_id) {
  return RunOp("group_scatter_accumulate", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) { return GroupScatterBody(t, d, members, slices); });
}

}  // namespace
}  // namespace jodc::mpi

JODC_MPI_HANDLER(GroupScatterAccumulate, jodc::mpi::GroupScatterAccumulate);
