#include "cpu/heap.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
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

bool CheckBarrierTimeout(double seconds, std::string* err) {
  if (TimeoutNanos(seconds) < 0) {
    *err = "barrier timeout must be > 0 seconds (or inf to wait forever), got " + std::to_string(seconds);
    return false;
  }
  return true;
}

int64_t CreateHeap(int32_t world, bool deterministic, double barrier_timeout_s, std::string* err) {
  if (world < 1) {
    *err = "heap world size must be >= 1, got " + std::to_string(world);
    return -1;
  }
  if (!CheckBarrierTimeout(barrier_timeout_s, err)) return -1;
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

int64_t RegisterBucket(int64_t heap_id, int64_t numel, Dtype master, std::string* err, bool* out_of_memory) {
  if (out_of_memory) *out_of_memory = false;
  auto heap = FindHeap(heap_id, err);
  if (!heap) return -1;
  if (numel < 1) {
    *err = "bucket size must be >= 1 element, got " + std::to_string(numel);
    return -1;
  }
  const std::string what = "a bucket of " + std::to_string(numel) + " " + DtypeName(master) + " elements over " +
                           std::to_string(heap->world) + " devices in heap " + std::to_string(heap_id);
  auto b = std::make_shared<Bucket>();
  b->master = master;
  b->layout = MakeLayout(numel, heap->world, DtypeBytes(master));
  if (b->layout.shard_numel < 1 || !CheckedBucketBytes(b->layout, heap->deterministic, &b->bytes)) {
    std::ostringstream msg;
    const double per_element = DtypeBytes(master) + 4.0 + (heap->deterministic ? 4.0 * heap->world : 0.0);
    msg << what << " is too large: its memory (about " << static_cast<double>(numel) * per_element
        << " bytes) overflows 64-bit byte counts";
    *err = msg.str();
    return -1;
  }
  const int64_t available = AvailableHostBytes();
  if (b->bytes.total > available) {
    if (out_of_memory) *out_of_memory = true;
    *err = "out of host memory: " + what + " needs " + std::to_string(b->bytes.total) + " bytes, only " +
           std::to_string(available) + " are available";
    return -1;
  }
  const int64_t padded = b->layout.padded_numel();
  try {
    b->shards = std::make_unique<AlignedBuffer>(b->bytes.shard * heap->world);
    b->accumulators = std::make_unique<AlignedBuffer>(b->bytes.accumulator * heap->world);
    if (heap->deterministic) {
      b->landing = std::make_unique<AlignedBuffer>(b->bytes.landing * heap->world);
    }
  } catch (const std::bad_alloc&) {
    if (out_of_memory) *out_of_memory = true;
    *err = "out of host memory: allocating " + what + " (" + std::to_string(b->bytes.total) + " bytes, " +
           std::to_string(padded) + " padded elements) failed";
    return -1;
  }
  b->id = g_next_bucket_id++;
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

std::string AbortHeap(int64_t heap_id, const std::string& reason) {
  std::string ignored;
  auto heap = FindHeap(heap_id, &ignored);
  if (!heap) return "";
  std::lock_guard<std::mutex> lock(heap->mu);
  if (heap->poisoned.empty())
    heap->poisoned = "aborted: " + reason + "; the heap is now unusable: free and re-create it";
  heap->barrier_cv.notify_all();
  return heap->poisoned;
}

void AbortOnHandlerError(int64_t heap_id, int32_t device, const std::string& message) {
  AbortHeap(heap_id, "device " + std::to_string(device) + " failed: " + message);
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
