// The NVSHMEM backend's registry and C API (called by jodc/ops/transports/nvshmem_library.py through ctypes): initialisation from a
// unique id exchanged by the processes, heaps and buckets in the symmetric heap (collective: every PE makes the same
// calls in the same order), host access to this PE's own memory, poisoning, and the handler table. Conventions as
// ffi/cuda/management.cu (common/c_api.h): 0 on success, 1 with a message in `err` (2: out of memory).
#include <cstring>
#include <unordered_map>
#include <vector>

#include "common/c_api.h"
#include "common/bucket_plan.h"
#include "common/registry.h"
#include "nvshmem/handlers.cuh"
#include "nvshmem/heap.cuh"

namespace jodc::nvshmem_backend {
namespace {

std::mutex g_mu;  // guards g_initialized
bool g_initialized = false;

}  // namespace

HeapRegistry<NvHeap>& Heaps() { return RegistryOf<NvHeap>("NVSHMEM heap"); }

namespace {

// nvshmem_malloc + zero fill (collective). An allocation the symmetric heap cannot hold is kResourceExhausted.
ErrorOr<void*> SymmetricZeros(size_t bytes) {
  void* p = nvshmem_malloc(bytes);
  if (p == nullptr) {
    return Fail(OutOfMemory("nvshmem_malloc of " + std::to_string(bytes) +
                            " bytes failed (symmetric heap too small? raise NVSHMEM_SYMMETRIC_SIZE)"));
  }
  if (cudaError_t e = cudaMemset(p, 0, bytes); e != cudaSuccess) {
    cudaGetLastError();
    nvshmem_free(p);
    return Fail(Error::Internal(cuda::CudaMessage("zeroing symmetric memory", e)));
  }
  return p;
}

}  // namespace

SymBucket::~SymBucket() {
  // Collective like the allocation: every PE frees its buckets in the same order (jodc/ops/transports/nvshmem_library.py).
  if (view.shard != nullptr) nvshmem_free(view.shard);
  if (view.accumulator != nullptr) nvshmem_free(view.accumulator);
  if (view.landing != nullptr) nvshmem_free(view.landing);
}

NvHeap::~NvHeap() {
  if (arrivals != nullptr) nvshmem_free(arrivals);
  if (abort != nullptr) nvshmem_free(abort);
  if (control != nullptr) cudaFreeHost(control);
  cudaGetLastError();
}

ErrorOr<std::shared_ptr<NvHeap>> FindHeap(int64_t heap_id) { return Heaps().Find(heap_id, "(freed?)"); }

ErrorOr<std::shared_ptr<SymBucket>> FindBucket(const std::shared_ptr<NvHeap>& heap, int64_t bucket_id) {
  return Heaps().FindBucket(*heap, bucket_id);
}

std::string CurrentPoison(NvHeap& heap) {
  const uint64_t fault = __atomic_load_n(&heap.control->fault, __ATOMIC_ACQUIRE);
  int32_t aborted = 0;
  cudaMemcpy(&aborted, heap.abort, sizeof(aborted), cudaMemcpyDeviceToHost);  // management paths only
  cudaGetLastError();
  std::lock_guard<std::mutex> lock(heap.mu);
  if (heap.poisoned.empty() && fault != 0) {
    heap.poisoned = std::string("a ") + cuda::OpName(cuda::FaultOp(fault)) + " kernel received device index " +
                    std::to_string(cuda::FaultDevice(fault)) + " outside [0, " + std::to_string(heap.world) +
                    "); the heap is now unusable: free and re-create it";
  }
  if (heap.poisoned.empty() && aborted != 0) {
    heap.poisoned = "NVSHMEM heap " + std::to_string(heap.id) + " was aborted by another PE (its error is in that "
                    "process's output); the heap is now unusable: free and re-create it";
  }
  return heap.poisoned;
}

void Poison(NvHeap& heap, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(heap.mu);
    if (heap.poisoned.empty()) heap.poisoned = message;
  }
  for (int32_t pe = 0; pe < heap.world; ++pe) nvshmem_int_p(heap.abort, 1, pe);  // host-initiated puts
  nvshmem_quiet();
}

}  // namespace jodc::nvshmem_backend

// No `using namespace jodc`: it would make jodc::cuda visible next to libcu++'s ::cuda, which NVSHMEM's device
// headers name unqualified (`cuda::std::...`), and their templates instantiated here would become ambiguous.
using namespace jodc::nvshmem_backend;
using jodc::Dtype;
using jodc::DtypeBytes;
using jodc::CopyText;
using jodc::Error;
using jodc::InvalidArgument;
using jodc::Report;
using jodc::ParseDtype;
namespace jcuda = jodc::cuda;

