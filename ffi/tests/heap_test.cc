// The CPU heap registry of ffi/cpu/heap.{h,cc}: create / register / free, the error strings users see, memory
// accounting, alignment and zero-initialisation of shards and accumulators.
#include "cpu/heap.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <memory>
#include <string>
#include <utility>

#include "gtest/gtest.h"

namespace jodc::cpu {
namespace {

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The registry returns Error / ErrorOr<T> (common/error.h); these tests read a result as (value, or -1 / null / false
// on failure, with the error's message in *err and, for registration, whether its code is out-of-memory).
std::string Take(const Error& e, std::string* err) {
  if (e.failure()) *err = e.message();
  return e.message();
}
template <typename T>
T Take(ErrorOr<T> r, T failed, std::string* err) {
  if (r.has_value()) return std::move(*r);
  *err = r.error().message();
  return failed;
}
int64_t Create(int32_t world, bool deterministic, double timeout_s, std::string* err) {
  return Take(CreateHeap(world, deterministic, timeout_s), int64_t{-1}, err);
}
std::shared_ptr<Heap> Find(int64_t heap_id, std::string* err) {
  return Take(FindHeap(heap_id), std::shared_ptr<Heap>(), err);
}
std::shared_ptr<Bucket> FindB(const std::shared_ptr<Heap>& heap, int64_t bucket_id, std::string* err) {
  return Take(FindBucket(heap, bucket_id), std::shared_ptr<Bucket>(), err);
}
int64_t Register(int64_t heap_id, int64_t numel, Dtype master, std::string* err, bool* oom = nullptr) {
  auto r = RegisterBucket(heap_id, numel, master);
  if (oom != nullptr) *oom = !r.has_value() && IsOutOfMemory(r.error());
  return Take(std::move(r), int64_t{-1}, err);
}
bool Free(int64_t heap_id, std::string* err) { return Take(FreeHeap(heap_id), err).empty(); }
bool FreeB(int64_t heap_id, int64_t bucket_id, std::string* err) {
  return Take(FreeBucket(heap_id, bucket_id), err).empty();
}
bool TimeoutOk(double seconds, std::string* err) { return Take(CheckBarrierTimeout(seconds), err).empty(); }
bool Resolve(const char* op, int64_t heap_id, int64_t bucket_id, int32_t device, OpTarget* out, std::string* err) {
  auto r = ResolveTarget(op, heap_id, bucket_id, device);
  if (r.has_value()) *out = *r;
  else *err = r.error().message();
  return r.has_value();
}

TEST(Heap, CreateRejectsBadArguments) {
  std::string err;
  EXPECT_EQ(Create(0, false, 10.0, &err), -1);
  EXPECT_TRUE(Contains(err, "world size must be >= 1, got 0")) << err;
  err.clear();
  EXPECT_EQ(Create(2, false, 0.0, &err), -1);
  EXPECT_TRUE(Contains(err, "barrier timeout must be > 0")) << err;
  err.clear();
  EXPECT_EQ(Create(2, false, -1.0, &err), -1);
  EXPECT_FALSE(err.empty());
}

TEST(Heap, CreateFindFree) {
  std::string err;
  const int64_t before = LiveHeapCount();
  const int64_t id = Create(3, false, 5.0, &err);
  ASSERT_GT(id, 0) << err;
  EXPECT_EQ(LiveHeapCount(), before + 1);
  auto heap = Find(id, &err);
  ASSERT_NE(heap, nullptr) << err;
  EXPECT_EQ(heap->world, 3);
  EXPECT_FALSE(heap->deterministic);
  EXPECT_DOUBLE_EQ(heap->barrier_timeout_s.load(), 5.0);
  EXPECT_EQ(heap->arrivals.size(), 3u);

  const int64_t other = Create(1, true, 1.0, &err);
  EXPECT_NE(other, id) << "heap ids must be unique";

  ASSERT_TRUE(Free(id, &err)) << err;
  EXPECT_EQ(LiveHeapCount(), before + 1);
  EXPECT_EQ(heap->poisoned, "heap " + std::to_string(id) + " was freed") << "a freed heap must poison waiters";
  err.clear();
  EXPECT_FALSE(Free(id, &err));
  EXPECT_TRUE(Contains(err, "is not registered (already freed?)")) << err;
  err.clear();
  EXPECT_EQ(Find(id, &err), nullptr);
  EXPECT_TRUE(Contains(err, "heap " + std::to_string(id) + " is not registered")) << err;
  ASSERT_TRUE(Free(other, &err)) << err;
  EXPECT_EQ(LiveHeapCount(), before);
}

TEST(Heap, RegisterBucketLayoutAndMemory) {
  std::string err;
  const int64_t heap_id = Create(4, /*deterministic=*/false, 5.0, &err);
  ASSERT_GT(heap_id, 0) << err;
  const int64_t bytes_before = LiveHeapBytes();
  const int64_t bucket_id = Register(heap_id, 100, Dtype::kBF16, &err);
  ASSERT_GT(bucket_id, 0) << err;
  auto heap = Find(heap_id, &err);
  auto b = FindB(heap, bucket_id, &err);
  ASSERT_NE(b, nullptr) << err;
  EXPECT_EQ(b->layout.numel, 100);
  EXPECT_EQ(b->layout.world, 4);
  EXPECT_EQ(b->layout.shard_numel, ShardNumel(100, 4, 2));
  EXPECT_EQ(b->master, Dtype::kBF16);
  EXPECT_EQ(b->landing, nullptr) << "landing slots exist only in deterministic mode";
  const int64_t padded = b->layout.padded_numel();
  EXPECT_EQ(LiveHeapBytes() - bytes_before, padded * 2 + padded * 4) << "bf16 shards + fp32 accumulators";
  for (int32_t d = 0; d < 4; ++d) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->shard(d)) % kShardAlignBytes, 0u) << "shard " << d;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->accumulator(d)) % kShardAlignBytes, 0u) << "accumulator " << d;
    const uint16_t* s = static_cast<const uint16_t*>(b->shard(d));
    for (int64_t i = 0; i < b->layout.shard_numel; ++i) {
      ASSERT_EQ(s[i], 0) << "shard " << d << " not zero-initialised at " << i;
      ASSERT_EQ(b->accumulator(d)[i], 0.0f) << "accumulator " << d << " not zero-initialised at " << i;
    }
  }
  b.reset();
  ASSERT_TRUE(FreeB(heap_id, bucket_id, &err)) << err;
  EXPECT_EQ(LiveHeapBytes(), bytes_before) << "freeing the bucket must release its memory";
  err.clear();
  EXPECT_FALSE(FreeB(heap_id, bucket_id, &err));
  EXPECT_TRUE(Contains(err, "bucket " + std::to_string(bucket_id) + " is not registered in heap")) << err;
  err.clear();
  EXPECT_EQ(FindB(heap, bucket_id, &err), nullptr);
  EXPECT_TRUE(Contains(err, "(freed?)")) << err;
  ASSERT_TRUE(Free(heap_id, &err)) << err;
}

