// barrier: blocks device d until every device of the heap has entered the same generation, or fails after the
// heap's timeout naming the devices that never arrived. Generations are per-device arrival counts kept here, so
// the barrier needs no reset between uses. A timeout poisons the heap: later ops fail instead of mismatching. An abort
// (another device's op failed, or heap.abort from the host) wakes every waiting device, which fails with its cause.
// A timeout of +inf (or one too large for int64 nanoseconds) waits forever.
#include <algorithm>
#include <chrono>
#include <sstream>

#include "cpu/handler_util.h"
#include "cpu/handlers.h"
#include "cpu/heap.h"

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

ffi::Error BarrierImpl(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token,
                       ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int32_t* device_out) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadScalar("barrier", "device", device_buf, &device, &err) ||
      !ReadScalar("barrier", "token", token, &tok, &err))
    return InvalidArgument(err);
  *device_out = device;
  OpTarget t;
  if (!ResolveTarget("barrier", heap_id, /*bucket_id=*/-1, device, &t, &err)) return InvalidArgument(err);
  Heap& h = *t.heap;
  const double timeout_s = h.barrier_timeout_s.load();
  const int64_t deadline = DeadlineNanos(SteadyNowNs(), TimeoutNanos(timeout_s));  // kForeverNs: no deadline
  std::unique_lock<std::mutex> lock(h.mu);
  const uint64_t generation = ++h.arrivals[device];
  h.barrier_cv.notify_all();
  while (!AllArrived(h, generation)) {
    // An abort (a failed device, heap.abort, free) or a peer's timeout wakes us through the condition variable.
    if (!h.poisoned.empty()) return ffi::Error(ffi::ErrorCode::kAborted, "jodc barrier: " + h.poisoned);
    const int64_t now = SteadyNowNs();
    if (deadline != kForeverNs && now >= deadline) {
      std::ostringstream msg;
      msg << "jodc barrier timed out after " << timeout_s << " s in generation " << generation << " of heap "
          << heap_id << ": device(s) [";
      bool first = true;
      for (int32_t d = 0; d < h.world; ++d) {
        if (h.arrivals[d] < generation) {
          msg << (first ? "" : ", ") << d;
          first = false;
        }
      }
      msg << "] never arrived (device " << device << " waited); the heap is now unusable: free and re-create it";
      h.poisoned = msg.str();
      h.barrier_cv.notify_all();
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg.str());
    }
    const int64_t wait_ns = deadline == kForeverNs ? kMaxWaitRoundNs : std::min(deadline - now, kMaxWaitRoundNs);
    h.barrier_cv.wait_for(lock, std::chrono::nanoseconds(wait_ns));
  }
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

// Any error of this device aborts the heap (a timeout or an abort has already poisoned it with its own cause).
ffi::Error Barrier(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id) {
  int32_t device = -1;
  ffi::Error e = BarrierImpl(device_buf, token, token_out, heap_id, &device);
  if (e.failure()) AbortOnHandlerError(heap_id, device, e.message());
  return e;
}

}  // namespace
}  // namespace jodc::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcBarrierCpu, jodc::cpu::Barrier,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap"));
