// The CUDA heap registry: creating heaps (placement, peer access, pinned control block), registering and freeing
// buckets (per-GPU allocations), and poisoning. Host code only; the kernels live in one file per op.
#include "cuda/heap.cuh"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "common/registry.h"

namespace jodc::cuda {
namespace {

std::atomic<int64_t> g_live_bytes{0};
std::atomic<int64_t> g_next_bucket_id{1};

HeapRegistry<Heap>& Heaps() {
  static auto* heaps = new HeapRegistry<Heap>("heap");  // never destroyed: handlers may run during exit
  return *heaps;
}

// Enables peer access in both directions between every pair of distinct GPUs in `gpus`. Sets *native_atomics to
// whether every pair also supports native atomics over its link (NVLink: yes; PCIe: usually not).
Error EnablePeerAccess(const std::vector<int32_t>& gpus, bool* native_atomics) {
  std::vector<int32_t> distinct(gpus);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  *native_atomics = true;
  for (int32_t a : distinct) {
    ScopedDevice on_a(a);
    if (!on_a.ok()) return Error::Internal(CudaMessage(("selecting GPU " + std::to_string(a)).c_str(), on_a.status()));
    for (int32_t b : distinct) {
      if (a == b) continue;
      int can_access = 0;
      cudaError_t e = cudaDeviceCanAccessPeer(&can_access, a, b);
      if (e != cudaSuccess) {
        return Error::Internal(CudaMessage(
            ("querying peer access from GPU " + std::to_string(a) + " to GPU " + std::to_string(b)).c_str(), e));
      }
      if (!can_access) {
        return InvalidArgument("GPU " + std::to_string(a) + " cannot access GPU " + std::to_string(b) +
                               "'s memory directly (no peer-to-peer path between them); jodc's CUDA ops need peer "
                               "access between all GPUs of a heap (NVLink, or PCIe with P2P enabled under one root "
                               "complex)");
      }
      e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // not an error for us (XLA or an earlier heap enabled it); clear the sticky record
      } else if (e != cudaSuccess) {
        return Error::Internal(CudaMessage(
            ("enabling peer access from GPU " + std::to_string(a) + " to GPU " + std::to_string(b)).c_str(), e));
      }
      int atomics = 0;
      if (cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, a, b) != cudaSuccess) {
        cudaGetLastError();
        atomics = 0;
      }
      if (!atomics) *native_atomics = false;
    }
  }
  return Error::Success();
}

// Waits for all work queued on the heap's GPUs (XLA's streams included), so memory can be released safely even if a
// kernel on one GPU still reads another GPU's shard. Errors are ignored: this runs on teardown paths.
void SynchronizeGpus(const std::vector<int32_t>& placement) {
  std::vector<int32_t> gpus(placement);
  std::sort(gpus.begin(), gpus.end());
  gpus.erase(std::unique(gpus.begin(), gpus.end()), gpus.end());
  for (int32_t g : gpus) {
    ScopedDevice on(g);
    if (on.ok()) cudaDeviceSynchronize();
    cudaGetLastError();
  }
}

ErrorOr<int> VisibleDeviceCount() {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Fail(InvalidArgument("no usable CUDA device: " + CudaMessage("cudaGetDeviceCount", e)));
  }
  if (count < 1) return Fail(InvalidArgument("no CUDA device is visible to this process"));
  return count;
}

}  // namespace

const char* OpName(int32_t op) {
  switch (static_cast<OpCode>(op)) {
#define JODC_OP_NAME(name, Camel) \
  case OpCode::k##Camel:          \
    return #name;
    JODC_HEAP_OPS(JODC_OP_NAME)
#undef JODC_OP_NAME
    case OpCode::kNone:
      break;
  }
  return "unknown op";
}

std::string CudaMessage(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

ScopedDevice::ScopedDevice(int32_t gpu) {
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    cudaGetLastError();
    previous_ = -1;
  }
  status_ = cudaSetDevice(gpu);
  if (status_ != cudaSuccess) cudaGetLastError();
}

ScopedDevice::~ScopedDevice() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ == nullptr) return;
  ScopedDevice on(gpu_);
  cudaFree(data_);  // synchronises the device: kernels still using the block finish first
  cudaGetLastError();  // at interpreter exit the runtime may already be unloading; nothing to report then
  g_live_bytes -= bytes_;
}

