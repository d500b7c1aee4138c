// Layout math of ffi/common/layout.h (shard sizes, padding, alignment, owner ranges), checked against a plain
// reference written from the documented rules rather than from the implementation's formula.
#include "common/layout.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace jodc {
namespace {

// Reference: the smallest count >= ceil(numel / world) (and >= 1) whose master shard and fp32 accumulator shard
// are both whole multiples of kShardAlignBytes, found by counting up.
int64_t ReferenceShardNumel(int64_t numel, int32_t world, int32_t master_bytes) {
  const int64_t need = numel / world + (numel % world != 0 ? 1 : 0);
  for (int64_t n = need;; ++n) {
    if ((n * master_bytes) % kShardAlignBytes == 0 && (n * 4) % kShardAlignBytes == 0) return n;
  }
}

TEST(ShardNumel, KnownValues) {
  // fp32: 16 elements per 64 bytes; bf16: 32 (its master shard is the narrower one).
  EXPECT_EQ(ShardNumel(1, 1, 4), 16);
  EXPECT_EQ(ShardNumel(16, 1, 4), 16);
  EXPECT_EQ(ShardNumel(17, 1, 4), 32);
  EXPECT_EQ(ShardNumel(100, 4, 4), 32);   // ceil(100/4) = 25 -> 32
  EXPECT_EQ(ShardNumel(100, 4, 2), 32);   // bf16 quantum 32
  EXPECT_EQ(ShardNumel(1000, 3, 2), 352); // ceil(1000/3) = 334 -> 11 * 32
  EXPECT_EQ(ShardNumel(1000, 3, 4), 336); // 334 -> 21 * 16
  EXPECT_EQ(ShardNumel(0, 4, 4), -1);     // an empty bucket is refused (RegisterBucket and layout.py refuse it too)
}

TEST(ShardNumel, MatchesReferenceAndAlignment) {
  for (int32_t master_bytes : {2, 4}) {
    for (int32_t world = 1; world <= 9; ++world) {
      for (int64_t numel = 1; numel <= 1200; ++numel) {
        const int64_t got = ShardNumel(numel, world, master_bytes);
        ASSERT_EQ(got, ReferenceShardNumel(numel, world, master_bytes))
            << "numel=" << numel << " world=" << world << " master_bytes=" << master_bytes;
        ASSERT_GE(got * world, numel) << "shards do not cover the bucket: numel=" << numel << " world=" << world;
        ASSERT_EQ(got * master_bytes % kShardAlignBytes, 0) << "master shard not 64-byte aligned, numel=" << numel;
        ASSERT_EQ(got * 4 % kShardAlignBytes, 0) << "fp32 accumulator shard not 64-byte aligned, numel=" << numel;
      }
    }
  }
}

TEST(ShardNumel, LargeBuckets) {
  // A 7B-parameter bucket over 8 devices: no overflow of the int64 arithmetic, exact ceil division.
  const int64_t numel = 7'000'000'007LL;
  EXPECT_EQ(ShardNumel(numel, 8, 2), ReferenceShardNumel(numel, 8, 2));
  EXPECT_EQ(ShardNumel(numel, 8, 4), ReferenceShardNumel(numel, 8, 4));
}

TEST(MakeLayout, FieldsAndPadding) {
  const BucketLayout l = MakeLayout(100, 4, 2);
  EXPECT_EQ(l.numel, 100);
  EXPECT_EQ(l.world, 4);
  EXPECT_EQ(l.master_bytes, 2);
  EXPECT_EQ(l.shard_numel, 32);
  EXPECT_EQ(l.padded_numel(), 128);
}

TEST(MakeLayout, OwnerRangesTileTheBucket) {
  for (int32_t master_bytes : {2, 4}) {
    for (int32_t world = 1; world <= 9; ++world) {
      for (int64_t numel = 1; numel <= 700; ++numel) {
        const BucketLayout l = MakeLayout(numel, world, master_bytes);
        int64_t next = 0, total = 0;
        for (int32_t owner = 0; owner < world; ++owner) {
          // Owner o holds [o * shard, (o + 1) * shard) clipped to the real elements; later owners may hold none.
          const int64_t want_begin = std::min<int64_t>(owner * l.shard_numel, numel);
          const int64_t want_end = std::min<int64_t>((owner + 1) * l.shard_numel, numel);
          ASSERT_EQ(l.begin(owner), want_begin) << "numel=" << numel << " world=" << world << " owner=" << owner;
          ASSERT_EQ(l.end(owner), want_end) << "numel=" << numel << " world=" << world << " owner=" << owner;
          ASSERT_EQ(l.begin(owner), next) << "gap or overlap before owner " << owner << ", numel=" << numel;
          ASSERT_GE(l.valid(owner), 0);
          ASSERT_LE(l.valid(owner), l.shard_numel);
          next = l.end(owner);
          total += l.valid(owner);
        }
        ASSERT_EQ(next, numel) << "owner ranges stop short: numel=" << numel << " world=" << world;
        ASSERT_EQ(total, numel);
      }
    }
  }
}

TEST(MakeLayout, PaddingOnlyOwners) {
  // 10 fp32 elements over 4 devices: one 16-element shard holds them all, owners 1..3 hold only padding.
  const BucketLayout l = MakeLayout(10, 4, 4);
  EXPECT_EQ(l.shard_numel, 16);
  EXPECT_EQ(l.valid(0), 10);
  for (int32_t owner = 1; owner < 4; ++owner) {
    EXPECT_EQ(l.begin(owner), 10) << "owner " << owner;
    EXPECT_EQ(l.valid(owner), 0) << "owner " << owner;
  }
}

}  // namespace
}  // namespace jodc