TEST(Heap, DeterministicBucketHasLandingSlots) {
  std::string err;
  const int64_t heap_id = Create(3, /*deterministic=*/true, 5.0, &err);
  const int64_t bytes_before = LiveHeapBytes();
  const int64_t bucket_id = Register(heap_id, 40, Dtype::kF32, &err);
  ASSERT_GT(bucket_id, 0) << err;
  auto b = FindB(Find(heap_id, &err), bucket_id, &err);
  ASSERT_NE(b, nullptr) << err;
  ASSERT_NE(b->landing, nullptr);
  const int64_t padded = b->layout.padded_numel();
  EXPECT_EQ(LiveHeapBytes() - bytes_before, padded * 4 + padded * 4 + padded * 3 * 4);
  // Slots of (owner, source) pairs are disjoint, consecutive, shard-sized.
  for (int32_t o = 0; o < 3; ++o) {
    for (int32_t s = 0; s < 3; ++s) {
      EXPECT_EQ(b->landing_slot(o, s) - b->landing_slot(0, 0), (o * 3 + s) * b->layout.shard_numel);
    }
  }
  b.reset();
  ASSERT_TRUE(Free(heap_id, &err)) << err;
  EXPECT_EQ(LiveHeapBytes(), bytes_before) << "freeing the heap must release its buckets";
}

TEST(Heap, RegisterRejectsBadArguments) {
  std::string err;
  const int64_t heap_id = Create(2, false, 5.0, &err);
  EXPECT_EQ(Register(heap_id, 0, Dtype::kF32, &err), -1);
  EXPECT_TRUE(Contains(err, "bucket size must be >= 1 element, got 0")) << err;
  err.clear();
  EXPECT_EQ(Register(heap_id + 100000, 10, Dtype::kF32, &err), -1);
  EXPECT_TRUE(Contains(err, "is not registered")) << err;
  ASSERT_TRUE(Free(heap_id, &err)) << err;
}

// ---- refusals of sizes that overflow or cannot be allocated (issue 11 item 1) --------------------------------------
// heap.register((2**31, 2**31)) used to wrap its byte size to 0 and get 64-byte buffers that the next
// zero_accumulators() overran (exit 139). Now the registry refuses it, names the bytes, and allocates nothing.

std::string HeapName(int64_t heap_id) { return "heap " + std::to_string(heap_id); }

