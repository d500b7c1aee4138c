// The C API that jodc/ops/_cuda.py calls through ctypes: heap and bucket lifetime, host access to shards and
// accumulators (initialisation, checkpoints, tests), barrier state, and the process-wide tallies. It mirrors the CPU
// extension's functions (ffi/module.cc) one for one.
//
// Convention: functions that can fail return 0 on success and 1 on failure (2: out of memory, which Python raises as
// MemoryError), with a message written into the caller's buffer `err` of `err_capacity` bytes (always
// NUL-terminated, truncated if needed). Nothing throws.
#include <cstring>
#include <string>
#include <vector>

#include "cuda/heap.cuh"

namespace jodc::cuda {
namespace {

int32_t Fail(const std::string& message, char* err, int64_t err_capacity) {
  if (err != nullptr && err_capacity > 0) {
    const size_t n = std::min<size_t>(message.size(), static_cast<size_t>(err_capacity - 1));
    std::memcpy(err, message.data(), n);
    err[n] = '\0';
  }
  return 1;
}

constexpr int32_t kOutOfMemory = 2;  // the return code of a failure that is an allocation the GPU cannot satisfy

// Resolves a bucket (and its heap) for a host-side access to position `device`'s memory.
bool Lookup(int64_t heap_id, int64_t bucket_id, int32_t device, std::shared_ptr<Heap>* heap,
            std::shared_ptr<Bucket>* bucket, std::string* err) {
  *heap = FindHeap(heap_id, err);
  if (!*heap) return false;
  *bucket = FindBucket(*heap, bucket_id, err);
  if (!*bucket) return false;
  if (device < 0 || device >= (*heap)->world) {
    *err = "device " + std::to_string(device) + " outside [0, " + std::to_string((*heap)->world) + ")";
    return false;
  }
  return true;
}

// Synchronous copy between host and one GPU's memory (unified addressing: the runtime infers the direction), on
// jodc's own non-blocking stream of that GPU: the legacy default stream would wait behind unrelated kernels (another
// heap's barrier spinning on the same GPU).
bool CopyOnGpu(int32_t gpu, void* dst, const void* src, int64_t bytes, const char* what, std::string* err) {
  cudaStream_t stream = HostStream(gpu, err);
  if (stream == nullptr) return false;
  ScopedDevice on(gpu);
  cudaError_t e = on.ok() ? cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, stream)
                          : on.status();
  // Wait until the copy has landed, so kernels launched next on XLA's streams see the new data (and host reads are
  // complete).
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *err = CudaMessage(what, e);
    return false;
  }
  return true;
}

}  // namespace
}  // namespace jodc::cuda

using namespace jodc;
using namespace jodc::cuda;

JODC_EXPORT int64_t jodc_cuda_shard_numel(int64_t numel, int32_t world, int32_t master_bytes) {
  return ShardNumel(numel, world, master_bytes);
}

JODC_EXPORT int32_t jodc_cuda_device_count(int32_t* count, char* err, int64_t err_capacity) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Fail(CudaMessage("cudaGetDeviceCount", e), err, err_capacity);
  }
  *count = n;
  return 0;
}

// `gpus[p]` (count == world) is the CUDA device of position p; count == 0: position p on GPU p % visible GPUs.
JODC_EXPORT int32_t jodc_cuda_heap_create(int32_t world, int32_t deterministic, double barrier_timeout_s,
                                          const int32_t* gpus, int32_t count, int64_t* heap_id, char* err,
                                          int64_t err_capacity) {
  if (count < 0 || (count > 0 && gpus == nullptr)) return Fail("placement must list one GPU per device", err,
                                                               err_capacity);
  std::string why;
  const std::vector<int32_t> placement = count > 0 ? std::vector<int32_t>(gpus, gpus + count) : std::vector<int32_t>();
  const int64_t id = CreateHeap(world, deterministic != 0, barrier_timeout_s, placement, &why);
  if (id < 0) return Fail(why, err, err_capacity);
  *heap_id = id;
  return 0;
}

// Copies min(world, capacity) GPU ordinals of the heap's placement into `out` and its world into *world.
JODC_EXPORT int32_t jodc_cuda_heap_placement(int64_t heap_id, int32_t* out, int32_t capacity, int32_t* world,
                                             char* err, int64_t err_capacity) {
  std::string why;
  auto heap = FindHeap(heap_id, &why);
  if (!heap) return Fail(why, err, err_capacity);
  *world = heap->world;
  for (int32_t p = 0; p < heap->world && p < capacity; ++p) out[p] = heap->placement[p];
  return 0;
}

JODC_EXPORT int32_t jodc_cuda_heap_free(int64_t heap_id, char* err, int64_t err_capacity) {
  std::string why;
  if (!FreeHeap(heap_id, &why)) return Fail(why, err, err_capacity);
  return 0;
}

