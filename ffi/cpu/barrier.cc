// barrier: blocks device d until every device of the heap has entered the same generation, or fails after the
// heap's timeout naming the devices that never arrived. Generations are per-device arrival counts kept here, so
// the barrier needs no reset between uses. A timeout poisons the heap: later ops fail instead of mismatching.
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

ffi::Error Barrier(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadScalar("barrier", "device", device_buf, &device, &err) ||
      !ReadScalar("barrier", "token", token, &tok, &err))
    return InvalidArgument(err);
  OpTarget t;
  if (!ResolveTarget("barrier", heap_id, /*bucket_id=*/-1, device, &t, &err)) return InvalidArgument(err);
  Heap& h = *t.heap;
  const double timeout_s = h.barrier_timeout_s.load();
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
  std::unique_lock<std::mutex> lock(h.mu);
  const uint64_t generation = ++h.arrivals[device];
  h.barrier_cv.notify_all();
  while (!AllArrived(h, generation)) {
    if (!h.poisoned.empty()) return ffi::Error(ffi::ErrorCode::kAborted, "jodc barrier: " + h.poisoned);
    if (h.barrier_cv.wait_until(lock, deadline) == std::cv_status::timeout && !AllArrived(h, generation)) {
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
  }
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jodc::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcBarrierCpu, jodc::cpu::Barrier,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap"));
