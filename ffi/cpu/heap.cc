#include "cpu/heap.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "common/bucket_plan.h"
#include "common/registry.h"

namespace jodc::cpu {
namespace {

std::atomic<int64_t> g_live_bytes{0};

HeapRegistry<Heap>& Heaps() { return RegistryOf<Heap>("heap"); }

}  // namespace

AlignedBuffer::AlignedBuffer(int64_t bytes) : bytes_(bytes) {
  int64_t rounded = 0;
  if (!CheckedRoundUp(bytes, kShardAlignBytes, &rounded)) throw std::bad_alloc();  // negative or overflowing size
  if (rounded == 0) rounded = kShardAlignBytes;
  data_ = std::aligned_alloc(kShardAlignBytes, static_cast<size_t>(rounded));
  if (data_ == nullptr) throw std::bad_alloc();
  std::memset(data_, 0, static_cast<size_t>(rounded));
  g_live_bytes += bytes_;
}

AlignedBuffer::~AlignedBuffer() {
  std::free(data_);
  g_live_bytes -= bytes_;
}

int64_t LiveHeapBytes() { return g_live_bytes.load(); }

int64_t AvailableHostBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  int64_t available_kb = -1, swap_free_kb = 0;
  while (std::getline(meminfo, line)) {
    long long kb = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %lld kB", &kb) == 1) available_kb = kb;
    if (std::sscanf(line.c_str(), "SwapFree: %lld kB", &kb) == 1) swap_free_kb = kb;
  }
  if (available_kb >= 0) return (available_kb + swap_free_kb) * 1024;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) return static_cast<int64_t>(pages) * page;
  return kInt64Max;  // unknown: let the allocation decide
}

Error CheckBarrierTimeout(double seconds) {
  if (TimeoutNanos(seconds) < 0)
    return InvalidArgument("barrier timeout must be > 0 seconds (or inf to wait forever), got " +
                           std::to_string(seconds));
  return Error::Success();
}

ErrorOr<int64_t> CreateHeap(int32_t world, bool deterministic, double barrier_timeout_s) {
  if (world < 1) return Fail(InvalidArgument("heap world size must be >= 1, got " + std::to_string(world)));
  if (Error e = CheckBarrierTimeout(barrier_timeout_s); e.failure()) return Fail(e);
  auto heap = std::make_shared<Heap>();
  heap->world = world;
  heap->deterministic = deterministic;
  heap->barrier_timeout_s = barrier_timeout_s;
  heap->arrivals.assign(world, 0);
  heap->pair_arrivals.assign(static_cast<size_t>(world) * world, 0);
  return Heaps().Add(heap);
}

Error FreeHeap(int64_t heap_id) {
  auto removed = Heaps().Remove(heap_id, "(already freed?)");
  if (!removed.has_value()) return removed.error();
  const std::shared_ptr<Heap>& heap = *removed;
  // Wake any device still blocked in a barrier of this heap so it fails instead of hanging.
  std::lock_guard<std::mutex> lock(heap->mu);
  heap->poisoned = "heap " + std::to_string(heap_id) + " was freed";
  heap->buckets.clear();
  heap->barrier_cv.notify_all();
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
  auto plan = PlanBucket(numel, master, heap->world, heap->deterministic, heap_id);
  if (!plan.has_value()) return Fail(plan.error());
  const std::string& what = plan->what;
  auto b = std::make_shared<Bucket>();
  b->master = master;
  b->layout = plan->layout;
  b->bytes = plan->bytes;
  const int64_t available = AvailableHostBytes();
  if (b->bytes.total > available) {
    return Fail(OutOfMemory("out of host memory: " + what + " needs " + std::to_string(b->bytes.total) +
                            " bytes, only " + std::to_string(available) + " are available"));
  }
  const int64_t padded = b->layout.padded_numel();
  try {
    b->shards = std::make_unique<AlignedBuffer>(b->bytes.shard * heap->world);
    b->accumulators = std::make_unique<AlignedBuffer>(b->bytes.accumulator * heap->world);
    if (heap->deterministic) {
      b->landing = std::make_unique<AlignedBuffer>(b->bytes.landing * heap->world);
    }
  } catch (const std::bad_alloc&) {
    return Fail(OutOfMemory("out of host memory: allocating " + what + " (" + std::to_string(b->bytes.total) +
                            " bytes, " + std::to_string(padded) + " padded elements) failed"));
  }
  b->id = Heaps().NewBucketId();
  for (int32_t o = 0; o < heap->world; ++o) b->owner_locks.push_back(std::make_unique<std::mutex>());
  std::lock_guard<std::mutex> lock(heap->mu);
  if (!heap->poisoned.empty()) return Fail(InvalidArgument(heap->poisoned));
  heap->buckets[b->id] = b;
  return b->id;
}

