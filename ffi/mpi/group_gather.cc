// group_gather (MPI): device d pulls the slot (shard of a bucket, padding included) of every member of a group named
// at run time into [k, shard] in its compute dtype, in list order. Slots mapped into this process (its own devices',
// and every peer's on a shared-memory heap) are copied directly; the others are pulled with MPI_Rget, all in flight
// at once and issued first so they overlap the direct copies.
#include <algorithm>
#include <vector>

#include "common/group.h"
#include "mpi/handler_util.h"
#include "mpi/handlers.h"

namespace jodc::mpi {
namespace {

Error GroupGatherBody(const OpTarget& t, int32_t device, const Scalar& members, ffi::AnyBuffer& out_buf) {
  Heap& h = *t.heap;
  const Bucket& b = *t.bucket;
  ErrorOr<GroupMembers> group = ReadMembers("group_gather", members, h.world, device);
  if (!group.has_value()) return group.error();
  const int32_t k = group->size();
  ErrorOr<Dtype> out_dtype = CheckGroupSlots("group_gather", "output", out_buf, b.layout, k);
  if (!out_dtype.has_value()) return out_dtype.error();
  const Dtype out_t = *out_dtype;
  const int64_t n = b.layout.shard_numel, slot_bytes = n * DtypeBytes(out_t), master_bytes = b.shard_bytes();
  char* dst = static_cast<char*>(out_buf.untyped_data());
  // Members' publishes (stores, then MPI_Win_sync, then their barrier arrival) are visible to our loads after this.
  if (h.shared_memory) {
    int rc = MPI_Win_sync(b.win);
    if (rc != MPI_SUCCESS) return MpiFailure(h, "group_gather", "MPI_Win_sync", rc);
  }
  std::vector<MPI_Request> reqs;
  std::vector<std::pair<int32_t, std::vector<char>>> staged;  // remote slots of another dtype: converted afterwards
  std::vector<int32_t> mapped;                                 // list indices copied directly
  for (int32_t j = 0; j < k; ++j) {
    const int32_t i = (group->caller + j) % k, owner = group->devices[i];
    if (MappedShard(h, b, owner) != nullptr) {
      mapped.push_back(i);
      continue;
    }
    char* land = dst + i * slot_bytes;
    if (out_t != b.master) {
      staged.emplace_back(i, std::vector<char>(master_bytes));
      land = staged.back().second.data();
    }
    const int32_t r = h.dev_rank[owner], slot = h.dev_slot[owner];
    for (int64_t off = 0; off < master_bytes; off += int64_t{1} << 30) {
      const int c = static_cast<int>(std::min<int64_t>(int64_t{1} << 30, master_bytes - off));
      MPI_Request req;
      int rc = MPI_Rget(land + off, c, MPI_BYTE, r, static_cast<MPI_Aint>(b.shard_disp(slot) + off), c, MPI_BYTE,
                        b.win, &req);
      if (rc != MPI_SUCCESS) {
        if (!reqs.empty()) MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
        return MpiFailure(h, "group_gather", "MPI_Rget", rc);
      }
      reqs.push_back(req);
    }
  }
  for (const int32_t i : mapped) CopyConvert(dst + i * slot_bytes, out_t, MappedShard(h, b, group->devices[i]), b.master, n);
  if (!reqs.empty()) {
    int rc = MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return MpiFailure(h, "group_gather", "MPI_Waitall", rc);
  }
  for (const auto& [i, data] : staged) CopyConvert(dst + i * slot_bytes, out_t, data.data(), b.master, n);
  return Error::Success();
}

Error GroupGather(Scalar device, Scalar members, Scalar token, ffi::Result<ffi::AnyBuffer> out, TokenOut token_out,
                  int64_t heap_id, int64_t bucket_id) {
  return RunOp("group_gather", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) { return GroupGatherBody(t, d, members, *out); });
}

}  // namespace
}  // namespace jodc::mpi

JODC_MPI_HANDLER(GroupGather, jodc::mpi::GroupGather);