TEST(Heap, RegisterRefusesBucketsWhoseBytesOverflow) {
  std::string err;
  const int64_t heap_id = Create(4, /*deterministic=*/false, 5.0, &err);
  ASSERT_GT(heap_id, 0) << err;
  auto heap = Find(heap_id, &err);
  const int64_t bytes_before = LiveHeapBytes();
  const int64_t numel = (1LL << 31) * (1LL << 31);  // the (2**31, 2**31) bucket of the issue

  bool oom = true;
  EXPECT_EQ(Register(heap_id, numel, Dtype::kF32, &err, &oom), -1);
  // 2^62 elements * (4 master + 4 accumulator) bytes = 2^65 = 3.68935e+19 bytes.
  EXPECT_EQ(err, "a bucket of 4611686018427387904 float32 elements over 4 devices in " + HeapName(heap_id) +
                     " is too large: its memory (about 3.68935e+19 bytes) overflows 64-bit byte counts");
  EXPECT_FALSE(oom) << "an overflow is not an out-of-memory condition";
  err.clear();
  EXPECT_EQ(Register(heap_id, numel, Dtype::kBF16, &err), -1);
  EXPECT_EQ(err, "a bucket of 4611686018427387904 bfloat16 elements over 4 devices in " + HeapName(heap_id) +
                     " is too large: its memory (about 2.76701e+19 bytes) overflows 64-bit byte counts");
  err.clear();
  EXPECT_EQ(Register(heap_id, INT64_MAX, Dtype::kF32, &err), -1) << "shard rounding past INT64_MAX";
  EXPECT_TRUE(Contains(err, "a bucket of 9223372036854775807 float32 elements")) << err;
  EXPECT_TRUE(Contains(err, "overflows 64-bit byte counts")) << err;

  EXPECT_EQ(LiveHeapBytes(), bytes_before) << "a refused bucket must allocate nothing";
  EXPECT_TRUE(heap->buckets.empty()) << "a refused bucket must not be registered";
  EXPECT_TRUE(heap->poisoned.empty()) << "a refusal must leave the heap usable";
  err.clear();
  const int64_t ok = Register(heap_id, 100, Dtype::kF32, &err);
  EXPECT_GT(ok, 0) << "the heap still takes a bucket that fits: " << err;
  ASSERT_TRUE(Free(heap_id, &err)) << err;
  EXPECT_EQ(LiveHeapBytes(), bytes_before);
}

TEST(Heap, RegisterRefusesLandingSlotsThatOverflow) {
  // 2^57 fp32 elements over 16 devices fit in 2^60 bytes, but deterministic landing slots (16 fp32 shards per
  // owner) take the total past 2^63.
  std::string err;
  const int64_t heap_id = Create(16, /*deterministic=*/true, 5.0, &err);
  ASSERT_GT(heap_id, 0) << err;
  const int64_t bytes_before = LiveHeapBytes();
  bool oom = true;
  EXPECT_EQ(Register(heap_id, 1LL << 57, Dtype::kF32, &err, &oom), -1);
  EXPECT_EQ(err, "a bucket of 144115188075855872 float32 elements over 16 devices in " + HeapName(heap_id) +
                     " is too large: its memory (about 1.03763e+19 bytes) overflows 64-bit byte counts");
  EXPECT_FALSE(oom);
  EXPECT_EQ(LiveHeapBytes(), bytes_before);
  ASSERT_TRUE(Free(heap_id, &err)) << err;
}

TEST(Heap, RegisterRefusesWhatHostMemoryCannotHold) {
  // 2^40 fp32 elements on one device: 8 TiB, which fits int64 but not this machine.
  const int64_t need = (1LL << 40) * 8;
  if (AvailableHostBytes() >= need) GTEST_SKIP() << "this machine has " << AvailableHostBytes() << " bytes";
  std::string err;
  const int64_t heap_id = Create(1, /*deterministic=*/false, 5.0, &err);
  ASSERT_GT(heap_id, 0) << err;
  auto heap = Find(heap_id, &err);
  const int64_t bytes_before = LiveHeapBytes();
  bool oom = false;
  EXPECT_EQ(Register(heap_id, 1LL << 40, Dtype::kF32, &err, &oom), -1);
  EXPECT_TRUE(oom) << "the bindings raise MemoryError on this flag";
  const std::string head = "out of host memory: a bucket of 1099511627776 float32 elements over 1 devices in " +
                           HeapName(heap_id) + " needs 8796093022208 bytes, only ";
  EXPECT_EQ(err.substr(0, head.size()), head) << err;
  EXPECT_TRUE(Contains(err, " are available")) << err;
  EXPECT_EQ(LiveHeapBytes(), bytes_before) << "refused before allocating anything";
  EXPECT_TRUE(heap->buckets.empty());
  ASSERT_TRUE(Free(heap_id, &err)) << err;
}