Error FreeBucket(int64_t heap_id, int64_t bucket_id) {
  auto heap = FindHeap(heap_id);
  if (!heap.has_value()) return heap.error();
  std::lock_guard<std::mutex> lock((*heap)->mu);
  if ((*heap)->buckets.erase(bucket_id) == 0)
    return InvalidArgument("bucket " + std::to_string(bucket_id) + " is not registered in heap " +
                           std::to_string(heap_id));
  return Error::Success();
}

int64_t LiveHeapCount() { return Heaps().Count(); }

std::string AbortHeap(int64_t heap_id, const std::string& reason) {
  auto found = FindHeap(heap_id);
  if (!found.has_value()) return "";
  Heap& heap = **found;
  std::lock_guard<std::mutex> lock(heap.mu);
  if (heap.poisoned.empty()) heap.poisoned = "aborted: " + reason + "; the heap is now unusable: free and re-create it";
  heap.barrier_cv.notify_all();
  return heap.poisoned;
}

void AbortOnHandlerError(int64_t heap_id, int32_t device, const std::string& message) {
  AbortHeap(heap_id, "device " + std::to_string(device) + " failed: " + message);
}

ErrorOr<OpTarget> ResolveTarget(const char* op, int64_t heap_id, int64_t bucket_id, int32_t device) {
  OpTarget out;
  auto heap = FindHeap(heap_id);
  if (!heap.has_value()) return Fail(ForOp(op, heap.error()));
  out.heap = *heap;
  {
    std::lock_guard<std::mutex> lock(out.heap->mu);
    if (!out.heap->poisoned.empty()) return Fail(InvalidArgument(std::string("jodc ") + op + ": " + out.heap->poisoned));
  }
  if (device < 0 || device >= out.heap->world) {
    return Fail(InvalidArgument(std::string("jodc ") + op + ": device index " + std::to_string(device) +
                                " outside [0, " + std::to_string(out.heap->world) + ") of heap " +
                                std::to_string(heap_id)));
  }
  if (bucket_id >= 0) {
    auto bucket = FindBucket(out.heap, bucket_id);
    if (!bucket.has_value()) return Fail(ForOp(op, bucket.error()));
    out.bucket = *bucket;
  }
  return out;
}

void ReadAccumulator(const Bucket& b, int32_t d, bool deterministic, float* out) {
  const int64_t n = b.layout.shard_numel;
  if (!deterministic) {
    std::lock_guard<std::mutex> lock(*b.owner_locks[d]);
    std::memcpy(out, b.accumulator(d), n * sizeof(float));
    return;
  }
  // Fixed order: accumulator (host-set base) + source 0 + source 1 + ... regardless of arrival timing.
  std::memcpy(out, b.accumulator(d), n * sizeof(float));
  for (int32_t s = 0; s < b.layout.world; ++s) {
    const float* slot = b.landing_slot(d, s);
    for (int64_t i = 0; i < n; ++i) out[i] += slot[i];
  }
}

void ZeroAccumulator(const Bucket& b, int32_t d, bool deterministic) {
  const int64_t n = b.layout.shard_numel;
  std::lock_guard<std::mutex> lock(*b.owner_locks[d]);
  std::memset(b.accumulator(d), 0, n * sizeof(float));
  if (deterministic) {
    for (int32_t s = 0; s < b.layout.world; ++s) std::memset(b.landing_slot(d, s), 0, n * sizeof(float));
  }
}

}  // namespace jodc::cpu
