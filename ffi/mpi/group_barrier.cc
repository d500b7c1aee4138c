// group_barrier (MPI): device d meets only the members of a group named at run time. Generations are per pair of
// devices (ffi/cpu/group_barrier.cc): d counts one more barrier shared with each member m, writes that count into m's
// process's control window (pair word (d, m), atomic replace, flushed), then waits until every member m has written
// at least as many into this process's window (pair word (m, d)). The wait is the heap's control-window loop, so it
// times out naming the members that never arrived (and their processes) and notices a peer's abort.
#include <sstream>
#include <vector>

#include "common/group.h"
#include "common/index_list.h"
#include "mpi/handler_util.h"
#include "mpi/handlers.h"

namespace jodc::mpi {
namespace {

Error Wait(Heap& h, int32_t device, const GroupMembers& group, int64_t heap_id) {
  const double timeout_s = h.barrier_timeout_s.load();
  const int32_t k = group.size(), world = h.world;
  std::vector<int64_t> generation(k, 0);
  {
    std::lock_guard<std::mutex> lock(h.mu);
    for (int32_t i = 0; i < k; ++i) {
      const int32_t m = group.devices[i];
      if (m != device) generation[i] = static_cast<int64_t>(++h.pair_arrivals[static_cast<size_t>(device) * world + m]);
    }
  }
  // This device's pushes were flushed by their ops, so they are complete at their owners before members see this.
  std::vector<char> touched(h.nprocs, 0);
  for (int32_t i = 0; i < k; ++i) {
    const int32_t m = group.devices[i];
    if (m == device) continue;
    const int32_t r = h.dev_rank[m];
    int rc = MPI_Accumulate(&generation[i], 1, MPI_INT64_T, r, static_cast<MPI_Aint>(h.pair_word(device, m) * 8), 1,
                            MPI_INT64_T, MPI_REPLACE, h.ctl);
    if (rc != MPI_SUCCESS) return MpiFailure(h, "group_barrier", "MPI_Accumulate", rc);
    touched[r] = 1;
  }
  for (int32_t r = 0; r < h.nprocs; ++r) {
    if (!touched[r]) continue;
    int rc = MPI_Win_flush(r, h.ctl);
    if (rc != MPI_SUCCESS) return MpiFailure(h, "group_barrier", "MPI_Win_flush", rc);
  }
  std::unique_lock<std::mutex> lock(h.mu);
  auto missing = [&](int32_t i) {
    const int32_t m = group.devices[i];
    return m != device && h.seen[h.pair_word(m, device)] < generation[i];
  };
  auto all_arrived = [&] {
    for (int32_t i = 0; i < k; ++i)
      if (missing(i)) return false;
    return true;
  };
  Error mpi_err;
  const int rc = WaitControl(h, lock, timeout_s, all_arrived, &mpi_err);
  if (rc == 0) return Error::Success();
  if (rc == 1) return Error(ffi::ErrorCode::kAborted, "jodc group_barrier: " + h.poisoned);
  if (rc == 3) {
    lock.unlock();
    return Error::Internal(Poison(h, mpi_err.message()));
  }
  auto missing_device = [&](int32_t d) {
    for (int32_t i = 0; i < k; ++i)
      if (group.devices[i] == d) return missing(i);
    return false;
  };
  std::ostringstream msg;
  msg << "jodc group_barrier timed out after " << timeout_s << " s in MPI heap " << heap_id << ": member(s) "
      << IndexList(world, missing_device) << " of group " << IndexList(world, [&](int32_t d) {
           for (int32_t x : group.devices)
             if (x == d) return true;
           return false;
         })
      << " never arrived (held by process(es) " << IndexList(h.nprocs, [&](int32_t r) {
           for (int32_t d = 0; d < world; ++d)
             if (missing_device(d) && h.dev_rank[d] == r) return true;
           return false;
         })
      << "; device " << device << " of process " << h.rank
      << " waited); the heap is now unusable: free and re-create it";
  lock.unlock();
  return Error(ffi::ErrorCode::kDeadlineExceeded, Poison(h, msg.str()));
}

Error GroupBarrier(Scalar device, Scalar members, Scalar token, TokenOut token_out, int64_t heap_id) {
  return RunOp("group_barrier", device, token, token_out, heap_id, /*bucket_id=*/-1,
               [&](const OpTarget& t, int32_t d) -> Error {
                 ErrorOr<GroupMembers> group = ReadMembers("group_barrier", members, t.heap->world, d);
                 if (!group.has_value()) return group.error();
                 return Wait(*t.heap, d, *group, heap_id);
               });
}

}  // namespace
}  // namespace jodc::mpi

JODC_MPI_HANDLER(GroupBarrier, jodc::mpi::GroupBarrier);
