// The CUDA heap registry: creating heaps (placement, peer access, pinned control block), registering and freeing
// buckets (per-GPU allocations), and poisoning. Host code only; the kernels live in one file per op.
#include "cuda/heap.cuh"

#include <cuda.h>  // driver types only: the few driver calls are resolved at run time, nothing links libcuda

#include <algorithm>
#include <cstring>
#include <sstream>

#include "common/bucket_plan.h"
#include "common/registry.h"

namespace jodc::cuda {
namespace {

std::atomic<int64_t> g_live_bytes{0};

HeapRegistry<Heap>& Heaps() { return RegistryOf<Heap>("heap"); }

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

namespace {

// Driver entry points resolved once through the runtime (the static runtime loads libcuda itself when a GPU is used).
// Each is requested with the ABI version named in Driver() (the signatures below are those versions').
struct DriverCalls {
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*ctx_get_device)(CUdevice*) = nullptr;
  CUresult (*primary_ctx_state)(CUdevice, unsigned int*, int*) = nullptr;
  bool ok() const { return ctx_get_current != nullptr && ctx_set_current != nullptr && ctx_get_device != nullptr; }
};

template <typename Fn>
void Resolve(const char* symbol, int version, Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &found);
#else
  (void)version;
  cudaError_t e = cudaGetDriverEntryPoint(symbol, &fn, cudaEnableDefault, &found);
#endif
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    fn = nullptr;
  }
  *out = reinterpret_cast<Fn>(fn);
}

const DriverCalls& Driver() {
  static const DriverCalls calls = [] {
    DriverCalls c;
    Resolve("cuCtxGetCurrent", 4000, &c.ctx_get_current);
    Resolve("cuCtxSetCurrent", 4000, &c.ctx_set_current);
    Resolve("cuCtxGetDevice", 2000, &c.ctx_get_device);
    Resolve("cuDevicePrimaryCtxGetState", 7000, &c.primary_ctx_state);
    return c;
  }();
  return calls;
}

}  // namespace

bool CurrentContextDevice(int32_t* device) {
  const DriverCalls& d = Driver();
  if (!d.ok()) return false;
  CUcontext ctx = nullptr;
  if (d.ctx_get_current(&ctx) != CUDA_SUCCESS) return false;
  if (ctx == nullptr) {
    *device = -1;
    return true;
  }
  CUdevice dev = 0;
  if (d.ctx_get_device(&dev) != CUDA_SUCCESS) return false;
  *device = static_cast<int32_t>(dev);
  return true;
}

bool PrimaryContextActive(int32_t gpu, bool* active) {
  const DriverCalls& d = Driver();
  if (d.primary_ctx_state == nullptr) return false;
  unsigned flags = 0;
  int state = 0;
  if (d.primary_ctx_state(static_cast<CUdevice>(gpu), &flags, &state) != CUDA_SUCCESS) return false;
  *active = state != 0;
  return true;
}

ScopedDevice::ScopedDevice(int32_t gpu) {
  const DriverCalls& d = Driver();
  CUcontext ctx = nullptr;
  if (d.ok() && d.ctx_get_current(&ctx) == CUDA_SUCCESS) {
    previous_context_ = ctx;  // may be null: nothing was current, and nothing will be afterwards
    restore_context_ = true;
  } else if (cudaGetDevice(&previous_) != cudaSuccess) {
    cudaGetLastError();
    previous_ = -1;
  }
  status_ = cudaSetDevice(gpu);
  if (status_ != cudaSuccess) cudaGetLastError();
}

ScopedDevice::~ScopedDevice() {
  if (restore_context_) {
    Driver().ctx_set_current(static_cast<CUcontext>(previous_context_));
  } else if (previous_ >= 0) {
    cudaSetDevice(previous_);
  }
}

ErrorOr<cudaStream_t> HostStream(int32_t gpu) {
  static std::mutex mu;
  static std::map<int32_t, cudaStream_t>* streams = new std::map<int32_t, cudaStream_t>();  // kept until exit
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams->find(gpu);
  if (it != streams->end()) return it->second;
  ScopedDevice on(gpu);
  cudaStream_t s = nullptr;
  cudaError_t e = on.ok() ? cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) : on.status();
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Fail(Error::Internal(CudaMessage(("creating jodc's copy stream on GPU " + std::to_string(gpu)).c_str(), e)));
  }
  (*streams)[gpu] = s;
  return s;
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
  auto stream_or = HostStream(gpu);
  if (!stream_or.has_value()) return stream_or.error();
  cudaStream_t stream = *stream_or;
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, static_cast<size_t>(bytes));
  // On jodc's own non-blocking stream: the legacy default stream would queue behind unrelated kernels.
  if (e == cudaSuccess) e = cudaMemsetAsync(p, 0, static_cast<size_t>(bytes), stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);  // zeros land before any XLA stream reads
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