JODC_EXPORT int32_t jodc_cuda_heap_set_barrier_timeout(int64_t heap_id, double timeout_s, char* err,
                                                       int64_t err_capacity) {
  std::string why;
  auto heap = FindHeap(heap_id, &why);
  if (!heap) return Fail(why, err, err_capacity);
  if (!CheckBarrierTimeout(timeout_s, &why)) return Fail(why, err, err_capacity);
  heap->barrier_timeout_s = timeout_s;
  return 0;
}

// Copies min(world, capacity) generations into `out` and the heap's world into *world.
JODC_EXPORT int32_t jodc_cuda_heap_generations(int64_t heap_id, uint64_t* out, int32_t capacity, int32_t* world,
                                               char* err, int64_t err_capacity) {
  std::string why;
  auto heap = FindHeap(heap_id, &why);
  if (!heap) return Fail(why, err, err_capacity);
  *world = heap->world;
  for (int32_t p = 0; p < heap->world && p < capacity; ++p)
    out[p] = __atomic_load_n(&heap->control->arrivals[p], __ATOMIC_ACQUIRE);
  return 0;
}

// Writes the poison message ("" while healthy) into `out`; *length receives its full length.
JODC_EXPORT int32_t jodc_cuda_heap_poisoned(int64_t heap_id, char* out, int64_t out_capacity, int64_t* length,
                                            char* err, int64_t err_capacity) {
  std::string why;
  auto heap = FindHeap(heap_id, &why);
  if (!heap) return Fail(why, err, err_capacity);
  const std::string poisoned = CurrentPoison(*heap);
  *length = static_cast<int64_t>(poisoned.size());
  Fail(poisoned, out, out_capacity);  // same truncating copy
  return 0;
}

// Aborts the heap with `reason` (see AbortHeap) and writes the poison message now recorded into `out`.
JODC_EXPORT int32_t jodc_cuda_heap_abort(int64_t heap_id, const char* reason, char* out, int64_t out_capacity,
                                         char* err, int64_t err_capacity) {
  std::string why;
  if (!FindHeap(heap_id, &why)) return Fail(why, err, err_capacity);
  const std::string poisoned = AbortHeap(heap_id, reason != nullptr ? reason : "");
  Fail(poisoned, out, out_capacity);  // same truncating copy
  return 0;
}

// Whether pushes land in per-source slots (deterministic heap, or no native peer atomics) rather than atomically.
JODC_EXPORT int32_t jodc_cuda_heap_landing_slots(int64_t heap_id, int32_t* landing_slots, char* err,
                                                 int64_t err_capacity) {
  std::string why;
  auto heap = FindHeap(heap_id, &why);
  if (!heap) return Fail(why, err, err_capacity);
  *landing_slots = heap->landing_slots ? 1 : 0;  // immutable after creation
  return 0;
}

JODC_EXPORT int64_t jodc_cuda_live_heaps() { return LiveHeapCount(); }

JODC_EXPORT int64_t jodc_cuda_live_bytes() { return LiveHeapBytes(); }

JODC_EXPORT int32_t jodc_cuda_bucket_register(int64_t heap_id, int64_t numel, const char* dtype, int64_t* bucket_id,
                                              char* err, int64_t err_capacity) {
  Dtype master;
  const std::string name = dtype != nullptr ? dtype : "";
  if (!ParseDtype(name, &master)) return Fail("master dtype must be float32 or bfloat16, got " + name, err,
                                              err_capacity);
  std::string why;
  bool out_of_memory = false;
  const int64_t id = RegisterBucket(heap_id, numel, master, &why, &out_of_memory);
  if (id < 0) {
    Fail(why, err, err_capacity);
    return out_of_memory ? kOutOfMemory : 1;
  }
  *bucket_id = id;
  return 0;
}

JODC_EXPORT int32_t jodc_cuda_bucket_free(int64_t heap_id, int64_t bucket_id, char* err, int64_t err_capacity) {
  std::string why;
  if (!FreeBucket(heap_id, bucket_id, &why)) return Fail(why, err, err_capacity);
  return 0;
}

JODC_EXPORT int32_t jodc_cuda_bucket_info(int64_t heap_id, int64_t bucket_id, int64_t* numel, int64_t* shard_numel,
                                          int32_t* master_bytes, int32_t* world, char* err, int64_t err_capacity) {
  std::shared_ptr<Heap> heap;
  std::shared_ptr<Bucket> bucket;
  std::string why;
  if (!Lookup(heap_id, bucket_id, 0, &heap, &bucket, &why)) return Fail(why, err, err_capacity);
  *numel = bucket->layout().numel;
  *shard_numel = bucket->layout().shard_numel;
  *master_bytes = DtypeBytes(bucket->view.master);
  *world = bucket->layout().world;
  return 0;
}

