// The C API that jodc/ops/transports/cuda_library.py calls through ctypes: heap and bucket lifetime, host access to shards and
// accumulators (initialisation, checkpoints, tests), barrier state, and the process-wide tallies. It mirrors the CPU
// extension's functions (ffi/module.cc) one for one.
//
// Convention (common/c_api.h): functions that can fail return 0 on success and 1 on failure (2: out of memory, which
// Python raises as MemoryError), with a message written into the caller's buffer `err` of `err_capacity` bytes
// (always NUL-terminated, truncated if needed). Nothing throws.
#include <cstring>
#include <string>
#include <vector>

#include "common/c_api.h"
#include "cuda/handlers.cuh"
#include "cuda/heap.cuh"

namespace jodc::cuda {
namespace {

// Resolves a bucket (and its heap) for a host-side access to position `device`'s memory.
auto Lookup(int64_t heap_id, int64_t bucket_id, int32_t device) {
  return LocateForHost(FindHeap(heap_id), FindBucket, bucket_id, device);
}

// Synchronous copy between host and one GPU's memory (unified addressing: the runtime infers the direction), on
// jodc's own non-blocking stream of that GPU: the legacy default stream would wait behind unrelated kernels (another
// heap's barrier spinning on the same GPU).
Error CopyOnGpu(int32_t gpu, void* dst, const void* src, int64_t bytes, const char* what) {
  auto stream_or = HostStream(gpu);
  if (!stream_or.has_value()) return stream_or.error();
  cudaStream_t stream = *stream_or;
  ScopedDevice on(gpu);
  cudaError_t e = on.ok() ? cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, stream)
                          : on.status();
  // Wait until the copy has landed, so kernels launched next on XLA's streams see the new data (and host reads are
  // complete).
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Error::Internal(CudaMessage(what, e));
  }
  return Error::Success();
}

}  // namespace
}  // namespace jodc::cuda

using namespace jodc;
using namespace jodc::cuda;

// The handler of every op (ffi/common/ops.h): names[i] / handlers[i] for i < capacity; returns how many there are.
JODC_EXPORT int32_t jodc_cuda_handlers(const char** names, void** handlers, int32_t capacity) {
#define JODC_CUDA_HANDLER_ENTRY(op, Camel) {#op, reinterpret_cast<void*>(&Jodc##Camel##Cuda)},
  static const OpHandler kTable[] = {JODC_ALL_OPS(JODC_CUDA_HANDLER_ENTRY)};
#undef JODC_CUDA_HANDLER_ENTRY
  return CopyOpHandlers(kTable, names, handlers, capacity);
}

JODC_EXPORT int64_t jodc_cuda_shard_numel(int64_t numel, int32_t world, int32_t master_bytes) {
  return ShardNumel(numel, world, master_bytes);
}

JODC_EXPORT int32_t jodc_cuda_device_count(int32_t* count, char* err, int64_t err_capacity) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Report(InvalidArgument(CudaMessage("cudaGetDeviceCount", e)), err, err_capacity);
  }
  *count = n;
  return 0;
}

// `gpus[p]` (count == world) is the CUDA device of position p; count == 0: position p on GPU p % visible GPUs.
JODC_EXPORT int32_t jodc_cuda_heap_create(int32_t world, int32_t deterministic, double barrier_timeout_s,
                                          const int32_t* gpus, int32_t count, int64_t* heap_id, char* err,
                                          int64_t err_capacity) {
  if (count < 0 || (count > 0 && gpus == nullptr))
    return Report(InvalidArgument("placement must list one GPU per device"), err, err_capacity);
  const std::vector<int32_t> placement = count > 0 ? std::vector<int32_t>(gpus, gpus + count) : std::vector<int32_t>();
  auto id = CreateHeap(world, deterministic != 0, barrier_timeout_s, placement);
  if (!id.has_value()) return Report(id.error(), err, err_capacity);
  *heap_id = *id;
  return 0;
}

// Copies min(world, capacity) GPU ordinals of the heap's placement into `out` and its world into *world.
JODC_EXPORT int32_t jodc_cuda_heap_placement(int64_t heap_id, int32_t* out, int32_t capacity, int32_t* world,
                                             char* err, int64_t err_capacity) {
  return WithHeap(FindHeap(heap_id), err, err_capacity, [&](const Heap& heap) {
    *world = heap.world;
    for (int32_t p = 0; p < heap.world && p < capacity; ++p) out[p] = heap.placement[p];
    return Error::Success();
  });
}

