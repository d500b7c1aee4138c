// barrier: blocks device d until every device of the heap has entered the same generation, or fails after the
// heap's timeout naming the devices that never arrived. Generations are per-device arrival counts kept here, so
// the barrier needs no reset between uses. A timeout poisons the heap: later ops fail instead of mismatching. An abort
// (another device's op failed, or heap.abort from the host) wakes every waiting device, which fails with its cause.
// A timeout of +inf (or one too large for int64 nanoseconds) waits forever.
#include <algorithm>
#include <chrono>
#include <sstream>

#include "common/index_list.h"
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

bool AllArrived(const Heap& h, uint64_t generation) {
  for (uint64_t a : h.arrivals)
    if (a < generation) return false;
  return true;
}

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Longest single wait on the condition variable: deadlines far away (or none: an infinite timeout) are approached in
// rounds of this, so no clock conversion inside the standard library can overflow.
constexpr int64_t kMaxWaitRoundNs = int64_t{3600} * 1000000000;

// Waits for every device of the heap to enter device d's new generation (h.mu is taken here).
Error Wait(Heap& h, int32_t device, int64_t heap_id) {
  const double timeout_s = h.barrier_timeout_s.load();
  const int64_t deadline = DeadlineNanos(SteadyNowNs(), TimeoutNanos(timeout_s));  // kForeverNs: no deadline
  std::unique_lock<std::mutex> lock(h.mu);
  const uint64_t generation = ++h.arrivals[device];
  h.barrier_cv.notify_all();
  while (!AllArrived(h, generation)) {
    // An abort (a failed device, heap.abort, free) or a peer's timeout wakes us through the condition variable.
    if (!h.poisoned.empty()) return Error(ffi::ErrorCode::kAborted, "jodc barrier: " + h.poisoned);
    const int64_t now = SteadyNowNs();
    if (deadline != kForeverNs && now >= deadline) {
      std::ostringstream msg;
      msg << "jodc barrier timed out after " << timeout_s << " s in generation " << generation << " of heap "
          << heap_id << ": device(s) " << IndexList(h.world, [&](int32_t d) { return h.arrivals[d] < generation; })
          << " never arrived (device " << device << " waited); the heap is now unusable: free and re-create it";
      h.poisoned = msg.str();
      h.barrier_cv.notify_all();
      return Error(ffi::ErrorCode::kDeadlineExceeded, msg.str());
    }
    const int64_t wait_ns = deadline == kForeverNs ? kMaxWaitRoundNs : std::min(deadline - now, kMaxWaitRoundNs);
    h.barrier_cv.wait_for(lock, std::chrono::nanoseconds(wait_ns));
  }
  return Error::Success();
}

// Any error of this device aborts the heap (a timeout or an abort has already poisoned it with its own cause).
Error Barrier(Scalar device, Scalar token, TokenOut token_out, int64_t heap_id) {
  return RunOp("barrier", device, token, token_out, heap_id, /*bucket_id=*/-1,
               [&](const OpTarget& t, int32_t d) { return Wait(*t.heap, d, heap_id); });
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(Barrier, jodc::cpu::Barrier);
