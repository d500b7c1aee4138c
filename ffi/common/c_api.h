// The error convention of the C APIs that Python loads with ctypes (ffi/mpi/capi.cc, ffi/cuda/management.cu): a
// fallible function returns 0 on success, 1 on failure and 2 on an allocation that cannot be had (Python raises
// MemoryError), with the message copied into the caller's buffer (err, err_capacity). Nothing throws.
#ifndef JODC_FFI_COMMON_C_API_H_
#define JODC_FFI_COMMON_C_API_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "common/error.h"

namespace jodc {

constexpr int32_t kCFailure = 1;
constexpr int32_t kCOutOfMemory = 2;

// Copies `text` into (out, capacity): NUL-terminated, truncated when it does not fit.
inline void CopyText(const std::string& text, char* out, int64_t capacity) {
  if (out == nullptr || capacity <= 0) return;
  const size_t n = std::min<size_t>(text.size(), static_cast<size_t>(capacity - 1));
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

// The C return code of `e`, its message copied into (err, capacity) when it failed.
inline int32_t Report(const Error& e, char* err, int64_t capacity) {
  if (e.success()) return 0;
  CopyText(e.message(), err, capacity);
  return IsOutOfMemory(e) ? kCOutOfMemory : kCFailure;
}

// A host-side access to device `device`'s memory of a heap of `world` devices.
inline Error CheckDevice(int32_t device, int32_t world) {
  if (device >= 0 && device < world) return Error::Success();
  return InvalidArgument("device " + std::to_string(device) + " outside [0, " + std::to_string(world) + ")");
}

// A heap and one of its buckets, resolved for a host-side access to a device's memory.
template <typename HeapPtr, typename BucketPtr>
struct HostTarget {
  HeapPtr heap;
  BucketPtr bucket;
};

// Resolves `heap` (a FindHeap result), its bucket `bucket_id` (find_bucket(heap pointer, id) -> ErrorOr<bucket
// pointer>) and checks `device`: the preamble of every C function that reads or writes a device's shard.
template <typename HeapPtr, typename FindBucket>
auto LocateForHost(ErrorOr<HeapPtr> heap, FindBucket&& find_bucket, int64_t bucket_id, int32_t device)
    -> ErrorOr<HostTarget<HeapPtr, std::decay_t<decltype(*find_bucket(std::declval<HeapPtr&>(), bucket_id))>>> {
  using Bucket = std::decay_t<decltype(*find_bucket(std::declval<HeapPtr&>(), bucket_id))>;
  if (!heap.has_value()) return Fail(heap.error());
  auto bucket = find_bucket(*heap, bucket_id);
  if (!bucket.has_value()) return Fail(bucket.error());
  if (Error e = CheckDevice(device, (*heap)->world); e.failure()) return Fail(e);
  return HostTarget<HeapPtr, Bucket>{*heap, *bucket};
}

// The C return code of fn(heap) -> Error on `heap` (a FindHeap result), or of the lookup's failure.
template <typename HeapPtr, typename Fn>
int32_t WithHeap(ErrorOr<HeapPtr> heap, char* err, int64_t capacity, Fn&& fn) {
  if (!heap.has_value()) return Report(heap.error(), err, capacity);
  return Report(fn(**heap), err, capacity);
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_C_API_H_