JODC_EXPORT int32_t jodc_cuda_heap_free(int64_t heap_id, char* err, int64_t err_capacity) {
  return Report(FreeHeap(heap_id), err, err_capacity);
}

JODC_EXPORT int32_t jodc_cuda_heap_set_barrier_timeout(int64_t heap_id, double timeout_s, char* err,
                                                       int64_t err_capacity) {
  return WithHeap(FindHeap(heap_id), err, err_capacity, [&](Heap& heap) {
    if (Error e = CheckBarrierTimeout(timeout_s); e.failure()) return e;
    heap.barrier_timeout_s = timeout_s;
    return Error::Success();
  });
}

// Copies min(world, capacity) generations into `out` and the heap's world into *world.
JODC_EXPORT int32_t jodc_cuda_heap_generations(int64_t heap_id, uint64_t* out, int32_t capacity, int32_t* world,
                                               char* err, int64_t err_capacity) {
  return WithHeap(FindHeap(heap_id), err, err_capacity, [&](const Heap& heap) {
    *world = heap.world;
    for (int32_t p = 0; p < heap.world && p < capacity; ++p)
      out[p] = __atomic_load_n(&heap.control->arrivals[p], __ATOMIC_ACQUIRE);
    return Error::Success();
  });
}

// Writes the poison message ("" while healthy) into `out`; *length receives its full length.
JODC_EXPORT int32_t jodc_cuda_heap_poisoned(int64_t heap_id, char* out, int64_t out_capacity, int64_t* length,
                                            char* err, int64_t err_capacity) {
  return WithHeap(FindHeap(heap_id), err, err_capacity, [&](Heap& heap) {
    const std::string poisoned = CurrentPoison(heap);
    *length = static_cast<int64_t>(poisoned.size());
    CopyText(poisoned, out, out_capacity);
    return Error::Success();
  });
}

// Aborts the heap with `reason` (see AbortHeap) and writes the poison message now recorded into `out`.
JODC_EXPORT int32_t jodc_cuda_heap_abort(int64_t heap_id, const char* reason, char* out, int64_t out_capacity,
                                         char* err, int64_t err_capacity) {
  if (auto heap = FindHeap(heap_id); !heap.has_value()) return Report(heap.error(), err, err_capacity);
  CopyText(AbortHeap(heap_id, reason != nullptr ? reason : ""), out, out_capacity);
  return 0;
}

// Whether pushes land in per-source slots (deterministic heap, or no native peer atomics) rather than atomically.
JODC_EXPORT int32_t jodc_cuda_heap_landing_slots(int64_t heap_id, int32_t* landing_slots, char* err,
                                                 int64_t err_capacity) {
  return WithHeap(FindHeap(heap_id), err, err_capacity, [&](const Heap& heap) {
    *landing_slots = heap.landing_slots ? 1 : 0;  // immutable after creation
    return Error::Success();
  });
}

JODC_EXPORT int64_t jodc_cuda_live_heaps() { return LiveHeapCount(); }

JODC_EXPORT int64_t jodc_cuda_live_bytes() { return LiveHeapBytes(); }

JODC_EXPORT int32_t jodc_cuda_bucket_register(int64_t heap_id, int64_t numel, const char* dtype, int64_t* bucket_id,
                                              char* err, int64_t err_capacity) {
  Dtype master;
  const std::string name = dtype != nullptr ? dtype : "";
  if (!ParseDtype(name, &master))
    return Report(InvalidArgument("master dtype must be float32 or bfloat16, got " + name), err, err_capacity);
  auto id = RegisterBucket(heap_id, numel, master);
  if (!id.has_value()) return Report(id.error(), err, err_capacity);  // 2 for out of memory
  *bucket_id = *id;
  return 0;
}

JODC_EXPORT int32_t jodc_cuda_bucket_free(int64_t heap_id, int64_t bucket_id, char* err, int64_t err_capacity) {
  return Report(FreeBucket(heap_id, bucket_id), err, err_capacity);
}

JODC_EXPORT int32_t jodc_cuda_bucket_info(int64_t heap_id, int64_t bucket_id, int64_t* numel, int64_t* shard_numel,
                                          int32_t* master_bytes, int32_t* world, char* err, int64_t err_capacity) {
  auto found = Lookup(heap_id, bucket_id, 0);
  if (!found.has_value()) return Report(found.error(), err, err_capacity);
  const Bucket& bucket = *found->bucket;
  *numel = bucket.layout().numel;
  *shard_numel = bucket.layout().shard_numel;
  *master_bytes = DtypeBytes(bucket.view.master);
  *world = bucket.layout().world;
  return 0;
}