#define JODC_NVSHMEM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// A refused call: `message` (kInvalidArgument) into (err, err_capacity), the C API's failure code.
int32_t Fail(const std::string& message, char* err, int64_t err_capacity) {
  return Report(InvalidArgument(message), err, err_capacity);
}

}  // namespace

// The handler of every heap op (ffi/common/ops.h): names[i] / handlers[i] for i < capacity; returns how many there
// are. The handler symbols themselves stay hidden.
JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_handlers(const char** names, void** handlers, int32_t capacity) {
#define JODC_NVSHMEM_HANDLER_ENTRY(op, Camel) {#op, reinterpret_cast<void*>(&Jodc##Camel##Nvshmem)},
  static const jodc::OpHandler kTable[] = {JODC_HEAP_OPS(JODC_NVSHMEM_HANDLER_ENTRY)};
#undef JODC_NVSHMEM_HANDLER_ENTRY
  return jodc::CopyOpHandlers(kTable, names, handlers, capacity);
}

// Writes a fresh unique id (PE 0 calls this; the bytes go to every process through jodc/ops/transports/nvshmem_library.py).
JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_unique_id(char* out, int64_t capacity, int64_t* length, char* err,
                                                   int64_t err_capacity) {
  nvshmemx_uniqueid_t id;
  if (nvshmemx_get_uniqueid(&id) != 0) return Fail("nvshmemx_get_uniqueid failed", err, err_capacity);
  if (capacity < static_cast<int64_t>(sizeof(id)))
    return Fail("unique id needs " + std::to_string(sizeof(id)) + " bytes", err, err_capacity);
  std::memcpy(out, &id, sizeof(id));
  *length = sizeof(id);
  return 0;
}

// Initialises NVSHMEM as PE `rank` of `nranks` on CUDA device `gpu` (collective; once per process).
JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_init(int32_t rank, int32_t nranks, const char* unique_id, int64_t length,
                                              int32_t gpu, char* err, int64_t err_capacity) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_initialized) return Fail("NVSHMEM is already initialised in this process", err, err_capacity);
  nvshmemx_uniqueid_t id;
  if (unique_id == nullptr || length != static_cast<int64_t>(sizeof(id)))
    return Fail("the unique id must be " + std::to_string(sizeof(id)) + " bytes, got " + std::to_string(length), err,
                err_capacity);
  std::memcpy(&id, unique_id, sizeof(id));
  if (cudaError_t e = cudaSetDevice(gpu); e != cudaSuccess) {
    cudaGetLastError();
    return Fail(jcuda::CudaMessage(("selecting GPU " + std::to_string(gpu)).c_str(), e), err, err_capacity);
  }
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr) != 0 ||
      nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0)
    return Fail("nvshmemx_init_attr failed for PE " + std::to_string(rank) + " of " + std::to_string(nranks), err,
                err_capacity);
  if (nvshmem_my_pe() != rank || nvshmem_n_pes() != nranks)
    return Fail("NVSHMEM made this process PE " + std::to_string(nvshmem_my_pe()) + " of " +
                std::to_string(nvshmem_n_pes()) + ", expected " + std::to_string(rank) + " of " +
                std::to_string(nranks), err, err_capacity);
  g_initialized = true;
  return 0;
}

// A heap over every PE (collective). World = number of PEs; this PE = its mesh position.
JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_heap_create(int32_t deterministic, double barrier_timeout_s,
                                                     int64_t* heap_id, char* err, int64_t err_capacity) {
  if (Error e = jcuda::CheckBarrierTimeout(barrier_timeout_s); e.failure()) return Report(e, err, err_capacity);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_initialized) return Fail("NVSHMEM is not initialised (jodc_nvshmem_init first)", err, err_capacity);
  }
  auto heap = std::make_shared<NvHeap>();
  heap->world = nvshmem_n_pes();
  heap->me = nvshmem_my_pe();
  if (heap->world > kMaxWorld) return Fail("at most " + std::to_string(kMaxWorld) + " PEs", err, err_capacity);
  heap->deterministic = deterministic != 0;
  // NVSHMEM float atomics are correct on every transport (proxy atomics where the link has none): landing slots
  // only for determinism.
  heap->landing_slots = heap->deterministic;
  heap->barrier_timeout_s = barrier_timeout_s;
  auto arrivals = SymmetricZeros(sizeof(uint64_t) * kMaxWorld);
  if (!arrivals.has_value()) return Report(arrivals.error(), err, err_capacity);
  heap->arrivals = static_cast<uint64_t*>(*arrivals);
  auto abort = SymmetricZeros(sizeof(int32_t));
  if (!abort.has_value()) return Report(abort.error(), err, err_capacity);
  heap->abort = static_cast<int32_t*>(*abort);
  void* control = nullptr;
  cudaError_t e = jcuda::AllocateMappedZeros(sizeof(HeapControl), &control);
  heap->control = static_cast<HeapControl*>(control);  // freed by ~NvHeap, also when the reports fail below
  if (e == cudaSuccess) e = heap->reports.Allocate(heap->world);
  if (e != cudaSuccess)
    return Report(Error::Internal(jcuda::CudaMessage("allocating pinned control memory", e)), err, err_capacity);
  nvshmem_barrier_all();  // every PE's arrivals and abort are zero before anyone's first barrier
  *heap_id = Heaps().Add(std::move(heap));
  return 0;
}