TEST(Heap, AlignedBufferRefusesImpossibleSizes) {
  const int64_t bytes_before = LiveHeapBytes();
  EXPECT_THROW(AlignedBuffer(INT64_MAX), std::bad_alloc) << "rounding up to 64 bytes overflows";
  EXPECT_THROW(AlignedBuffer(INT64_MAX - 62), std::bad_alloc);
  EXPECT_THROW(AlignedBuffer(-1), std::bad_alloc) << "a negative size (a wrapped product) is refused";
  EXPECT_THROW(AlignedBuffer(INT64_MAX - 63), std::bad_alloc) << "8 EiB cannot be allocated";
  EXPECT_EQ(LiveHeapBytes(), bytes_before) << "a failed allocation must not count as live";
  {
    AlignedBuffer zero(0);  // still a valid 64-byte aligned pointer, counted as 0 bytes
    EXPECT_NE(zero.data(), nullptr);
    EXPECT_EQ(LiveHeapBytes(), bytes_before);
  }
}

TEST(Heap, BarrierTimeoutsAtTheEdges) {
  std::string err;
  const double inf = std::numeric_limits<double>::infinity();
  for (double ok : {inf, 1e12, 1e10, 1e-12, std::numeric_limits<double>::denorm_min()}) {
    EXPECT_TRUE(TimeoutOk(ok, &err)) << ok << ": " << err;
  }
  const int64_t heap_id = Create(2, false, inf, &err);
  ASSERT_GT(heap_id, 0) << "inf means wait forever: " << err;
  EXPECT_EQ(Find(heap_id, &err)->barrier_timeout_s.load(), inf);
  ASSERT_TRUE(Free(heap_id, &err)) << err;
  for (double bad : {std::nan(""), 0.0, -0.0, -1.0, -inf}) {
    err.clear();
    EXPECT_FALSE(TimeoutOk(bad, &err)) << bad;
    EXPECT_TRUE(Contains(err, "barrier timeout must be > 0 seconds (or inf to wait forever), got ")) << err;
    err.clear();
    EXPECT_EQ(Create(2, false, bad, &err), -1) << bad;
    EXPECT_FALSE(err.empty());
  }
}

TEST(Heap, ResolveTargetErrorsNameTheOp) {
  std::string err;
  const int64_t heap_id = Create(2, false, 5.0, &err);
  const int64_t bucket_id = Register(heap_id, 10, Dtype::kF32, &err);
  OpTarget t;
  EXPECT_TRUE(Resolve("gather", heap_id, bucket_id, 1, &t, &err)) << err;
  EXPECT_NE(t.bucket, nullptr);
  OpTarget heap_only;
  EXPECT_TRUE(Resolve("barrier", heap_id, -1, 0, &heap_only, &err)) << err;
  EXPECT_EQ(heap_only.bucket, nullptr);

  err.clear();
  OpTarget bad;
  EXPECT_FALSE(Resolve("gather", heap_id, bucket_id, 2, &bad, &err));
  EXPECT_EQ(err, "jodc gather: device index 2 outside [0, 2) of heap " + std::to_string(heap_id));
  err.clear();
  EXPECT_FALSE(Resolve("publish", heap_id, bucket_id, -1, &bad, &err));
  EXPECT_TRUE(Contains(err, "jodc publish: device index -1 outside")) << err;
  err.clear();
  EXPECT_FALSE(Resolve("scatter_accumulate", heap_id, bucket_id + 1000, 0, &bad, &err));
  EXPECT_TRUE(Contains(err, "jodc scatter_accumulate: bucket ")) << err;
  err.clear();
  auto heap = Find(heap_id, &err);
  heap->poisoned = "barrier timed out";
  EXPECT_FALSE(Resolve("gather", heap_id, bucket_id, 0, &bad, &err));
  EXPECT_EQ(err, "jodc gather: barrier timed out") << "a poisoned heap must fail every later op";
  heap->poisoned.clear();
  ASSERT_TRUE(Free(heap_id, &err)) << err;
  err.clear();
  EXPECT_FALSE(Resolve("gather", heap_id, bucket_id, 0, &bad, &err));
  EXPECT_TRUE(Contains(err, "jodc gather: heap " + std::to_string(heap_id) + " is not registered")) << err;
}

TEST(Dtype, NamesAndSizes) {
  Dtype d;
  EXPECT_TRUE(ParseDtype("float32", &d));
  EXPECT_EQ(d, Dtype::kF32);
  EXPECT_TRUE(ParseDtype("bfloat16", &d));
  EXPECT_EQ(d, Dtype::kBF16);
  EXPECT_FALSE(ParseDtype("float16", &d));
  EXPECT_EQ(DtypeBytes(Dtype::kF32), 4);
  EXPECT_EQ(DtypeBytes(Dtype::kBF16), 2);
  EXPECT_STREQ(DtypeName(Dtype::kBF16), "bfloat16");
}

}  // namespace
}  // namespace jodc::cpu
