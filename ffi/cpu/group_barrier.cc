// group_barrier: blocks device d until every member of a group named at run time has entered the same barrier; the
// other devices of the heap are not involved (they may run other groups' barriers at the same time). Generations are
// per pair of devices: entering, d counts one more barrier shared with each member m (pair_arrivals[d][m]) and waits
// until each m has counted as many with d. Consecutive barriers of one group, a group that changes between
// barriers, and disjoint groups at the same time therefore never mix, with no reset. Bounded as the world barrier:
// after the heap's timeout it fails naming the members that never arrived and poisons the heap; an abort wakes it.
#include <sstream>
#include <vector>

#include "common/group.h"
#include "common/index_list.h"
#include "cpu/barrier_wait.h"
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

Error Wait(Heap& h, int32_t device, const GroupMembers& group, int64_t heap_id) {
  const double timeout_s = h.barrier_timeout_s.load();
  const int32_t k = group.size(), world = h.world;
  std::unique_lock<std::mutex> lock(h.mu);
  std::vector<uint64_t> generation(k, 0);
  for (int32_t i = 0; i < k; ++i) {
    const int32_t m = group.devices[i];
    if (m != device) generation[i] = ++h.pair_arrivals[static_cast<size_t>(device) * world + m];
  }
  h.barrier_cv.notify_all();
  auto missing = [&](int32_t i) {
    const int32_t m = group.devices[i];
    return m != device && h.pair_arrivals[static_cast<size_t>(m) * world + device] < generation[i];
  };
  const WaitResult r = WaitForBarrier(h, lock, timeout_s, [&] {
    for (int32_t i = 0; i < k; ++i)
      if (missing(i)) return false;
    return true;
  });
  if (r == WaitResult::kDone) return Error::Success();
  if (r == WaitResult::kPoisoned) return Error(ffi::ErrorCode::kAborted, "jodc group_barrier: " + h.poisoned);
  std::ostringstream msg;
  msg << "jodc group_barrier timed out after " << timeout_s << " s in heap " << heap_id << ": member(s) "
      << IndexList(world, [&](int32_t m) {
           for (int32_t i = 0; i < k; ++i)
             if (group.devices[i] == m) return missing(i);
           return false;
         })
      << " of group " << IndexList(world, [&](int32_t m) {
           for (int32_t x : group.devices)
             if (x == m) return true;
           return false;
         })
      << " never arrived (device " << device << " waited); the heap is now unusable: free and re-create it";
  h.poisoned = msg.str();
  h.barrier_cv.notify_all();
  return Error(ffi::ErrorCode::kDeadlineExceeded, msg.str());
}

// Any error of this device aborts the heap (a timeout or an abort has already poisoned it with its own cause).
Error GroupBarrier(Scalar device, Scalar members, Scalar token, TokenOut token_out, int64_t heap_id) {
  return RunOp("group_barrier", device, token, token_out, heap_id, /*bucket_id=*/-1,
               [&](const OpTarget& t, int32_t d) -> Error {
                 ErrorOr<GroupMembers> group = ReadMembers("group_barrier", members, t.heap->world, d);
                 if (!group.has_value()) return group.error();
                 return Wait(*t.heap, d, *group, heap_id);
               });
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(GroupBarrier, jodc::cpu::GroupBarrier);