Error Heap::NoteLaunch(cudaStream_t stream, int32_t gpu) {
  std::lock_guard<std::mutex> lock(launches_mu_);
  StreamEvent* slot = nullptr;
  for (StreamEvent& s : launches_) {
    if (s.stream == stream && s.gpu == gpu) slot = &s;
  }
  if (slot == nullptr) {
    cudaEvent_t event = nullptr;
    // The calling handler already made `gpu` current: the event belongs to the stream's context.
    cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return Error::Internal(CudaMessage("creating the heap's completion event", e));
    }
    launches_.push_back({stream, gpu, event});
    slot = &launches_.back();
  }
  const cudaError_t e = cudaEventRecord(slot->event, stream);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Error::Internal(CudaMessage("recording the heap's completion event", e));
  }
  return Error::Success();
}

void Heap::WaitForLaunches() {
  std::vector<StreamEvent> pending;
  {
    std::lock_guard<std::mutex> lock(launches_mu_);
    pending = launches_;  // events stay owned by the heap; waiting happens outside the lock
  }
  for (const StreamEvent& s : pending) {
    ScopedDevice on(s.gpu);
    if (on.ok()) cudaEventSynchronize(s.event);
    cudaGetLastError();
  }
}

Heap::~Heap() {
  WaitForLaunches();  // nothing queued may still use the control block or the reports
  for (const StreamEvent& s : launches_) {
    ScopedDevice on(s.gpu);
    cudaEventDestroy(s.event);
  }
  if (control != nullptr) {
    if (shm_bytes > 0) {
      ReleaseSharedControl(control, shm_bytes);
    } else {
      cudaFreeHost(control);
    }
  }
  cudaGetLastError();  // at interpreter exit the runtime may already be unloading; nothing to report then
}

Bucket::~Bucket() {
  for (void* p : imported) {
    ScopedDevice on(import_gpu);
    cudaIpcCloseMemHandle(p);
  }
  cudaGetLastError();
}

int32_t Heap::LocalPosition() const {
  for (int32_t p = 0; p < static_cast<int32_t>(local.size()); ++p) {
    if (local[p] != 0) return p;
  }
  return -1;
}