// Copies position `device`'s master shard (padded: exactly shard_numel * master bytes) from (to_host) or to the host.
static int32_t CopyShard(int64_t heap_id, int64_t bucket_id, int32_t device, void* host, int64_t bytes, bool to_host,
                  char* err, int64_t err_capacity) {
  auto found = Lookup(heap_id, bucket_id, device);
  if (!found.has_value()) return Report(found.error(), err, err_capacity);
  const Bucket& b = *found->bucket;
  const int64_t want = b.layout().shard_numel * DtypeBytes(b.view.master);
  if (bytes != want) {
    return Report(InvalidArgument("shard needs " + std::to_string(want) + " bytes, got " + std::to_string(bytes)),
                  err, err_capacity);
  }
  void* shard = b.view.shard[device];
  const int32_t gpu = found->heap->placement[device];
  return Report(to_host ? CopyOnGpu(gpu, host, shard, want, "reading a shard")
                        : CopyOnGpu(gpu, shard, host, want, "writing a shard"),
                err, err_capacity);
}

JODC_EXPORT int32_t jodc_cuda_bucket_get_shard(int64_t heap_id, int64_t bucket_id, int32_t device, void* dst,
                                               int64_t bytes, char* err, int64_t err_capacity) {
  return CopyShard(heap_id, bucket_id, device, dst, bytes, /*to_host=*/true, err, err_capacity);
}

JODC_EXPORT int32_t jodc_cuda_bucket_set_shard(int64_t heap_id, int64_t bucket_id, int32_t device, const void* src,
                                               int64_t bytes, char* err, int64_t err_capacity) {
  return CopyShard(heap_id, bucket_id, device, const_cast<void*>(src), bytes, /*to_host=*/false, err, err_capacity);
}

// Position `device`'s accumulated gradient (fp32, shard_numel). With landing slots: accumulator + slot 0 + slot 1 +
// ... summed on the host in the same order (and the same fp32 arithmetic) as the read_accumulator kernel.
JODC_EXPORT int32_t jodc_cuda_bucket_get_accumulator(int64_t heap_id, int64_t bucket_id, int32_t device, float* dst,
                                                     int64_t count, char* err, int64_t err_capacity) {
  auto found = Lookup(heap_id, bucket_id, device);
  if (!found.has_value()) return Report(found.error(), err, err_capacity);
  const Bucket& b = *found->bucket;
  const int64_t n = b.layout().shard_numel;
  if (count != n) {
    return Report(InvalidArgument("accumulator holds " + std::to_string(n) + " elements, got room for " +
                                  std::to_string(count)),
                  err, err_capacity);
  }
  const int32_t gpu = found->heap->placement[device];
  if (Error e = CopyOnGpu(gpu, dst, b.view.accumulator[device], n * 4, "reading an accumulator"); e.failure())
    return Report(e, err, err_capacity);
  if (b.view.landing_slots) {
    std::vector<float> slots(static_cast<size_t>(n) * b.layout().world);
    Error e = CopyOnGpu(gpu, slots.data(), b.view.landing[device], n * 4 * b.layout().world, "reading landing slots");
    if (e.failure()) return Report(e, err, err_capacity);
    for (int32_t s = 0; s < b.layout().world; ++s) {
      const float* slot = slots.data() + static_cast<int64_t>(s) * n;
      for (int64_t i = 0; i < n; ++i) dst[i] += slot[i];
    }
  }
  return 0;
}

JODC_EXPORT int32_t jodc_cuda_bucket_zero_accumulator(int64_t heap_id, int64_t bucket_id, int32_t device, char* err,
                                                      int64_t err_capacity) {
  auto found = Lookup(heap_id, bucket_id, device);
  if (!found.has_value()) return Report(found.error(), err, err_capacity);
  const Bucket& b = *found->bucket;
  const int64_t n = b.layout().shard_numel;
  const int32_t gpu = found->heap->placement[device];
  auto stream_or = HostStream(gpu);
  if (!stream_or.has_value()) return Report(stream_or.error(), err, err_capacity);
  cudaStream_t stream = *stream_or;
  ScopedDevice on(gpu);
  cudaError_t e = on.ok() ? cudaMemsetAsync(b.view.accumulator[device], 0, n * 4, stream) : on.status();
  if (e == cudaSuccess && b.view.landing_slots)
    e = cudaMemsetAsync(b.view.landing[device], 0, n * 4 * b.layout().world, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Report(Error::Internal(CudaMessage("zeroing an accumulator", e)), err, err_capacity);
  }
  return 0;
}
