// barrier: blocks device d until every device of the heap has entered the same generation, or fails after the
// heap's timeout naming the devices that never arrived. Generations are per-device arrival counts kept here, so
// the barrier needs no reset between uses. A timeout poisons the heap: later ops fail instead of mismatching. An abort
// (another device's op failed, or heap.abort from the host) wakes every waiting device, which fails with its cause.
// A timeout of +inf (or one too large for int64 nanoseconds) waits forever.
#include <sstream>

#include "common/index_list.h"
#include "cpu/barrier_wait.h"
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

bool AllArrived(const Heap& h, uint64_t generation) {
  for (uint64_t a : h.arrivals)
    if (a < generation) return false;
  return true;
}

// Waits for every device of the heap to enter device d's new generation (h.mu is taken here).
Error Wait(Heap& h, int32_t device, int64_t heap_id) {
  const double timeout_s = h.barrier_timeout_s.load();
  std::unique_lock<std::mutex> lock(h.mu);
  const uint64_t generation = ++h.arrivals[device];
  h.barrier_cv.notify_all();
  const WaitResult r = WaitForBarrier(h, lock, timeout_s, [&] { return AllArrived(h, generation); });
  if (r == WaitResult::kDone) return Error::Success();
  if (r == WaitResult::kPoisoned) return Error(ffi::ErrorCode::kAborted, "jodc barrier: " + h.poisoned);
  std::ostringstream msg;
  msg << "jodc barrier timed out after " << timeout_s << " s in generation " << generation << " of heap " << heap_id
      << ": device(s) " << IndexList(h.world, [&](int32_t d) { return h.arrivals[d] < generation; })
      << " never arrived (device " << device << " waited); the heap is now unusable: free and re-create it";
  h.poisoned = msg.str();
  h.barrier_cv.notify_all();
  return Error(ffi::ErrorCode::kDeadlineExceeded, msg.str());
}

// Any error of this device aborts the heap (a timeout or an abort has already poisoned it with its own cause).
Error Barrier(Scalar device, Scalar token, TokenOut token_out, int64_t heap_id) {
  return RunOp("barrier", device, token, token_out, heap_id, /*bucket_id=*/-1,
               [&](const OpTarget& t, int32_t d) { return Wait(*t.heap, d, heap_id); });
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(Barrier, jodc::cpu::Barrier);