namespace {

// Multi-process heaps: writes `message` into the shared control block as the heap's abort reason unless another
// process (or this one) already did. Claimed with a compare-and-swap, so concurrent writers never mix their texts.
void ShareAbortReason(const Heap& heap, const std::string& message) {
  HeapControl* c = heap.control;
  int32_t expected = kReasonEmpty;
  if (!__atomic_compare_exchange_n(&c->abort_reason_state, &expected, kReasonWriting, /*weak=*/false,
                                   __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    return;  // a first cause is recorded (or being recorded) already
  }
  const size_t n = std::min(message.size(), static_cast<size_t>(kAbortReasonBytes - 1));
  std::memcpy(c->abort_reason, message.data(), n);
  c->abort_reason[n] = '\0';
  c->abort_reason_position = heap.LocalPosition();
  __atomic_store_n(&c->abort_reason_state, kReasonReady, __ATOMIC_RELEASE);
}

// What a process sees once another process sharing the heap aborted it: that process's position and first cause
// (when it has finished writing it), else a generic message.
std::string AbortedElsewhereMessage(const Heap& heap) {
  const HeapControl* c = heap.control;
  std::string prefix = "heap " + std::to_string(heap.id) + " was aborted by ";
  const std::string suffix = "; the heap is now unusable: free and re-create it";
  if (__atomic_load_n(&c->abort_reason_state, __ATOMIC_ACQUIRE) == kReasonReady) {
    const std::string reason(c->abort_reason, strnlen(c->abort_reason, kAbortReasonBytes));
    return prefix + "the process of position " + std::to_string(c->abort_reason_position) + " sharing it: " + reason;
  }
  return prefix + "another process sharing it (its error is in that process's output)" + suffix;
}

}  // namespace

const std::string& PoisonLocked(Heap& heap, const std::string& message) {
  if (heap.poisoned.empty()) heap.poisoned = message;
  if (heap.control != nullptr) {
    // The shared reason goes first: a process that sees `abort` below then finds the cause next to it.
    if (heap.shm_bytes > 0) ShareAbortReason(heap, heap.poisoned);
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
  // A shared control block (several processes) may have been aborted by another process: fail fast here too.
  const bool aborted_elsewhere = heap.shm_bytes > 0 && __atomic_load_n(&heap.control->abort, __ATOMIC_ACQUIRE) != 0;
  std::lock_guard<std::mutex> lock(heap.mu);
  if (fault != 0) PoisonLocked(heap, FaultMessage(heap, fault));
  if (aborted_elsewhere && heap.poisoned.empty()) PoisonLocked(heap, AbortedElsewhereMessage(heap));
  return heap.poisoned;
}

ErrorOr<int64_t> CreateHeap(int32_t world, bool deterministic, double barrier_timeout_s,
                            const std::vector<int32_t>& placement) {
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
  if (placement.empty()) {
    // Position p on visible GPU p, wrapping when the world exceeds the GPU count: only tests driving the handlers
    // by hand (several positions simulated on one GPU) create heaps without a placement.
    heap->placement.resize(world);
    for (int32_t p = 0; p < world; ++p) heap->placement[p] = p % count;
  } else {
    if (static_cast<int32_t>(placement.size()) != world) {
      return Fail(InvalidArgument("placement lists " + std::to_string(placement.size()) + " GPUs for a heap of " +
                                  std::to_string(world) + " devices"));
    }
    for (int32_t g : placement) {
      if (g < 0 || g >= count) {
        return Fail(InvalidArgument("placement names GPU " + std::to_string(g) + ", but only " +
                                    std::to_string(count) + " are visible"));
      }
    }
    heap->placement = placement;
  }
  bool native_atomics = true;
  if (Error e = EnablePeerAccess(heap->placement, &native_atomics); e.failure()) return Fail(e);
  heap->landing_slots = deterministic || !native_atomics;
  {
    ScopedDevice on(heap->placement[0]);
    void* control = nullptr;
    cudaError_t e = on.ok() ? AllocateMappedZeros(sizeof(HeapControl), &control) : on.status();
    heap->control = static_cast<HeapControl*>(control);  // freed by ~Heap, also when the reports fail below
    heap->control_dev = heap->control;                  // cudaHostAlloc'ed: one address for host and device (UVA)
    if (e == cudaSuccess) e = heap->reports.Allocate(world);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return Fail(Error::Internal(CudaMessage("allocating the heap's pinned control block and barrier reports", e)));
    }
  }
  return AddHeap(std::move(heap));
}

int64_t AddHeap(std::shared_ptr<Heap> heap) { return Heaps().Add(std::move(heap)); }

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
    for (auto& [id, b] : heap->pending) buckets[id] = b;
    heap->pending.clear();
  }
  // This heap's queued kernels may still read these buckets (peers' too) or the control block, which goes with the
  // last reference: let them finish (waiting barrier kernels see `abort` and return at once). Only this heap's own
  // launches are waited for, never unrelated work on the same GPUs.
  heap->WaitForLaunches();
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
  const int32_t world = heap->world;
  auto plan = PlanBucket(numel, master, world, heap->landing_slots, heap_id);
  if (!plan.has_value()) return Fail(plan.error());
  const std::string& what = plan->what;
  {
    std::lock_guard<std::mutex> lock(heap->mu);
    if (!heap->poisoned.empty()) return Fail(InvalidArgument(heap->poisoned));
  }
  // Placement and mode are immutable: nothing below needs heap->mu, so handlers of this heap (which take it briefly)
  // never wait for these allocations.
  auto b = std::make_shared<Bucket>();
  BucketView& v = b->view;
  v.layout = plan->layout;
  v.master = master;
  v.landing_slots = heap->landing_slots;
  b->bytes = plan->bytes;
  // Refuse up front what a GPU cannot hold (positions sharing a GPU add up), naming the bytes asked for.
  std::map<int32_t, int64_t> per_gpu;
  for (int32_t p = 0; p < world; ++p) {
    if (heap->IsLocal(p)) per_gpu[heap->placement[p]] += b->bytes.per_device;
  }
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
  b->attached.assign(world, 0);
  for (int32_t p = 0; p < world; ++p) {
    if (!heap->IsLocal(p)) continue;  // another process's memory: imported later (ipc.cu)
    b->attached[p] = 1;
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
  std::lock_guard<std::mutex> lock(heap->mu);
  // Poisoned or freed while we allocated: no kernel ever saw `b`.
  if (!heap->poisoned.empty()) return Fail(InvalidArgument(heap->poisoned));
  b->id = Heaps().NewBucketId();
  if (heap->local.empty()) {
    heap->buckets[b->id] = b;
  } else {
    heap->pending[b->id] = b;  // usable once every remote position is imported
  }
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
    auto waiting = heap->pending.find(bucket_id);
    if (it != heap->buckets.end()) {
      bucket = it->second;
      heap->buckets.erase(it);
    } else if (waiting != heap->pending.end()) {
      bucket = waiting->second;
      heap->pending.erase(waiting);
    } else {
      return InvalidArgument("bucket " + std::to_string(bucket_id) + " is not registered in heap " +
                             std::to_string(heap_id));
    }
  }
  // This heap's kernels queued on any GPU may still read or write this bucket: let them finish first. The memory
  // goes with the last reference (a handler running right now may still hold one).
  heap->WaitForLaunches();
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