Error DeviceBuffer::Allocate(int32_t gpu, int64_t bytes) {
  if (bytes < 0) return InvalidArgument("cannot allocate a negative size (" + std::to_string(bytes) + " bytes)");
  ScopedDevice on(gpu);
  if (!on.ok()) return Error::Internal(CudaMessage(("selecting GPU " + std::to_string(gpu)).c_str(), on.status()));
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, static_cast<size_t>(bytes));
  if (e == cudaSuccess) e = cudaMemset(p, 0, static_cast<size_t>(bytes));
  if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamLegacy);  // zeros land before any XLA stream reads
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (p != nullptr) cudaFree(p);
    std::string msg = CudaMessage(("allocating " + std::to_string(bytes) + " bytes on GPU " + std::to_string(gpu)).c_str(), e);
    return e == cudaErrorMemoryAllocation ? OutOfMemory(std::move(msg)) : Error::Internal(std::move(msg));
  }
  gpu_ = gpu;
  data_ = p;
  bytes_ = bytes;
  g_live_bytes += bytes;
  return Error::Success();
}

int64_t LiveHeapBytes() { return g_live_bytes.load(); }

Heap::~Heap() {
  if (control != nullptr) {
    cudaFreeHost(control);
    cudaGetLastError();
  }
}

const std::string& PoisonLocked(Heap& heap, const std::string& message) {
  if (heap.poisoned.empty()) heap.poisoned = message;
  if (heap.control != nullptr) {
    __atomic_store_n(&heap.control->abort, 1, __ATOMIC_SEQ_CST);
  }
  return heap.poisoned;
}

std::string FaultMessage(const Heap& heap, uint64_t fault) {
  std::ostringstream msg;
  msg << "a " << OpName(FaultOp(fault)) << " kernel of heap " << heap.id << " received device index "
      << FaultDevice(fault) << " outside [0, " << heap.world
      << ") and did nothing (its results are garbage); the heap is now unusable: free and re-create it";
  return msg.str();
}

std::string CurrentPoison(Heap& heap) {
  const uint64_t fault = __atomic_load_n(&heap.control->fault, __ATOMIC_ACQUIRE);
  std::lock_guard<std::mutex> lock(heap.mu);
  if (fault != 0) PoisonLocked(heap, FaultMessage(heap, fault));
  return heap.poisoned;
}

Error CheckBarrierTimeout(double seconds) {
  if (TimeoutNanos(seconds) < 0)
    return InvalidArgument("barrier timeout must be > 0 seconds (or inf to wait forever), got " +
                           std::to_string(seconds));
  return Error::Success();
}

ErrorOr<int64_t> CreateHeap(int32_t world, bool deterministic, double barrier_timeout_s) {
  if (world < 1 || world > kMaxWorld) {
    return Fail(InvalidArgument("heap world size must be in [1, " + std::to_string(kMaxWorld) + "] on CUDA, got " +
                                std::to_string(world)));
  }
  if (Error e = CheckBarrierTimeout(barrier_timeout_s); e.failure()) return Fail(e);
  auto visible = VisibleDeviceCount();
  if (!visible.has_value()) return Fail(visible.error());
  const int count = *visible;
  auto heap = std::make_shared<Heap>();
  heap->world = world;
  heap->deterministic = deterministic;
  heap->barrier_timeout_s = barrier_timeout_s;
  // Default placement: position p on visible GPU p (wrapping when the world exceeds the GPU count, which only a test
  // driving the handlers by hand can do). SetPlacement overrides it before the first bucket is registered.
  heap->placement.resize(world);
  for (int32_t p = 0; p < world; ++p) heap->placement[p] = p % count;
  bool native_atomics = true;
  if (Error e = EnablePeerAccess(heap->placement, &native_atomics); e.failure()) return Fail(e);
  heap->landing_slots = deterministic || !native_atomics;
  {
    ScopedDevice on(heap->placement[0]);
    void* control = nullptr;
    cudaError_t e = on.ok() ? cudaHostAlloc(&control, sizeof(HeapControl), cudaHostAllocMapped | cudaHostAllocPortable)
                            : on.status();
    if (e != cudaSuccess) {
      cudaGetLastError();
      return Fail(Error::Internal(CudaMessage("allocating the heap's pinned control block", e)));
    }
    std::memset(control, 0, sizeof(HeapControl));
    heap->control = static_cast<HeapControl*>(control);
  }
  return Heaps().Add(heap);
}

