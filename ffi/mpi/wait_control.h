// WaitControl: the one waiting loop of the MPI heap (barriers, collective rendezvous). Waiters hold the heap mutex;
// one of them at a time polls this process's control window (atomic reads, no MPI_Barrier, so it can time out and
// notice a peer's abort), the others sleep on the heap's condition variable.
#ifndef JODC_FFI_MPI_WAIT_CONTROL_H_
#define JODC_FFI_MPI_WAIT_CONTROL_H_

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>
#include <utility>

namespace jodc::mpi {

template <typename Done>
int WaitControl(Heap& h, std::unique_lock<std::mutex>& lock, double timeout_s, Done done, Error* err) {
  using Clock = std::chrono::steady_clock;
  const bool forever = std::isinf(timeout_s);
  const auto deadline =
      forever ? Clock::time_point::max()
              : Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  int backoff_us = 2;
  while (true) {
    if (!h.poisoned.empty()) return 1;
    if (done()) return 0;
    if (Clock::now() >= deadline) return 2;
    if (!h.polling) {
      h.polling = true;
      lock.unlock();
      Error polled = PollControl(h);
      lock.lock();
      h.polling = false;
      h.cv.notify_all();
      if (polled.failure()) {
        *err = std::move(polled);
        return 3;
      }
      if (!h.poisoned.empty()) return 1;
      if (done()) return 0;
      // Nothing yet: back off (2 us .. 200 us) so a waiting process leaves the cores to the ones computing.
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
      backoff_us = std::min(backoff_us * 2, 200);
      lock.lock();
    } else {
      h.cv.wait_for(lock, std::chrono::microseconds(500));
    }
  }
}

}  // namespace jodc::mpi

#endif  // JODC_FFI_MPI_WAIT_CONTROL_H_
