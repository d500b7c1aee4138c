// The process-wide table of a backend's heaps by id (with their bucket ids), and the lookup of a bucket in a heap:
// one implementation for the CPU, MPI, CUDA and NVSHMEM heaps (their Heap types differ; each has `id`, `mu` and `buckets`). Ids are never reused,
// so a stale id fails with a message instead of reaching another heap.
#ifndef JODC_FFI_COMMON_REGISTRY_H_
#define JODC_FFI_COMMON_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/error.h"

namespace jodc {

template <typename Heap>
class HeapRegistry {
 public:
  // `kind` names the heaps in messages ("heap", "MPI heap").
  explicit HeapRegistry(std::string kind) : kind_(std::move(kind)) {}

  // Gives `heap` a new id and registers it; returns the id.
  int64_t Add(std::shared_ptr<Heap> heap) {
    heap->id = next_id_++;
    std::lock_guard<std::mutex> lock(mu_);
    heaps_[heap->id] = heap;
    return heap->id;
  }

  // The heap of `id`, or an error "<kind> <id> is not registered <why>".
  ErrorOr<std::shared_ptr<Heap>> Find(int64_t id, const char* why) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = heaps_.find(id);
    if (it == heaps_.end()) return Fail(NotRegistered(id, why));
    return it->second;
  }

  // Unregisters the heap of `id` and returns it (its memory goes with the last reference).
  ErrorOr<std::shared_ptr<Heap>> Remove(int64_t id, const char* why) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = heaps_.find(id);
    if (it == heaps_.end()) return Fail(NotRegistered(id, why));
    std::shared_ptr<Heap> heap = it->second;
    heaps_.erase(it);
    return heap;
  }

  // A new bucket id, unique among the buckets of every heap of this registry (never reused either).
  int64_t NewBucketId() { return next_bucket_id_++; }

  int64_t Count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(heaps_.size());
  }

  // The bucket `bucket_id` of `heap` (under heap.mu), or an error naming both.
  auto FindBucket(Heap& heap, int64_t bucket_id) const -> ErrorOr<typename decltype(heap.buckets)::mapped_type> {
    std::lock_guard<std::mutex> lock(heap.mu);
    auto it = heap.buckets.find(bucket_id);
    if (it == heap.buckets.end()) {
      return Fail(InvalidArgument("bucket " + std::to_string(bucket_id) + " is not registered in " + kind_ + " " +
                                  std::to_string(heap.id) + " (freed?)"));
    }
    return it->second;
  }

 private:
  Error NotRegistered(int64_t id, const char* why) const {
    return InvalidArgument(kind_ + " " + std::to_string(id) + " is not registered " + why);
  }

  const std::string kind_;
  std::atomic<int64_t> next_id_{1};
  std::atomic<int64_t> next_bucket_id_{1};
  mutable std::mutex mu_;
  std::unordered_map<int64_t, std::shared_ptr<Heap>> heaps_;
};

// The registry of a library's heaps of type Heap, `kind` naming them in messages: created on first use and never
// destroyed (handlers may still run during exit). Each backend wraps it in its Heaps() with its fixed kind.
template <typename Heap>
HeapRegistry<Heap>& RegistryOf(const char* kind) {
  static auto* heaps = new HeapRegistry<Heap>(kind);
  return *heaps;
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_REGISTRY_H_
