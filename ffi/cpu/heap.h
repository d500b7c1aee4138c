// The CPU symmetric heap: a process-wide registry of heaps, each holding buckets whose shards and fp32 accumulators
// live in host memory that every simulated device of the process can address directly (point-to-point = memcpy).
#ifndef JODC_FFI_CPU_HEAP_H_
#define JODC_FFI_CPU_HEAP_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/error.h"
#include "common/layout.h"

namespace jodc::cpu {

// 64-byte aligned, zero-initialised host allocation; counts its bytes in a process-wide tally.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(int64_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;
};

int64_t LiveHeapBytes();

struct Bucket {
  int64_t id = 0;
  BucketLayout layout;
  BucketBytes bytes;  // checked at registration: every offset the ops compute within the bucket fits int64
  Dtype master = Dtype::kF32;
  // One allocation each, device d's shard at offset d * shard bytes (every shard 64-byte aligned).
  std::unique_ptr<AlignedBuffer> shards;
  std::unique_ptr<AlignedBuffer> accumulators;  // fp32, world shards
  // Deterministic mode: per-(owner, source) fp32 landing slots, reduced in source order when read.
  std::unique_ptr<AlignedBuffer> landing;
  std::vector<std::unique_ptr<std::mutex>> owner_locks;  // non-deterministic mode: one lock per owner

  void* shard(int32_t d) const {
    return static_cast<char*>(shards->data()) + d * layout.shard_numel * DtypeBytes(master);
  }
  float* accumulator(int32_t d) const {
    return static_cast<float*>(accumulators->data()) + d * layout.shard_numel;
  }
  float* landing_slot(int32_t owner, int32_t source) const {
    return static_cast<float*>(landing->data()) + (static_cast<int64_t>(owner) * layout.world + source) *
                                                      layout.shard_numel;
  }
};

struct Heap {
  int64_t id = 0;
  int32_t world = 0;
  bool deterministic = false;
  std::atomic<double> barrier_timeout_s{300.0};

  std::mutex mu;  // guards buckets and the barrier state below
  std::map<int64_t, std::shared_ptr<Bucket>> buckets;
  std::condition_variable barrier_cv;
  std::vector<uint64_t> arrivals;  // per device: how many barriers it has entered (its generation)
  // Group barriers: [d * world + m] counts the group barriers device d has entered with m among the members (a
  // generation per pair of devices: groups may change between barriers; disjoint groups never touch each other's).
  std::vector<uint64_t> pair_arrivals;
  std::string poisoned;            // non-empty once a barrier timed out or the heap was aborted: every later op
                                   // fails with this
};

// Registry operations. Failures are returned as errors (common/error.h), never thrown across the FFI boundary.
ErrorOr<int64_t> CreateHeap(int32_t world, bool deterministic, double barrier_timeout_s);
// A barrier timeout is valid when > 0 (+inf: wait forever); an error for NaN, zero or negative values.
Error CheckBarrierTimeout(double seconds);
Error FreeHeap(int64_t heap_id);
ErrorOr<std::shared_ptr<Heap>> FindHeap(int64_t heap_id);
ErrorOr<std::shared_ptr<Bucket>> FindBucket(const std::shared_ptr<Heap>& heap, int64_t bucket_id);
// Fails when the bucket's byte counts overflow int64 (kInvalidArgument) or exceed the host memory available
// (kResourceExhausted, which the bindings raise as MemoryError).
ErrorOr<int64_t> RegisterBucket(int64_t heap_id, int64_t numel, Dtype master);
Error FreeBucket(int64_t heap_id, int64_t bucket_id);
int64_t LiveHeapCount();

// Bytes of host memory an allocation can still get without swapping out others (MemAvailable + SwapFree on Linux;
// total physical memory where /proc/meminfo is unavailable).
int64_t AvailableHostBytes();

// Aborts the heap: records "aborted: <reason>; the heap is now unusable: ..." as its poison (unless it is already poisoned, whose first cause
// stays) and wakes every device waiting in its barrier, which then fails with that message. Later ops fail too.
// Returns the poison message now recorded ("" when the heap does not exist).
std::string AbortHeap(int64_t heap_id, const std::string& reason);
// What a handler calls when it returns an error: aborts the heap with "device <d> failed: <message>", so peers
// waiting in a barrier for this device leave at once instead of waiting for the timeout.
void AbortOnHandlerError(int64_t heap_id, int32_t device, const std::string& message);

// Resolves heap + bucket and checks the device index; the common preamble of every handler (errors name the op).
struct OpTarget {
  std::shared_ptr<Heap> heap;
  std::shared_ptr<Bucket> bucket;  // null for heap-level ops (barrier)
};
ErrorOr<OpTarget> ResolveTarget(const char* op, int64_t heap_id, int64_t bucket_id, int32_t device);

// Accumulated gradient of device `d`'s shard (deterministic mode: landing slots summed in source order).
void ReadAccumulator(const Bucket& b, int32_t d, bool deterministic, float* out);
void ZeroAccumulator(const Bucket& b, int32_t d, bool deterministic);

}  // namespace jodc::cpu

#endif  // JODC_FFI_CPU_HEAP_H_