// Raw bytes of position `device`'s master shard (padded): exactly shard_numel * master bytes.
JODC_EXPORT int32_t jodc_cuda_bucket_get_shard(int64_t heap_id, int64_t bucket_id, int32_t device, void* dst,
                                               int64_t bytes, char* err, int64_t err_capacity) {
  std::shared_ptr<Heap> heap;
  std::shared_ptr<Bucket> b;
  std::string why;
  if (!Lookup(heap_id, bucket_id, device, &heap, &b, &why)) return Fail(why, err, err_capacity);
  const int64_t want = b->layout().shard_numel * DtypeBytes(b->view.master);
  if (bytes != want) return Fail("shard needs " + std::to_string(want) + " bytes, got " + std::to_string(bytes), err,
                                 err_capacity);
  if (!CopyOnGpu(heap->placement[device], dst, b->view.shard[device], want, "reading a shard", &why))
    return Fail(why, err, err_capacity);
  return 0;
}

JODC_EXPORT int32_t jodc_cuda_bucket_set_shard(int64_t heap_id, int64_t bucket_id, int32_t device, const void* src,
                                               int64_t bytes, char* err, int64_t err_capacity) {
  std::shared_ptr<Heap> heap;
  std::shared_ptr<Bucket> b;
  std::string why;
  if (!Lookup(heap_id, bucket_id, device, &heap, &b, &why)) return Fail(why, err, err_capacity);
  const int64_t want = b->layout().shard_numel * DtypeBytes(b->view.master);
  if (bytes != want) return Fail("shard needs " + std::to_string(want) + " bytes, got " + std::to_string(bytes), err,
                                 err_capacity);
  if (!CopyOnGpu(heap->placement[device], b->view.shard[device], src, want, "writing a shard", &why))
    return Fail(why, err, err_capacity);
  return 0;
}

// Position `device`'s accumulated gradient (fp32, shard_numel). With landing slots: accumulator + slot 0 + slot 1 +
// ... summed on the host in the same order (and the same fp32 arithmetic) as the read_accumulator kernel.
JODC_EXPORT int32_t jodc_cuda_bucket_get_accumulator(int64_t heap_id, int64_t bucket_id, int32_t device, float* dst,
                                                     int64_t count, char* err, int64_t err_capacity) {
  std::shared_ptr<Heap> heap;
  std::shared_ptr<Bucket> b;
  std::string why;
  if (!Lookup(heap_id, bucket_id, device, &heap, &b, &why)) return Fail(why, err, err_capacity);
  const int64_t n = b->layout().shard_numel;
  if (count != n) return Fail("accumulator holds " + std::to_string(n) + " elements, got room for " +
                              std::to_string(count), err, err_capacity);
  const int32_t gpu = heap->placement[device];
  if (!CopyOnGpu(gpu, dst, b->view.accumulator[device], n * 4, "reading an accumulator", &why))
    return Fail(why, err, err_capacity);
  if (b->view.landing_slots) {
    std::vector<float> slots(static_cast<size_t>(n) * b->layout().world);
    if (!CopyOnGpu(gpu, slots.data(), b->view.landing[device], n * 4 * b->layout().world, "reading landing slots",
                   &why))
      return Fail(why, err, err_capacity);
    for (int32_t s = 0; s < b->layout().world; ++s) {
      const float* slot = slots.data() + static_cast<int64_t>(s) * n;
      for (int64_t i = 0; i < n; ++i) dst[i] += slot[i];
    }
  }
  return 0;
}

JODC_EXPORT int32_t jodc_cuda_bucket_zero_accumulator(int64_t heap_id, int64_t bucket_id, int32_t device, char* err,
                                                      int64_t err_capacity) {
  std::shared_ptr<Heap> heap;
  std::shared_ptr<Bucket> b;
  std::string why;
  if (!Lookup(heap_id, bucket_id, device, &heap, &b, &why)) return Fail(why, err, err_capacity);
  const int64_t n = b->layout().shard_numel;
  const int32_t gpu = heap->placement[device];
  cudaStream_t stream = HostStream(gpu, &why);
  if (stream == nullptr) return Fail(why, err, err_capacity);
  ScopedDevice on(gpu);
  cudaError_t e = on.ok() ? cudaMemsetAsync(b->view.accumulator[device], 0, n * 4, stream) : on.status();
  if (e == cudaSuccess && b->view.landing_slots)
    e = cudaMemsetAsync(b->view.landing[device], 0, n * 4 * b->layout().world, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Fail(CudaMessage("zeroing an accumulator", e), err, err_capacity);
  }
  return 0;
}
