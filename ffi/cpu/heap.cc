#include "cpu/heap.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>

namespace jodc::cpu {
namespace {

std::atomic<int64_t> g_live_bytes{0};
std::atomic<int64_t> g_next_heap_id{1};
std::atomic<int64_t> g_next_bucket_id{1};

std::mutex g_registry_mu;
std::unordered_map<int64_t, std::shared_ptr<Heap>>& Registry() {
  static auto* heaps = new std::unordered_map<int64_t, std::shared_ptr<Heap>>();
  return *heaps;
}

}  // namespace

AlignedBuffer::AlignedBuffer(int64_t bytes) : bytes_(bytes) {
  int64_t rounded = (bytes + kShardAlignBytes - 1) / kShardAlignBytes * kShardAlignBytes;
  if (rounded == 0) rounded = kShardAlignBytes;
  data_ = std::aligned_alloc(kShardAlignBytes, rounded);
  if (data_ == nullptr) throw std::bad_alloc();
  std::memset(data_, 0, rounded);
  g_live_bytes += bytes_;
}

AlignedBuffer::~AlignedBuffer() {
  std::free(data_);
  g_live_bytes -= bytes_;
}

int64_t LiveHeapBytes() { return g_live_bytes.load(); }

int64_t CreateHeap(int32_t world, bool deterministic, double barrier_timeout_s, std::string* err) {
  if (world < 1) {
    *err = "heap world size must be >= 1, got " + std::to_string(world);
    return -1;
  }
  if (!(barrier_timeout_s > 0)) {
    *err = "barrier timeout must be > 0 seconds";
    return -1;
  }
  auto heap = std::make_shared<Heap>();
  heap->id = g_next_heap_id++;
  heap->world = world;
  heap->deterministic = deterministic;
  heap->barrier_timeout_s = barrier_timeout_s;
  heap->arrivals.assign(world, 0);
  std::lock_guard<std::mutex> lock(g_registry_mu);
  Registry()[heap->id] = heap;
  return heap->id;
}

bool FreeHeap(int64_t heap_id, std::string* err) {
  std::shared_ptr<Heap> heap;
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    auto it = Registry().find(heap_id);
    if (it == Registry().end()) {
      *err = "heap " + std::to_string(heap_id) + " is not registered (already freed?)";
      return false;
    }
    heap = it->second;
    Registry().erase(it);
  }
  // Wake any device still blocked in a barrier of this heap so it fails instead of hanging.
  std::lock_guard<std::mutex> lock(heap->mu);
  heap->poisoned = "heap " + std::to_string(heap_id) + " was freed";
  heap->buckets.clear();
  heap->barrier_cv.notify_all();
  return true;
}

std::shared_ptr<Heap> FindHeap(int64_t heap_id, std::string* err) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = Registry().find(heap_id);
  if (it == Registry().end()) {
    *err = "heap " + std::to_string(heap_id) + " is not registered (freed, or created in another process?)";
    return nullptr;
  }
  return it->second;
}

std::shared_ptr<Bucket> FindBucket(const std::shared_ptr<Heap>& heap, int64_t bucket_id, std::string* err) {
  std::lock_guard<std::mutex> lock(heap->mu);
  auto it = heap->buckets.find(bucket_id);
  if (it == heap->buckets.end()) {
    *err = "bucket " + std::to_string(bucket_id) + " is not registered in heap " + std::to_string(heap->id) +
           " (freed?)";
    return nullptr;
  }
  return it->second;
}

int64_t RegisterBucket(int64_t heap_id, int64_t numel, Dtype master, std::string* err) {
  auto heap = FindHeap(heap_id, err);
  if (!heap) return -1;
  if (numel < 1) {
    *err = "bucket size must be >= 1 element, got " + std::to_string(numel);
    return -1;
  }
  auto b = std::make_shared<Bucket>();
  b->id = g_next_bucket_id++;
  b->master = master;
  b->layout = MakeLayout(numel, heap->world, DtypeBytes(master));
  const int64_t padded = b->layout.padded_numel();
  try {
    b->shards = std::make_unique<AlignedBuffer>(padded * DtypeBytes(master));
    b->accumulators = std::make_unique<AlignedBuffer>(padded * 4);
    if (heap->deterministic) {
      b->landing = std::make_unique<AlignedBuffer>(padded * heap->world * 4);
    }
  } catch (const std::bad_alloc&) {
    *err = "out of host memory registering a bucket of " + std::to_string(numel) + " elements";
    return -1;
  }
  for (int32_t o = 0; o < heap->world; ++o) b->owner_locks.push_back(std::make_unique<std::mutex>());
  std::lock_guard<std::mutex> lock(heap->mu);
  if (!heap->poisoned.empty()) {
    *err = heap->poisoned;
    return -1;
  }
  heap->buckets[b->id] = b;
  return b->id;
}

bool FreeBucket(int64_t heap_id, int64_t bucket_id, std::string* err) {
  auto heap = FindHeap(heap_id, err);
  if (!heap) return false;
  std::lock_guard<std::mutex> lock(heap->mu);
  if (heap->buckets.erase(bucket_id) == 0) {
    *err = "bucket " + std::to_string(bucket_id) + " is not registered in heap " + std::to_string(heap_id);
    return false;
  }
  return true;
}

int64_t LiveHeapCount() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  return static_cast<int64_t>(Registry().size());
}

bool ResolveTarget(const char* op, int64_t heap_id, int64_t bucket_id, int32_t device, OpTarget* out,
                   std::string* err) {
  std::string why;
  out->heap = FindHeap(heap_id, &why);
  if (!out->heap) {
    *err = std::string("jodc ") + op + ": " + why;
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(out->heap->mu);
    if (!out->heap->poisoned.empty()) {
      *err = std::string("jodc ") + op + ": " + out->heap->poisoned;
      return false;
    }
  }
  if (device < 0 || device >= out->heap->world) {
    *err = std::string("jodc ") + op + ": device index " + std::to_string(device) + " outside [0, " +
           std::to_string(out->heap->world) + ") of heap " + std::to_string(heap_id);
    return false;
  }
  if (bucket_id >= 0) {
    out->bucket = FindBucket(out->heap, bucket_id, &why);
    if (!out->bucket) {
      *err = std::string("jodc ") + op + ": " + why;
      return false;
    }
  }
  return true;
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