// Collective: every PE frees the heap (after its last op; jodc/ops/transports/nvshmem_library.py synchronises first).
JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_heap_free(int64_t heap_id, char* err, int64_t err_capacity) {
  auto removed = Heaps().Remove(heap_id, "(already freed?)");
  if (!removed.has_value()) return Report(removed.error(), err, err_capacity);
  std::shared_ptr<NvHeap> heap = *removed;
  cudaDeviceSynchronize();  // this PE's queued kernels may still use symmetric memory
  cudaGetLastError();
  nvshmem_barrier_all();  // no PE still reads or writes this heap's memory on another
  std::map<int64_t, std::shared_ptr<SymBucket>> buckets;
  {
    std::lock_guard<std::mutex> lock(heap->mu);
    buckets.swap(heap->buckets);
  }
  buckets.clear();  // frees in id order: the same order on every PE
  heap.reset();
  return 0;
}

// Collective: a bucket of `numel` elements of `dtype` over every PE.
JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_bucket_register(int64_t heap_id, int64_t numel, const char* dtype,
                                                         int64_t* bucket_id, char* err, int64_t err_capacity) {
  auto found = FindHeap(heap_id);
  if (!found.has_value()) return Report(found.error(), err, err_capacity);
  const std::shared_ptr<NvHeap>& heap = *found;
  Dtype master;
  if (!ParseDtype(dtype != nullptr ? dtype : "", &master))
    return Fail(std::string("master dtype must be float32 or bfloat16, got ") + (dtype ? dtype : ""), err,
                err_capacity);
  auto plan = jodc::PlanBucket(numel, master, heap->world, heap->landing_slots, heap_id);
  if (!plan.has_value()) return Report(plan.error(), err, err_capacity);
  auto b = std::make_shared<SymBucket>();
  b->view.layout = plan->layout;
  b->view.master = master;
  b->view.landing_slots = heap->landing_slots;
  b->bytes = plan->bytes;
  // Shard, accumulator, landing slots; after a failure nothing more is allocated (`b` frees what was).
  Error failed = Error::Success();
  auto allocate = [&](size_t bytes) -> void* {
    if (failed.failure()) return nullptr;
    auto p = SymmetricZeros(bytes);
    if (!p.has_value()) {
      failed = p.error();
      return nullptr;
    }
    return *p;
  };
  b->view.shard = allocate(b->bytes.shard);
  b->view.accumulator = static_cast<float*>(allocate(b->bytes.accumulator));
  if (b->view.landing_slots) b->view.landing = static_cast<float*>(allocate(b->bytes.landing));
  if (failed.failure()) {
    return Report(Error(jodc::CodeOf(failed), "registering " + plan->what + ": " + failed.message()), err,
                  err_capacity);
  }
  b->id = Heaps().NewBucketId();
  std::lock_guard<std::mutex> lock(heap->mu);
  heap->buckets[b->id] = b;
  *bucket_id = b->id;
  return 0;
}

JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_bucket_free(int64_t heap_id, int64_t bucket_id, char* err,
                                                     int64_t err_capacity) {
  auto found = FindHeap(heap_id);
  if (!found.has_value()) return Report(found.error(), err, err_capacity);
  const std::shared_ptr<NvHeap>& heap = *found;
  std::shared_ptr<SymBucket> b;
  {
    std::lock_guard<std::mutex> lock(heap->mu);
    auto it = heap->buckets.find(bucket_id);
    if (it == heap->buckets.end()) return Fail("bucket " + std::to_string(bucket_id) + " is not registered", err,
                                               err_capacity);
    b = it->second;
    heap->buckets.erase(it);
  }
  cudaDeviceSynchronize();
  cudaGetLastError();
  nvshmem_barrier_all();
  b.reset();
  return 0;
}

JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_bucket_info(int64_t heap_id, int64_t bucket_id, int64_t* numel,
                                                     int64_t* shard_numel, int32_t* master_bytes, int32_t* world,
                                                     char* err, int64_t err_capacity) {
  auto found = jodc::LocateForHost(FindHeap(heap_id), FindBucket, bucket_id, /*device=*/0);
  if (!found.has_value()) return Report(found.error(), err, err_capacity);
  const std::shared_ptr<SymBucket>& b = found->bucket;
  *numel = b->view.layout.numel;
  *shard_numel = b->view.layout.shard_numel;
  *master_bytes = DtypeBytes(b->view.master);
  *world = b->view.layout.world;
  return 0;
}

// Host access to this PE's own memory: kind 0 = shard (raw master bytes), 1 = accumulator (fp32, landing slots
// reduced in source order). `write` copies from `data` (shard only), else into it.
JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_bucket_access(int64_t heap_id, int64_t bucket_id, int32_t device,
                                                       int32_t kind, int32_t write, void* data, int64_t bytes,
                                                       char* err, int64_t err_capacity) {
  auto found = jodc::LocateForHost(FindHeap(heap_id), FindBucket, bucket_id, /*device=*/0);
  if (!found.has_value()) return Report(found.error(), err, err_capacity);
  const std::shared_ptr<NvHeap>& heap = found->heap;
  const std::shared_ptr<SymBucket>& b = found->bucket;
  if (device != heap->me)
    return Fail("position " + std::to_string(device) + "'s memory lives in another process (PE " +
                std::to_string(device) + "); this process holds position " + std::to_string(heap->me), err,
                err_capacity);
  const int64_t n = b->view.layout.shard_numel;
  const int64_t want = kind == 0 ? n * DtypeBytes(b->view.master) : n * 4;
  if (bytes != want) return Fail("expected " + std::to_string(want) + " bytes, got " + std::to_string(bytes), err,
                                 err_capacity);
  cudaError_t e = cudaSuccess;
  if (kind == 0) {
    e = write ? cudaMemcpy(b->view.shard, data, bytes, cudaMemcpyHostToDevice)
              : cudaMemcpy(data, b->view.shard, bytes, cudaMemcpyDeviceToHost);
  } else if (kind == 1 && write) {
    e = cudaMemset(b->view.accumulator, 0, n * 4);
    if (e == cudaSuccess && b->view.landing) e = cudaMemset(b->view.landing, 0, n * 4 * heap->world);
  } else {
    e = cudaMemcpy(data, b->view.accumulator, bytes, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess && b->view.landing) {
      std::vector<float> slots(static_cast<size_t>(n) * heap->world);
      e = cudaMemcpy(slots.data(), b->view.landing, slots.size() * 4, cudaMemcpyDeviceToHost);
      float* out = static_cast<float*>(data);
      for (int32_t s = 0; s < heap->world && e == cudaSuccess; ++s)
        for (int64_t i = 0; i < n; ++i) out[i] += slots[static_cast<size_t>(s) * n + i];
    }
  }
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Report(Error::Internal(jcuda::CudaMessage("host access to symmetric memory", e)), err, err_capacity);
  }
  return 0;
}

JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_heap_state(int64_t heap_id, int32_t* world, int32_t* me,
                                                    int32_t* landing_slots, uint64_t* generations, char* poisoned,
                                                    int64_t poisoned_capacity, char* err, int64_t err_capacity) {
  return jodc::WithHeap(FindHeap(heap_id), err, err_capacity, [&](NvHeap& heap) {
    *world = heap.world;
    *me = heap.me;
    *landing_slots = heap.landing_slots ? 1 : 0;
    cudaMemcpy(generations, heap.arrivals, sizeof(uint64_t) * heap.world, cudaMemcpyDeviceToHost);
    cudaGetLastError();
    CopyText(CurrentPoison(heap), poisoned, poisoned_capacity);
    return Error::Success();
  });
}

JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_heap_set_barrier_timeout(int64_t heap_id, double timeout_s, char* err,
                                                                  int64_t err_capacity) {
  return jodc::WithHeap(FindHeap(heap_id), err, err_capacity, [&](NvHeap& heap) {
    if (Error e = jcuda::CheckBarrierTimeout(timeout_s); e.failure()) return e;
    heap.barrier_timeout_s = timeout_s;
    return Error::Success();
  });
}

// Poisons the heap on every PE (the abort flag is set remotely), releasing their waiting barriers.
JODC_NVSHMEM_EXPORT int32_t jodc_nvshmem_heap_abort(int64_t heap_id, const char* reason, char* err,
                                                    int64_t err_capacity) {
  return jodc::WithHeap(FindHeap(heap_id), err, err_capacity, [&](NvHeap& heap) {
    Poison(heap, std::string("aborted: ") + (reason ? reason : "") + "; the heap is now unusable: free and re-create it");
    return Error::Success();
  });
}

JODC_NVSHMEM_EXPORT int64_t jodc_nvshmem_live_heaps() { return Heaps().Count(); }
