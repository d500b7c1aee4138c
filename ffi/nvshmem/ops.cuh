// Host and device helpers shared by the NVSHMEM op files: the handler frame (RunOp: operands, heap, bucket, poison,
// launch check, abort-on-error) and grid sizing. Kernels reuse ffi/cuda/device_util.cuh (conversions, device checks).
#ifndef JODC_FFI_NVSHMEM_OPS_CUH_
#define JODC_FFI_NVSHMEM_OPS_CUH_

#include <string>
#include <utility>

#include "common/bindings.h"
#include "common/operands.h"
#include "cuda/device_util.cuh"
#include "cuda/stream_device.cuh"
#include "nvshmem/heap.cuh"
#include "xla/ffi/api/ffi.h"

namespace jodc::nvshmem_backend {

namespace ffi = xla::ffi;

constexpr int kThreads = 256;

struct Target {
  std::shared_ptr<NvHeap> heap;
  std::shared_ptr<SymBucket> bucket;
};

inline ffi::Error Prepare(const char* op, cudaStream_t stream, const Scalar& device, const Scalar& token,
                          int64_t heap_id, int64_t bucket_id, Target* t) {
  if (ffi::Error e = CheckScalars(op, device, token); e.failure()) return e;
  auto heap = FindHeap(heap_id);
  if (!heap.has_value()) return ForOp(op, heap.error());
  t->heap = *heap;
  {
    std::lock_guard<std::mutex> lock(t->heap->mu);
    if (!t->heap->poisoned.empty())
      return ffi::Error::InvalidArgument(std::string("jodc ") + op + ": " + t->heap->poisoned);
  }
  if (const uint64_t fault = __atomic_load_n(&t->heap->control->fault, __ATOMIC_ACQUIRE); fault != 0)
    return ffi::Error::InvalidArgument(std::string("jodc ") + op + ": " + CurrentPoison(*t->heap));
  if (bucket_id >= 0) {
    auto bucket = FindBucket(t->heap, bucket_id);
    if (!bucket.has_value()) return ForOp(op, bucket.error());
    t->bucket = *bucket;
  }
  int32_t gpu = -1;
  return cuda::SelectStreamDevice(op, stream, &gpu);
}

// Any error of a handler poisons the heap on every PE, so their barriers stop waiting for this one.
inline ffi::Error AbortOnError(int64_t heap_id, ffi::Error e) {
  if (e.failure()) {
    if (auto heap = FindHeap(heap_id); heap.has_value()) {
      Poison(**heap, "aborted: PE failed: " + std::string(e.message()));
    }
  }
  return e;
}

// Runs `body(const Target&) -> Error` (checks the op's other operands, launches its kernel on `stream`) as op `op` on
// bucket `bucket_id` of heap `heap_id` in the frame of every GPU heap op (cuda::RunGpuOp): Prepare first, then the
// launch check; any error poisons the heap on every PE (AbortOnError).
template <typename Body>
ffi::Error RunOp(const char* op, cudaStream_t stream, const Scalar& device, const Scalar& token, int64_t heap_id,
                 int64_t bucket_id, Body&& body) {
  return cuda::RunGpuOp<Target>(
      [&](Target* t) { return Prepare(op, stream, device, token, heap_id, bucket_id, t); }, body,
      [&](const Target&) { return cuda::LaunchResult(op); },
      [&](ffi::Error e) { return AbortOnError(heap_id, std::move(e)); });
}

inline unsigned Blocks(int64_t items) {
  const int64_t b = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 1024 ? 1024 : b));
}

}  // namespace jodc::nvshmem_backend

#endif  // JODC_FFI_NVSHMEM_OPS_CUH_
