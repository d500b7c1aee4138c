// jodc_nvshmem_barrier: PE d completes all its earlier puts and atomics (nvshmem_quiet), then writes its new arrival
// count into arrivals[d] on every PE; thread p then polls this PE's local arrivals[p] until it reaches the same
// generation, giving up at the heap's timeout or when the (symmetric) abort flag is set. The handler waits for the
// kernel and turns its report into success or an error naming the missing PEs, like the CUDA backend.
#include "nvshmem/handlers.cuh"
#include "nvshmem/ops.cuh"

namespace jodc::nvshmem_backend {
namespace {

using cuda::kAborted;
using cuda::kBadDevice;
using cuda::kPassed;
using cuda::kPending;
using cuda::kTimedOut;

__global__ void __launch_bounds__(kMaxWorld)
    BarrierKernel(uint64_t* arrivals, int32_t* abort, int32_t world, const int32_t* device_operand,
                  const int32_t* token_in, int32_t* token_out, uint64_t timeout_ns, BarrierReport* report) {
  cuda::RunBarrier(arrivals, abort, world, device_operand, token_in, token_out, timeout_ns, report,
                   [arrivals, world](int32_t device) {
                     nvshmem_quiet();  // this PE's earlier remote updates are complete before anyone sees it arrive
                     const uint64_t generation = cuda::LoadRelaxedSystem(&arrivals[device]) + 1;
                     for (int32_t pe = 0; pe < world; ++pe) nvshmem_uint64_p(&arrivals[device], generation, pe);
                     nvshmem_quiet();
                     return generation;
                   });
}

ffi::Error BarrierImpl(cudaStream_t stream, Scalar device, Scalar token, TokenOut token_out, int64_t heap_id) {
  Target t;
  if (ffi::Error e = Prepare("barrier", stream, device, token, heap_id, -1, &t); e.failure()) return e;
  NvHeap& h = *t.heap;
  cuda::BarrierReports::Lease report = h.reports.Borrow();
  if (report == nullptr) return cuda::TooManyBarriers(h.world, heap_id);
  volatile BarrierReport* seen = report.get();
  seen->outcome = kPending;
  const double timeout_s = h.barrier_timeout_s.load();
  BarrierKernel<<<1, kMaxWorld, 0, stream>>>(h.arrivals, h.abort, h.world, device.typed_data(), token.typed_data(),
                                             token_out->typed_data(), cuda::BarrierTimeoutTicks(timeout_s),
                                             report.get());
  if (ffi::Error e = cuda::LaunchResult("barrier"); e.failure()) return e;
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) {
    cudaGetLastError();
    return ffi::Error::Internal("jodc barrier: " + cuda::CudaMessage("waiting for the barrier kernel", e));
  }
  switch (seen->outcome) {
    case kPassed:
      return ffi::Error::Success();
    case kBadDevice:
      return ffi::Error::InvalidArgument("jodc barrier: device index " + std::to_string(seen->device) +
                                         " outside [0, " + std::to_string(h.world) + ") of heap " +
                                         std::to_string(heap_id));
    case kTimedOut: {
      const std::string msg = cuda::BarrierTimeoutMessage(timeout_s, *report, h.world, heap_id);
      Poison(h, msg);
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg);
    }
    case kAborted:
      return ffi::Error(ffi::ErrorCode::kAborted, "jodc barrier: " + CurrentPoison(h));
    default:
      return ffi::Error::Internal("jodc barrier: the kernel finished without reporting an outcome");
  }
}

// Any error of this PE poisons the heap on every PE (a timeout or an abort has already poisoned it with its cause).
ffi::Error Barrier(cudaStream_t stream, Scalar device, Scalar token, TokenOut token_out, int64_t heap_id) {
  return AbortOnError(heap_id, BarrierImpl(stream, device, token, token_out, heap_id));
}

}  // namespace
}  // namespace jodc::nvshmem_backend

JODC_NVSHMEM_HANDLER(Barrier, jodc::nvshmem_backend::Barrier);
