// The waiting loop of the CPU heap's barriers (the world barrier and the group barrier): sleep on the heap's condition
// variable until the barrier's condition holds, the heap is poisoned (an abort, a peer's timeout, free) or the
// heap's timeout passes. A timeout of +inf (or one too large for int64 nanoseconds) waits forever.
#ifndef JODC_FFI_CPU_BARRIER_WAIT_H_
#define JODC_FFI_CPU_BARRIER_WAIT_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>

#include "common/layout.h"
#include "cpu/heap.h"

namespace jodc::cpu {

enum class WaitResult { kDone, kPoisoned, kTimedOut };

inline int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Longest single wait on the condition variable: deadlines far away (or none: an infinite timeout) are approached in
// rounds of this, so no clock conversion inside the standard library can overflow.
constexpr int64_t kMaxWaitRoundNs = int64_t{3600} * 1000000000;

// Waits, `lock` holding h.mu, until `done()` holds; returns why it stopped waiting.
template <typename Done>
WaitResult WaitForBarrier(Heap& h, std::unique_lock<std::mutex>& lock, double timeout_s, Done done) {
  const int64_t deadline = DeadlineNanos(SteadyNowNs(), TimeoutNanos(timeout_s));  // kForeverNs: no deadline
  while (!done()) {
    if (!h.poisoned.empty()) return WaitResult::kPoisoned;
    const int64_t now = SteadyNowNs();
    if (deadline != kForeverNs && now >= deadline) return WaitResult::kTimedOut;
    const int64_t wait_ns = deadline == kForeverNs ? kMaxWaitRoundNs : std::min(deadline - now, kMaxWaitRoundNs);
    h.barrier_cv.wait_for(lock, std::chrono::nanoseconds(wait_ns));
  }
  return WaitResult::kDone;
}

}  // namespace jodc::cpu

#endif  // JODC_FFI_CPU_BARRIER_WAIT_H_
