// Host-side helpers shared by the CUDA FFI handlers: the common preamble (operands, heap, bucket, stream's GPU),
// dtype mapping, launch-error checks and grid sizing.
#ifndef JODC_FFI_CUDA_HANDLER_UTIL_CUH_
#define JODC_FFI_CUDA_HANDLER_UTIL_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "common/bindings.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/operands.h"
#include "cuda/heap.cuh"
#include "cuda/stream_device.cuh"
#include "xla/ffi/api/ffi.h"

namespace jodc::cuda {

namespace ffi = xla::ffi;

constexpr int kThreadsPerBlock = 256;


struct OpTarget {
  std::shared_ptr<Heap> heap;
  std::shared_ptr<Bucket> bucket;  // null for heap-level ops (barrier)
  int32_t gpu = -1;                // the CUDA device of the stream the op runs on
};

// Fails with the heap's poison message, first turning a fault recorded by an earlier kernel into poison.
inline bool CheckHealthy(const char* op, Heap& heap, std::string* err) {
  const std::string poisoned = CurrentPoison(heap);
  if (poisoned.empty()) return true;
  *err = std::string("jodc ") + op + ": " + poisoned;
  return false;
}

// The common preamble of every handler: the device and token operands are int32 scalars (their values stay on the
// GPU: kernels read them, the host never does), the heap exists and is healthy, the bucket exists (bucket_id >= 0),
// and the stream's GPU is the calling thread's current device so that launches go to it.
inline ffi::Error Prepare(const char* op, cudaStream_t stream, const Scalar& device, const Scalar& token,
                          int64_t heap_id, int64_t bucket_id, OpTarget* out) {
  if (ffi::Error e = CheckScalars(op, device, token); e.failure()) return e;
  auto heap = FindHeap(heap_id);
  if (!heap.has_value()) return ForOp(op, heap.error());
  out->heap = *heap;
  std::string why;
  if (!CheckHealthy(op, *out->heap, &why)) return InvalidArgument(why);
  if (bucket_id >= 0) {
    auto bucket = FindBucket(out->heap, bucket_id);
    if (!bucket.has_value()) return ForOp(op, bucket.error());
    out->bucket = *bucket;
  }
  return SelectStreamDevice(op, stream, &out->gpu);
}

// Returns `e`, first aborting the heap when `e` is a failure: every handler's errors go through this, so that peers
// spinning in a barrier kernel for this device leave at once (with this error as the cause) instead of waiting for
// the timeout. A timeout or an abort already poisoned the heap; its first cause stays.
inline ffi::Error AbortOnError(int64_t heap_id, ffi::Error e) {
  if (e.failure()) AbortOnHandlerError(heap_id, e.message());
  return e;
}

// After a heap op's launch: the launch error, if any; else records the launch with the heap, so freeing the heap or a
// bucket waits for exactly this heap's queued work.
inline ffi::Error Launched(const char* op, cudaStream_t stream, const OpTarget& t) {
  if (ffi::Error e = LaunchResult(op); e.failure()) return e;
  if (ffi::Error e = t.heap->NoteLaunch(stream, t.gpu); e.failure()) return ForOp(op, e);
  return ffi::Error::Success();
}

// Runs `body(const OpTarget&) -> Error` (checks operands, launches the op's kernel on `stream`) as op `op` on bucket
// `bucket_id` of heap `heap_id` in the frame of every GPU heap op (RunGpuOp): the common preamble (Prepare) first,
// then the launch check and the launch's record with the heap (Launched); any error aborts the heap (AbortOnError).
template <typename Body>
ffi::Error RunOp(const char* op, cudaStream_t stream, const Scalar& device, const Scalar& token, int64_t heap_id,
                 int64_t bucket_id, Body&& body) {
  return RunGpuOp<OpTarget>(
      [&](OpTarget* t) { return Prepare(op, stream, device, token, heap_id, bucket_id, t); }, body,
      [&](const OpTarget& t) { return Launched(op, stream, t); },
      [&](ffi::Error e) { return AbortOnError(heap_id, std::move(e)); });
}

// Streaming multiprocessors of `gpu`, cached (queried once per GPU).
inline int SmCount(int32_t gpu) {
  static std::array<std::atomic<int>, 256> cache{};
  if (gpu < 0 || gpu >= static_cast<int32_t>(cache.size())) return 80;
  int sms = cache[gpu].load(std::memory_order_relaxed);
  if (sms == 0) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, gpu) != cudaSuccess || sms < 1) {
      cudaGetLastError();
      sms = 80;
    }
    cache[gpu].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// Blocks for a grid-stride loop over `items` thread work items, sharing about four blocks per SM among `shares`
// concurrent ranges (one per peer along grid dimension y): enough to saturate NVLink without oversubscribing.
inline unsigned BlocksFor(int64_t items, int32_t gpu, int32_t shares) {
  const int64_t wanted = (items + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const int64_t cap = std::max<int64_t>(1, 4 * static_cast<int64_t>(SmCount(gpu)) / std::max(shares, 1));
  return static_cast<unsigned>(std::clamp<int64_t>(wanted, 1, cap));
}

}  // namespace jodc::cuda

// Defines the CUDA handler symbol Jodc<Camel>Cuda of op Camel (ffi/common/ops.h, binding: ffi/common/bindings.h,
// after the platform stream every CUDA handler takes first).
#define JODC_CUDA_HANDLER(Camel, impl) \
  JODC_DEFINE_HANDLER(Camel, Cuda, impl, ::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>())

#endif  // JODC_FFI_CUDA_HANDLER_UTIL_CUH_