Error SetPlacement(int64_t heap_id, const std::vector<int32_t>& gpus) {
  auto found = FindHeap(heap_id);
  if (!found.has_value()) return found.error();
  const std::shared_ptr<Heap>& heap = *found;
  if (static_cast<int32_t>(gpus.size()) != heap->world) {
    return InvalidArgument("placement lists " + std::to_string(gpus.size()) + " GPUs, heap " +
                           std::to_string(heap_id) + " has " + std::to_string(heap->world) + " devices");
  }
  auto visible = VisibleDeviceCount();
  if (!visible.has_value()) return visible.error();
  const int count = *visible;
  for (int32_t g : gpus) {
    if (g < 0 || g >= count)
      return InvalidArgument("placement names GPU " + std::to_string(g) + ", but only " + std::to_string(count) +
                             " are visible");
  }
  std::lock_guard<std::mutex> lock(heap->mu);
  if (!heap->buckets.empty()) {
    return InvalidArgument("heap " + std::to_string(heap_id) +
                           " already holds buckets: set its placement before registering any");
  }
  bool native_atomics = true;
  if (Error e = EnablePeerAccess(gpus, &native_atomics); e.failure()) return e;
  heap->placement = gpus;
  heap->landing_slots = heap->deterministic || !native_atomics;
  return Error::Success();
}

Error FreeHeap(int64_t heap_id) {
  auto removed = Heaps().Remove(heap_id, "(already freed?)");
  if (!removed.has_value()) return removed.error();
  const std::shared_ptr<Heap>& heap = *removed;
  std::map<int64_t, std::shared_ptr<Bucket>> buckets;
  {
    // Release barrier kernels still waiting so that nothing below waits for a timeout.
    std::lock_guard<std::mutex> lock(heap->mu);
    PoisonLocked(*heap, "heap " + std::to_string(heap_id) + " was freed");
    buckets.swap(heap->buckets);
  }
  // Queued kernels of every GPU may still read these buckets (peers' too) or the control block, which goes with
  // the last reference: let them finish (waiting barrier kernels see `abort` and return at once).
  SynchronizeGpus(heap->placement);
  buckets.clear();
  return Error::Success();
}

ErrorOr<std::shared_ptr<Heap>> FindHeap(int64_t heap_id) {
  return Heaps().Find(heap_id, "(freed, or created in another process?)");
}

ErrorOr<std::shared_ptr<Bucket>> FindBucket(const std::shared_ptr<Heap>& heap, int64_t bucket_id) {
  return Heaps().FindBucket(*heap, bucket_id);
}

