// The overflow checks of ffi/common/layout.h at and around their edges: every checked function refuses exactly the
// first value that does not fit int64 (and leaves its output untouched), a bucket's byte counts never wrap round to
// a small allocation (issue 11 item 1: a (2**31, 2**31) bucket used to become a 64-byte buffer), the barrier timeout
// conversion saturates instead of overflowing (issue 11 item 3), and the results agree with the Python mirror
// jodc/ops/layout.py on fixed cases.
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/layout.h"
#include "gtest/gtest.h"

namespace jodc {
namespace {

constexpr int64_t kMax = INT64_MAX;
constexpr int64_t kSentinel = -12345;  // what an output holds before a call that must leave it untouched

// ---- CheckedAdd / CheckedMul / CheckedRoundUp ---------------------------------------------------------------------

TEST(CheckedAdd, EdgesOfInt64) {
  int64_t out = kSentinel;
  ASSERT_TRUE(CheckedAdd(kMax, 0, &out));
  EXPECT_EQ(out, kMax);
  ASSERT_TRUE(CheckedAdd(kMax - 1, 1, &out));
  EXPECT_EQ(out, kMax);
  ASSERT_TRUE(CheckedAdd(0, kMax, &out));
  EXPECT_EQ(out, kMax);
  ASSERT_TRUE(CheckedAdd(0, 0, &out));
  EXPECT_EQ(out, 0);

  out = kSentinel;
  EXPECT_FALSE(CheckedAdd(kMax, 1, &out));
  EXPECT_FALSE(CheckedAdd(1, kMax, &out));
  EXPECT_FALSE(CheckedAdd(kMax, kMax, &out));
  EXPECT_FALSE(CheckedAdd(kMax / 2 + 1, kMax / 2 + 1, &out));  // 2^63: one past the edge
  EXPECT_FALSE(CheckedAdd(-1, 0, &out)) << "sizes are never negative";
  EXPECT_FALSE(CheckedAdd(0, -1, &out));
  EXPECT_FALSE(CheckedAdd(INT64_MIN, kMax, &out));
  EXPECT_EQ(out, kSentinel) << "a refused sum must not write its output";
}

TEST(CheckedMul, EdgesOfInt64) {
  int64_t out = kSentinel;
  ASSERT_TRUE(CheckedMul(0, kMax, &out));
  EXPECT_EQ(out, 0);
  ASSERT_TRUE(CheckedMul(kMax, 0, &out));
  EXPECT_EQ(out, 0);
  ASSERT_TRUE(CheckedMul(kMax, 1, &out));
  EXPECT_EQ(out, kMax);
  ASSERT_TRUE(CheckedMul(kMax / 2, 2, &out));
  EXPECT_EQ(out, kMax - 1);
  ASSERT_TRUE(CheckedMul(1LL << 31, (1LL << 32) - 1, &out));
  EXPECT_EQ(out, kMax - (1LL << 31) + 1);  // 2^63 - 2^31
  ASSERT_TRUE(CheckedMul(3037000499LL, 3037000499LL, &out));  // floor(sqrt(INT64_MAX))^2
  EXPECT_EQ(out, 9223372030926249001LL);

  out = kSentinel;
  EXPECT_FALSE(CheckedMul(1LL << 31, 1LL << 32, &out)) << "2^63 is one past INT64_MAX";
  EXPECT_FALSE(CheckedMul(1LL << 32, 1LL << 31, &out));
  EXPECT_FALSE(CheckedMul(3037000500LL, 3037000500LL, &out));
  EXPECT_FALSE(CheckedMul(kMax / 2 + 1, 2, &out));
  EXPECT_FALSE(CheckedMul(2, kMax / 2 + 1, &out));
  EXPECT_FALSE(CheckedMul(kMax, kMax, &out));
  EXPECT_FALSE(CheckedMul(1LL << 62, 4, &out)) << "(2**31 * 2**31) fp32 elements: 2^64 bytes wraps to 0";
  EXPECT_FALSE(CheckedMul(-1, 1, &out));
  EXPECT_FALSE(CheckedMul(1, -1, &out));
  EXPECT_FALSE(CheckedMul(-1, -1, &out)) << "a positive product of negatives is still not a size";
  EXPECT_EQ(out, kSentinel) << "a refused product must not write its output";
}

TEST(CheckedRoundUp, EdgesOfInt64) {
  int64_t out = kSentinel;
  ASSERT_TRUE(CheckedRoundUp(0, 64, &out));
  EXPECT_EQ(out, 0);
  ASSERT_TRUE(CheckedRoundUp(1, 64, &out));
  EXPECT_EQ(out, 64);
  ASSERT_TRUE(CheckedRoundUp(64, 64, &out));
  EXPECT_EQ(out, 64);
  ASSERT_TRUE(CheckedRoundUp(65, 64, &out));
  EXPECT_EQ(out, 128);
  ASSERT_TRUE(CheckedRoundUp(kMax, 1, &out));
  EXPECT_EQ(out, kMax);
  ASSERT_TRUE(CheckedRoundUp(kMax - 63, 64, &out)) << "2^63 - 64 is the largest multiple of 64 in int64";
  EXPECT_EQ(out, kMax - 63);
  ASSERT_TRUE(CheckedRoundUp(kMax - 126, 64, &out));  // 2^63 - 127 -> 2^63 - 64
  EXPECT_EQ(out, kMax - 63);

  out = kSentinel;
  EXPECT_FALSE(CheckedRoundUp(kMax - 62, 64, &out)) << "would round up to 2^63";
  EXPECT_FALSE(CheckedRoundUp(kMax, 64, &out));
  EXPECT_FALSE(CheckedRoundUp(kMax, 2, &out));
  EXPECT_FALSE(CheckedRoundUp(-1, 64, &out));
  EXPECT_FALSE(CheckedRoundUp(5, 0, &out));
  EXPECT_FALSE(CheckedRoundUp(5, -64, &out));
  EXPECT_EQ(out, kSentinel) << "a refused rounding must not write its output";
}

// ---- ShardNumel ---------------------------------------------------------------------------------------------------

TEST(CheckedShardNumel, LargestBucketsThatFit) {
  int64_t out = kSentinel;
  // One device: the shard is the bucket rounded up to the quantum (16 fp32 / 32 bf16 elements).
  ASSERT_TRUE(CheckedShardNumel(kMax - 15, 1, 4, &out));
  EXPECT_EQ(out, kMax - 15);
  ASSERT_TRUE(CheckedShardNumel(kMax - 31, 1, 2, &out));
  EXPECT_EQ(out, kMax - 31);
  // INT64_MAX elements over two devices: ceil must not compute numel + world - 1 (which would overflow).
  ASSERT_TRUE(CheckedShardNumel(kMax, 2, 4, &out));
  EXPECT_EQ(out, 1LL << 62);
  // Over the largest world an int32 holds.
  ASSERT_TRUE(CheckedShardNumel(kMax, INT32_MAX, 2, &out));
  EXPECT_EQ(out, 4294967328LL);
}

TEST(CheckedShardNumel, RefusesRoundingPastInt64) {
  int64_t out = kSentinel;
  EXPECT_FALSE(CheckedShardNumel(kMax - 14, 1, 4, &out)) << "rounds up to 2^63";
  EXPECT_FALSE(CheckedShardNumel(kMax, 1, 4, &out));
  EXPECT_FALSE(CheckedShardNumel(kMax - 30, 1, 2, &out));
  EXPECT_FALSE(CheckedShardNumel(kMax, 1, 2, &out));
  EXPECT_EQ(out, kSentinel);
  EXPECT_EQ(ShardNumel(kMax, 1, 4), -1) << "the unchecked form reports a refusal as -1";
  EXPECT_EQ(ShardNumel(kMax - 30, 1, 2), -1);
  EXPECT_EQ(MakeLayout(kMax, 1, 4).shard_numel, -1);
}

TEST(CheckedShardNumel, RefusesInvalidArguments) {
  int64_t out = kSentinel;
  EXPECT_FALSE(CheckedShardNumel(0, 4, 4, &out)) << "an empty bucket";
  EXPECT_FALSE(CheckedShardNumel(-1, 4, 4, &out));
  EXPECT_FALSE(CheckedShardNumel(INT64_MIN, 4, 4, &out));
  EXPECT_FALSE(CheckedShardNumel(100, 0, 4, &out));
  EXPECT_FALSE(CheckedShardNumel(100, -1, 4, &out));
  EXPECT_FALSE(CheckedShardNumel(100, INT32_MIN, 4, &out));
  for (int32_t bad : {0, 1, 3, 8, -2}) EXPECT_FALSE(CheckedShardNumel(100, 4, bad, &out)) << "master_bytes " << bad;
  EXPECT_EQ(out, kSentinel);
  EXPECT_EQ(ShardNumel(0, 4, 4), -1);
  EXPECT_EQ(ShardQuantum(4), 16);
  EXPECT_EQ(ShardQuantum(2), 32);
}

// ---- CheckedBucketBytes -------------------------------------------------------------------------------------------

BucketBytes MustBytes(int64_t numel, int32_t world, int32_t master_bytes, bool landing) {
  BucketBytes b;
  EXPECT_TRUE(CheckedBucketBytes(MakeLayout(numel, world, master_bytes), landing, &b))
      << "numel=" << numel << " world=" << world << " master_bytes=" << master_bytes << " landing=" << landing;
  return b;
}

bool Refused(int64_t numel, int32_t world, int32_t master_bytes, bool landing) {
  BucketBytes b;
  b.total = kSentinel;
  const bool ok = CheckedBucketBytes(MakeLayout(numel, world, master_bytes), landing, &b);
  EXPECT_EQ(b.total, ok ? b.total : kSentinel) << "a refused layout must not write its output";
  return !ok;
}

TEST(CheckedBucketBytes, SmallBucketsAddUp) {
  const BucketBytes b = MustBytes(100, 4, 2, /*landing=*/true);
  EXPECT_EQ(b.shard, 32 * 2);
  EXPECT_EQ(b.accumulator, 32 * 4);
  EXPECT_EQ(b.landing, 32 * 4 * 4);
  EXPECT_EQ(b.per_device, b.shard + b.accumulator + b.landing);
  EXPECT_EQ(b.total, b.per_device * 4);
  EXPECT_EQ(MustBytes(100, 4, 2, /*landing=*/false).landing, 0);
}

TEST(CheckedBucketBytes, TheIssue11Bucket) {
  // heap.register((2**31, 2**31)): 2^62 elements. fp32 on one device: 2^64 bytes per shard, which wrapped to 0.
  const int64_t numel = (1LL << 31) * (1LL << 31);
  EXPECT_TRUE(Refused(numel, 1, 4, false));
  EXPECT_TRUE(Refused(numel, 1, 2, false));
  EXPECT_TRUE(Refused(numel, 4, 4, false)) << "per device 2^62 + 2^62 bytes = 2^63";
  EXPECT_TRUE(Refused(numel, 4, 2, false)) << "per device fits (3 * 2^61) but the total over 4 devices does not";
  EXPECT_TRUE(Refused(numel, 1 << 20, 4, false)) << "the total is the same 2^65 bytes however it is sharded";
  EXPECT_TRUE(Refused(numel, 4, 4, true));
}

TEST(CheckedBucketBytes, EdgeOfTheTotal) {
  // fp32 on one device: 8 bytes per padded element, shards in 16s: 2^60 - 16 elements is the largest that fits.
  const BucketBytes b = MustBytes((1LL << 60) - 16, 1, 4, false);
  EXPECT_EQ(b.total, kMax - 127);
  EXPECT_EQ(b.shard, (kMax - 127) / 2);
  EXPECT_TRUE(Refused((1LL << 60) - 15, 1, 4, false)) << "pads to 2^60 elements: 2^63 bytes";
  EXPECT_TRUE(Refused(1LL << 60, 1, 4, false));
}

TEST(CheckedBucketBytes, WorldSizesThatMakePaddingOverflow) {
  // INT64_MAX - 15 elements fit one device's shard, but over 3 devices the padded vector (3 shards, each rounded
  // up) exceeds INT64_MAX, and so would every byte count.
  EXPECT_EQ(ShardNumel(kMax - 15, 3, 4), 3074457345618258608LL);
  EXPECT_TRUE(Refused(kMax - 15, 3, 4, false));
  // INT64_MAX elements over 2 devices: shards of 2^62, padded 2^63.
  EXPECT_TRUE(Refused(kMax, 2, 4, false));
  // Padded elements past INT64_MAX on a hand-made layout.
  BucketLayout l;
  l.numel = 1;
  l.world = 2;
  l.master_bytes = 2;
  l.shard_numel = (1LL << 62);  // 2 * 2^62 = 2^63 elements
  BucketBytes out;
  EXPECT_FALSE(CheckedBucketBytes(l, false, &out));
}

TEST(CheckedBucketBytes, LandingSlotsThatOverflow) {
  // 2^57 fp32 elements over 16 devices: 2^60 bytes without landing slots, past 2^63 with them (16 fp32 slots each).
  EXPECT_EQ(MustBytes(1LL << 57, 16, 4, false).total, 1LL << 60);
  EXPECT_TRUE(Refused(1LL << 57, 16, 4, true));
  // A landing-slot count that overflows on its own (accumulator bytes * world) on a hand-made layout. (Defence in
  // depth: landing > INT64_MAX implies total > INT64_MAX, so without the landing check the total check refuses it.)
  BucketLayout l;
  l.numel = 1;
  l.world = 1 << 30;
  l.master_bytes = 4;
  l.shard_numel = 1LL << 31;  // accumulator 2^33 bytes, landing 2^63
  BucketBytes out;
  EXPECT_FALSE(CheckedBucketBytes(l, true, &out));
}

TEST(CheckedBucketBytes, RoundingOfTheAllocationOverflows) {
  // MakeLayout's shards make every total a multiple of 64, so only a hand-made layout reaches this check: 6 bytes
  // per element (bf16 + fp32) times floor(INT64_MAX / 6) is 2^63 - 2, which fits int64 but whose 64-byte rounded
  // allocation size does not.
  BucketLayout l;
  l.numel = 1;
  l.world = 1;
  l.master_bytes = 2;
  l.shard_numel = kMax / 6;
  BucketBytes out;
  out.total = kSentinel;
  EXPECT_FALSE(CheckedBucketBytes(l, false, &out)) << "total " << l.shard_numel * 6 << " rounds past INT64_MAX";
  EXPECT_EQ(out.total, kSentinel);
  l.shard_numel = (kMax - 63) / 6 / 64 * 64;  // a multiple of 64 well inside: accepted
  EXPECT_TRUE(CheckedBucketBytes(l, false, &out));
  EXPECT_EQ(out.total, l.shard_numel * 6);
}

TEST(CheckedBucketBytes, RefusesInvalidLayouts) {
  BucketBytes out;
  EXPECT_FALSE(CheckedBucketBytes(MakeLayout(0, 4, 4), false, &out)) << "shard_numel -1 from a refused layout";
  EXPECT_FALSE(CheckedBucketBytes(MakeLayout(kMax, 1, 4), false, &out));
  BucketLayout l = MakeLayout(100, 4, 4);
  l.master_bytes = 3;
  EXPECT_FALSE(CheckedBucketBytes(l, false, &out));
  l = MakeLayout(100, 4, 4);
  l.world = 0;
  EXPECT_FALSE(CheckedBucketBytes(l, false, &out));
}

TEST(BucketLayout, OwnerRangesOfALargeBucketDoNotOverflow) {
  // The largest bf16 bucket over 8 devices whose bytes fit: owner ranges still tile it exactly.
  const int64_t numel = (1LL << 60) - 8;
  const BucketLayout l = MakeLayout(numel, 8, 2);
  BucketBytes b;
  ASSERT_TRUE(CheckedBucketBytes(l, false, &b));
  int64_t next = 0;
  for (int32_t o = 0; o < 8; ++o) {
    ASSERT_EQ(l.begin(o), next) << "owner " << o;
    next = l.end(o);
  }
  EXPECT_EQ(next, numel);
  EXPECT_GE(l.padded_numel(), numel);
}

// ---- agreement with jodc/ops/layout.py ----------------------------------------------------------------------------
// Values computed once with the worktree venv (Python 3.11) by loading jodc/ops/layout.py and calling
// shard_numel(numel, world, master_bytes), bucket_bytes(numel, world, master_bytes, landing_slots) and
// timeout_nanos(seconds); -1 / "refused" where the Python function raised ValueError.

TEST(PythonMirror, ShardNumel) {
  struct Case { int64_t numel; int32_t world, master_bytes; int64_t python; };
  const Case cases[] = {
      {1, 1, 4, 16},
      {100, 4, 2, 32},
      {1000, 3, 2, 352},
      {7'000'000'007LL, 8, 2, 875000032LL},
      {1LL << 62, 4, 2, 1152921504606846976LL},
      {kMax - 15, 1, 4, 9223372036854775792LL},
      {kMax - 31, 1, 2, 9223372036854775776LL},
      {kMax, 2, 4, 4611686018427387904LL},
      {kMax, INT32_MAX, 2, 4294967328LL},
      {kMax - 15, 3, 4, 3074457345618258608LL},
      {kMax - 14, 1, 4, -1},  // shard_numel raises: "... has shards of 9223372036854775808 elements"
      {0, 4, 4, -1},          // shard_numel raises: invalid layout
  };
  for (const Case& c : cases) {
    EXPECT_EQ(ShardNumel(c.numel, c.world, c.master_bytes), c.python)
        << "numel=" << c.numel << " world=" << c.world << " master_bytes=" << c.master_bytes;
  }
}

TEST(PythonMirror, BucketBytes) {
  struct Case { int64_t numel; int32_t world, master_bytes; bool landing; bool refused; BucketBytes python; };
  const Case cases[] = {
      {100, 4, 2, false, false, {64, 128, 0, 192, 768}},
      {100, 4, 2, true, false, {64, 128, 512, 704, 2816}},
      {40, 3, 4, true, false, {64, 64, 192, 320, 960}},
      {(1LL << 60) - 16, 1, 4, false, false,
       {4611686018427387840LL, 4611686018427387840LL, 0, 9223372036854775680LL, 9223372036854775680LL}},
      {(1LL << 60) - 15, 1, 4, false, true, {}},  // "needs 9223372036854775808 bytes"
      {1LL << 62, 4, 4, false, true, {}},         // "needs 36893488147419103232 bytes"
      {1LL << 62, 4, 2, false, true, {}},         // "needs 27670116110564327424 bytes"
      {1LL << 62, 1, 4, false, true, {}},         // "needs 36893488147419103232 bytes"
      {kMax - 15, 3, 4, false, true, {}},         // "needs 73786976294838206592 bytes"
      {1LL << 57, 16, 4, true, true, {}},         // "needs 10376293541461622784 bytes"
  };
  for (const Case& c : cases) {
    BucketBytes b;
    const bool ok = CheckedBucketBytes(MakeLayout(c.numel, c.world, c.master_bytes), c.landing, &b);
    const std::string what = "numel=" + std::to_string(c.numel) + " world=" + std::to_string(c.world) +
                             " master_bytes=" + std::to_string(c.master_bytes) + " landing=" +
                             std::to_string(c.landing);
    ASSERT_EQ(ok, !c.refused) << what;
    if (!ok) continue;
    EXPECT_EQ(b.shard, c.python.shard) << what;
    EXPECT_EQ(b.accumulator, c.python.accumulator) << what;
    EXPECT_EQ(b.landing, c.python.landing) << what;
    EXPECT_EQ(b.per_device, c.python.per_device) << what;
    EXPECT_EQ(b.total, c.python.total) << what;
  }
}

TEST(PythonMirror, TimeoutNanos) {
  const double inf = std::numeric_limits<double>::infinity();
  struct Case { double seconds; int64_t python; };
  const Case cases[] = {
      {std::nan(""), -1}, {0.0, -1}, {-0.0, -1}, {-1.0, -1}, {-inf, -1},
      {inf, kMax}, {1e10, kMax}, {1e12, kMax}, {9.2e9, kMax},
      {9.1e9, 9100000000000000000LL}, {9.19e9, 9190000000000000000LL},
      {300.0, 300000000000LL}, {0.5, 500000000LL}, {123.456789, 123456789000LL},
      {1e-10, 1}, {5e-324, 1}, {1.5e-9, 1}, {1e-9, 1}, {2.5e-9, 2},
  };
  for (const Case& c : cases) EXPECT_EQ(TimeoutNanos(c.seconds), c.python) << "seconds=" << c.seconds;
}

// ---- barrier timeouts ---------------------------------------------------------------------------------------------

TEST(TimeoutNanos, SaturatesInsteadOfOverflowing) {
  // Everything from about 292 years on, and +inf, waits forever; nothing converts to a negative or wrapped value.
  for (double s : {9.2e9, 9.3e9, 1e10, 1e12, 1e300, std::numeric_limits<double>::max(),
                   std::numeric_limits<double>::infinity()}) {
    EXPECT_EQ(TimeoutNanos(s), kForeverNs) << "seconds=" << s;
  }
  // Just below the cut-off the conversion is exact enough and positive (not the wrapped value of a too-large cast).
  const int64_t just_below = TimeoutNanos(9.1999e9);
  EXPECT_GT(just_below, 9'199'800'000'000'000'000LL);
  EXPECT_LT(just_below, kForeverNs);
  // Tiny positive timeouts are at least 1 ns: never 0, which would be "no wait", or -1, which means invalid.
  EXPECT_EQ(TimeoutNanos(std::numeric_limits<double>::denorm_min()), 1);
  EXPECT_EQ(TimeoutNanos(std::numeric_limits<double>::min()), 1);
  EXPECT_EQ(TimeoutNanos(-std::numeric_limits<double>::infinity()), -1);
  EXPECT_EQ(TimeoutNanos(-std::numeric_limits<double>::denorm_min()), -1);
}

TEST(DeadlineNanos, SaturatesAtForever) {
  EXPECT_EQ(DeadlineNanos(100, 5), 105);
  EXPECT_EQ(DeadlineNanos(kMax - 5, 5), kMax);
  EXPECT_EQ(DeadlineNanos(kMax - 5, 6), kForeverNs) << "must saturate, not wrap to a deadline in the past";
  EXPECT_EQ(DeadlineNanos(kMax, 1), kForeverNs);
  EXPECT_EQ(DeadlineNanos(1, kMax - 1), kMax);
  EXPECT_EQ(DeadlineNanos(0, kForeverNs), kForeverNs);
  EXPECT_EQ(DeadlineNanos(123456789, kForeverNs), kForeverNs) << "forever stays forever whatever the clock reads";
  EXPECT_EQ(DeadlineNanos(-50, 5), 5) << "a negative clock reading counts as 0";
  // A steady clock a year in, with the timeouts of issue 11 item 3 (1e10 s, 1e12 s, inf): no deadline in the past.
  const int64_t now = 365LL * 24 * 3600 * 1'000'000'000LL;
  for (double s : {1e10, 1e12, std::numeric_limits<double>::infinity()}) {
    EXPECT_EQ(DeadlineNanos(now, TimeoutNanos(s)), kForeverNs) << "seconds=" << s;
  }
  EXPECT_EQ(DeadlineNanos(now, TimeoutNanos(1e9)), now + 1'000'000'000'000'000'000LL) << "1e9 s is honoured";
}

}  // namespace
}  // namespace jodc
