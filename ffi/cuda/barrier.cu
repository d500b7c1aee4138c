// barrier: device d waits, on the GPU, until every device of the heap has entered the same generation, or gives up
// after the heap's timeout. Generations are per-device arrival counters in the heap's pinned control block (mapped
// into every GPU and readable by the host), so the barrier never needs a reset between uses.
//
// Protocol (one block, one thread per device):
//   arrive: thread 0 fences all earlier writes of this device (its scatters into peers' memory, its publish) at
//           system scope, then stores arrivals[d] = g = arrivals[d] + 1 with a system-scope release;
//   wait:   thread p polls arrivals[p] with system-scope acquire loads until it reaches g, backing off with
//           __nanosleep; it stops early when the host sets `abort` (heap poisoned or freed) or when %globaltimer says
//           the timeout has passed;
//   report: thread 0 writes the outcome and the devices still missing into a host-mapped report (one of the heap's
//           `world` reports, allocated with the heap: nothing is allocated, and nothing synchronises, while peers
//           may already spin).
// The handler then synchronises its stream (the one blocking host wait of the ODC ops, once per minibatch) and turns
// the report into success or an ffi::Error naming the missing devices; a timeout poisons the heap like on CPU.
#include "cuda/device_util.cuh"
#include "cuda/handler_util.cuh"
#include "cuda/handlers.cuh"

namespace jodc::cuda {
namespace {

__global__ void __launch_bounds__(kMaxWorld)
    BarrierKernel(HeapControl* control, int32_t world, const int32_t* device_operand, const int32_t* token_in,
                  int32_t* token_out, uint64_t timeout_ns, BarrierReport* report) {
  RunBarrier(control->arrivals, &control->abort, world, device_operand, token_in, token_out, timeout_ns, report,
             [control](int32_t device) {
               __threadfence_system();  // earlier kernels' writes (peer accumulators, published shard) first
               const uint64_t generation = LoadRelaxedSystem(&control->arrivals[device]) + 1;  // only d writes it
               StoreReleaseSystem(&control->arrivals[device], generation);
               return generation;
             });
}

ffi::Error BarrierImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                       ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id) {
  OpTarget t;
  if (ffi::Error e = Prepare("barrier", stream, device, token, heap_id, /*bucket_id=*/-1, &t); e.failure()) return e;
  Heap& h = *t.heap;
  std::string why;
  // A report of the heap's own, borrowed for this call (the handler waits for its kernel before returning it).
  BarrierReports::Lease report = h.reports.Borrow();
  if (report == nullptr) return TooManyBarriers(h.world, heap_id);
  volatile BarrierReport* seen = report.get();
  seen->outcome = kPending;
  const double timeout_s = h.barrier_timeout_s.load();
  BarrierKernel<<<1, kMaxWorld, 0, stream>>>(h.control_dev, h.world, device.typed_data(), token.typed_data(),
                                             token_out->typed_data(), BarrierTimeoutTicks(timeout_s), report.get());
  // No Launched(): this handler waits for its kernel below, so the heap never has to.
  if (ffi::Error e = LaunchResult("barrier"); e.failure()) return e;
  // The one host wait of the ODC ops: it makes a timeout an error of this very call instead of a silent hang.
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) {
    cudaGetLastError();
    std::lock_guard<std::mutex> lock(h.mu);
    const std::string msg = CudaMessage(
        ("waiting for the barrier on GPU " + std::to_string(t.gpu) + " (this or an earlier kernel on it)").c_str(), e);
    PoisonLocked(h, msg);
    return ffi::Error::Internal("jodc barrier: " + msg);
  }
  const int32_t outcome = seen->outcome;
  const int32_t me = seen->device;
  switch (outcome) {
    case kPassed:
      break;
    case kBadDevice:
      return InvalidArgument("jodc barrier: device index " + std::to_string(me) + " outside [0, " +
                             std::to_string(h.world) + ") of heap " + std::to_string(heap_id));
    case kTimedOut: {
      const std::string msg = BarrierTimeoutMessage(timeout_s, *report, h.world, heap_id);
      std::lock_guard<std::mutex> lock(h.mu);
      PoisonLocked(h, msg);
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg);
    }
    case kAborted: {
      // The cause: this process's poison, or (a multi-process heap) the one another process shared with its abort.
      std::string cause = CurrentPoison(h);
      if (cause.empty()) {
        std::lock_guard<std::mutex> lock(h.mu);
        cause = PoisonLocked(h, "heap was poisoned");
      }
      return ffi::Error(ffi::ErrorCode::kAborted, "jodc barrier: " + cause);
    }
    default:
      return ffi::Error::Internal("jodc barrier: the barrier kernel of heap " + std::to_string(heap_id) +
                                  " finished without reporting an outcome");
  }
  // Faults recorded by this device's earlier kernels (or a peer's) surface here at the latest.
  if (!CheckHealthy("barrier", h, &why)) return InvalidArgument(why);
  return ffi::Error::Success();
}

// Any error of this device aborts the heap (a timeout or an abort has already poisoned it with its own cause).
ffi::Error Barrier(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id) {
  return AbortOnError(heap_id, BarrierImpl(stream, device, token, token_out, heap_id));
}

}  // namespace
}  // namespace jodc::cuda

JODC_CUDA_HANDLER(Barrier, jodc::cuda::Barrier);
