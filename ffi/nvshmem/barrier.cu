// jodc_nvshmem_barrier: PE d completes all its earlier puts and atomics (nvshmem_quiet), then writes its new arrival
// count into arrivals[d] on every PE; thread p then polls this PE's local arrivals[p] until it reaches the same
// generation, giving up at the heap's timeout or when the (symmetric) abort flag is set. The handler waits for the
// kernel and turns its report into success or an error naming the missing PEs, like the CUDA backend.
#include <sstream>

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
  __shared__ int32_t device;
  __shared__ uint64_t generation;
  __shared__ unsigned long long missing;
  __shared__ int32_t aborted;
  __shared__ uint64_t start_ns;
  if (threadIdx.x == 0) {
    device = *device_operand;
    missing = 0;
    aborted = 0;
    start_ns = cuda::GlobalTimerNs();
    if (device >= 0 && device < world) {
      nvshmem_quiet();  // this PE's earlier remote updates are complete before anyone sees it arrive
      generation = cuda::LoadRelaxedSystem(&arrivals[device]) + 1;
      for (int32_t pe = 0; pe < world; ++pe) nvshmem_uint64_p(&arrivals[device], generation, pe);
      nvshmem_quiet();
    }
  }
  __syncthreads();
  cuda::AwaitArrivals(arrivals, abort, world, device, generation, start_ns, timeout_ns, token_in, token_out, report,
                      &missing, &aborted);
}

ffi::Error BarrierImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                       ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id) {
  Target t;
  if (ffi::Error e = Prepare("barrier", stream, device, token, heap_id, -1, &t); e.failure()) return e;
  NvHeap& h = *t.heap;
  BarrierReport* report = nullptr;
  for (int32_t i = 0; i < h.world && report == nullptr; ++i) {
    if (!h.report_busy[i].exchange(true)) report = h.reports + i;
  }
  if (report == nullptr) return ffi::Error::Internal("jodc barrier: more barriers in flight than PEs");
  struct Return {
    NvHeap& heap;
    BarrierReport* report;
    ~Return() { heap.report_busy[report - heap.reports].store(false); }
  } give_back{h, report};
  volatile BarrierReport* seen = report;
  seen->outcome = kPending;
  const double timeout_s = h.barrier_timeout_s.load();
  const int64_t ns = TimeoutNanos(timeout_s);
  BarrierKernel<<<1, kMaxWorld, 0, stream>>>(h.arrivals, h.abort, h.world, device.typed_data(), token.typed_data(),
                                             token_out->typed_data(), ns > 0 ? static_cast<uint64_t>(ns) : 1u, report);
  if (ffi::Error e = Launched("barrier"); e.failure()) return e;
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) {
    cudaGetLastError();
    return ffi::Error::Internal("jodc barrier: " + cuda::CudaMessage("waiting for the barrier kernel", e));
  }
  switch (seen->outcome) {
    case kPassed:
      return ffi::Error::Success();
    case kBadDevice:
      return ffi::Error::InvalidArgument("jodc barrier: device index " + std::to_string(seen->device) +
                                         " outside [0, " + std::to_string(h.world) + ")");
    case kTimedOut: {
      std::ostringstream msg, missing;
      for (int32_t d = 0, first = 1; d < h.world; ++d) {
        if ((seen->missing >> d) & 1u) {
          missing << (first ? "" : ", ") << d;
          first = 0;
        }
      }
      msg << "jodc barrier timed out after " << timeout_s << " s in generation " << seen->generation << " of heap "
          << heap_id << ": device(s) [" << missing.str() << "] never arrived (device " << seen->device
          << " waited); the heap is now unusable: free and re-create it";
      Poison(h, msg.str());
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg.str());
    }
    case kAborted:
      return ffi::Error(ffi::ErrorCode::kAborted, "jodc barrier: " + CurrentPoison(h));
    default:
      return ffi::Error::Internal("jodc barrier: the kernel finished without reporting an outcome");
  }
}

ffi::Error Barrier(cudaStream_t stream, ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id) {
  return AbortOnError(heap_id, BarrierImpl(stream, device, token, token_out, heap_id));
}

}  // namespace
}  // namespace jodc::nvshmem_backend

JODC_NVSHMEM_HANDLER(Barrier, jodc::nvshmem_backend::Barrier);