ErrorOr<int64_t> RegisterBucket(int64_t heap_id, int64_t numel, Dtype master) {
  auto found = FindHeap(heap_id);
  if (!found.has_value()) return Fail(found.error());
  const std::shared_ptr<Heap>& heap = *found;
  if (numel < 1) return Fail(InvalidArgument("bucket size must be >= 1 element, got " + std::to_string(numel)));
  const int32_t world = heap->world;
  const std::string what = "a bucket of " + std::to_string(numel) + " " + DtypeName(master) + " elements over " +
                           std::to_string(world) + " devices in heap " + std::to_string(heap_id);
  std::lock_guard<std::mutex> lock(heap->mu);  // placement must not change while we allocate
  if (!heap->poisoned.empty()) return Fail(InvalidArgument(heap->poisoned));
  auto b = std::make_shared<Bucket>();
  BucketView& v = b->view;
  v.layout = MakeLayout(numel, world, DtypeBytes(master));
  v.master = master;
  v.landing_slots = heap->landing_slots;
  if (v.layout.shard_numel < 1 || !CheckedBucketBytes(v.layout, v.landing_slots, &b->bytes)) {
    std::ostringstream msg;
    const double per_element = DtypeBytes(master) + 4.0 + (v.landing_slots ? 4.0 * world : 0.0);
    msg << what << " is too large: its memory (about " << static_cast<double>(numel) * per_element
        << " bytes) overflows 64-bit byte counts";
    return Fail(InvalidArgument(msg.str()));
  }
  // Refuse up front what a GPU cannot hold (positions sharing a GPU add up), naming the bytes asked for.
  std::map<int32_t, int64_t> per_gpu;
  for (int32_t p = 0; p < world; ++p) per_gpu[heap->placement[p]] += b->bytes.per_device;
  for (const auto& [gpu, needed] : per_gpu) {
    ScopedDevice on(gpu);
    size_t free_bytes = 0, total_bytes = 0;
    if (on.ok() && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      if (static_cast<uint64_t>(needed) > free_bytes) {
        return Fail(OutOfMemory("out of GPU memory: " + what + " needs " + std::to_string(needed) + " bytes on GPU " +
                                std::to_string(gpu) + " (" + std::to_string(b->bytes.total) + " bytes in all), only " +
                                std::to_string(free_bytes) + " are free"));
      }
    } else {
      cudaGetLastError();  // the allocation below reports a real problem
    }
  }
  const int64_t shard_numel = v.layout.shard_numel;
  b->shards = std::vector<DeviceBuffer>(world);
  b->accumulators = std::vector<DeviceBuffer>(world);
  if (v.landing_slots) b->landing = std::vector<DeviceBuffer>(world);
  for (int32_t p = 0; p < world; ++p) {
    const int32_t gpu = heap->placement[p];
    Error e = b->shards[p].Allocate(gpu, b->bytes.shard);
    if (e.success()) e = b->accumulators[p].Allocate(gpu, b->bytes.accumulator);
    if (e.success() && v.landing_slots) e = b->landing[p].Allocate(gpu, b->bytes.landing);
    if (e.failure()) {
      const bool oom = IsOutOfMemory(e);
      // the DeviceBuffers allocated so far are released with `b`
      return Fail(Error(CodeOf(e), std::string(oom ? "out of GPU memory: " : "") + "registering " + what + " (" +
                                       std::to_string(b->bytes.total) + " bytes, " + std::to_string(shard_numel) +
                                       " elements per shard; device " + std::to_string(p) + "): " + e.message()));
    }
    v.shard[p] = b->shards[p].data();
    v.accumulator[p] = static_cast<float*>(b->accumulators[p].data());
    v.landing[p] = v.landing_slots ? static_cast<float*>(b->landing[p].data()) : nullptr;
  }
  b->id = g_next_bucket_id++;
  heap->buckets[b->id] = b;
  return b->id;
}

Error FreeBucket(int64_t heap_id, int64_t bucket_id) {
  auto found = FindHeap(heap_id);
  if (!found.has_value()) return found.error();
  const std::shared_ptr<Heap>& heap = *found;
  std::shared_ptr<Bucket> bucket;
  {
    std::lock_guard<std::mutex> lock(heap->mu);
    auto it = heap->buckets.find(bucket_id);
    if (it == heap->buckets.end())
      return InvalidArgument("bucket " + std::to_string(bucket_id) + " is not registered in heap " +
                             std::to_string(heap_id));
    bucket = it->second;
    heap->buckets.erase(it);
  }
  // Kernels queued on any GPU of the heap may still read or write this bucket: let them finish first. The memory
  // goes with the last reference (a handler running right now may still hold one).
  SynchronizeGpus(heap->placement);
  return Error::Success();
}

int64_t LiveHeapCount() { return Heaps().Count(); }

std::string AbortHeap(int64_t heap_id, const std::string& reason) {
  auto found = FindHeap(heap_id);
  if (!found.has_value()) return "";
  Heap& heap = **found;
  std::lock_guard<std::mutex> lock(heap.mu);
  return PoisonLocked(heap, "aborted: " + reason + "; the heap is now unusable: free and re-create it");
}

void AbortOnHandlerError(int64_t heap_id, const std::string& message) {
  int gpu = -1;
  if (cudaGetDevice(&gpu) != cudaSuccess) {
    cudaGetLastError();
    gpu = -1;
  }
  AbortHeap(heap_id, "the device on GPU " + std::to_string(gpu) + " failed: " + message);
}

}  // namespace jodc::cuda
