// The CPU handlers' core loops (ffi/cpu/kernels.h) on plain buffers: gather into fp32/bf16, scatter_accumulate into
// the owners' accumulators or the deterministic landing slots, and ReadAccumulator's fixed reduction order.
#include "cpu/kernels.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/bf16.h"
#include "cpu/heap.h"
#include "gtest/gtest.h"

namespace jodc::cpu {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// A heap with one bucket, freed at the end of the test.
class BucketFixture {
 public:
  BucketFixture(int32_t world, bool deterministic, int64_t numel, Dtype master) {
    auto heap_id = CreateHeap(world, deterministic, 5.0);
    if (!heap_id.has_value()) ADD_FAILURE() << heap_id.error().message();
    heap_id_ = heap_id.has_value() ? *heap_id : -1;
    auto bucket_id = RegisterBucket(heap_id_, numel, master);
    if (!bucket_id.has_value()) ADD_FAILURE() << bucket_id.error().message();
    auto heap = FindHeap(heap_id_);
    if (heap.has_value() && bucket_id.has_value()) {
      auto bucket = FindBucket(*heap, *bucket_id);
      if (bucket.has_value()) bucket_ = *bucket;
    }
    EXPECT_NE(bucket_, nullptr);
  }
  ~BucketFixture() {
    bucket_.reset();
    Error freed = FreeHeap(heap_id_);
    EXPECT_TRUE(freed.success()) << freed.message();
  }
  const Bucket& b() const { return *bucket_; }

 private:
  int64_t heap_id_ = -1;
  std::shared_ptr<Bucket> bucket_;
};

// Value of element j of the full bucket vector in these tests: distinct, exactly representable in bf16.
float Value(int64_t j) { return static_cast<float>((j % 97) - 40) * 0.5f; }

// Fills every owner's valid slice of the master shards with Value(global index); padding gets a marker.
void FillShards(const Bucket& b, float padding_marker) {
  for (int32_t o = 0; o < b.layout.world; ++o) {
    for (int64_t i = 0; i < b.layout.shard_numel; ++i) {
      const int64_t j = b.layout.begin(o) + i;
      const float v = i < b.layout.valid(o) ? Value(j) : padding_marker;
      if (b.master == Dtype::kF32) {
        static_cast<float*>(b.shard(o))[i] = v;
      } else {
        static_cast<uint16_t*>(b.shard(o))[i] = F32ToBf16(v);
      }
    }
  }
}

TEST(CopyConvert, AllDirections) {
  const std::vector<float> f = {1.0f, -2.5f, 1.00390625f /* 1 + 2^-8: a tie */, 3.14159f, 0.0f};
  std::vector<uint16_t> h(f.size());
  CopyConvert(h.data(), Dtype::kBF16, f.data(), Dtype::kF32, f.size());
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(h[i], F32ToBf16(f[i])) << "element " << i;
  std::vector<float> back(f.size());
  CopyConvert(back.data(), Dtype::kF32, h.data(), Dtype::kBF16, h.size());
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(Bits(back[i]), Bits(Bf16ToF32(h[i]))) << "element " << i;
  std::vector<float> same(f.size());
  CopyConvert(same.data(), Dtype::kF32, f.data(), Dtype::kF32, f.size());
  EXPECT_EQ(same, f);
}

TEST(AccumulateF32, Fp32AndBf16Sources) {
  std::vector<float> acc = {1.0f, 2.0f, 3.0f};
  const std::vector<float> g = {0.5f, -2.0f, 10.0f};
  AccumulateF32(acc.data(), g.data(), Dtype::kF32, 3);
  EXPECT_EQ(acc, (std::vector<float>{1.5f, 0.0f, 13.0f}));
  const std::vector<uint16_t> h = {F32ToBf16(1.0f), F32ToBf16(-0.25f), F32ToBf16(4.0f)};
  AccumulateF32(acc.data(), h.data(), Dtype::kBF16, 3);
  EXPECT_EQ(acc, (std::vector<float>{2.5f, -0.25f, 17.0f}));
}

TEST(GatherBucket, EveryDeviceGetsTheWholeVector) {
  for (Dtype master : {Dtype::kF32, Dtype::kBF16}) {
    for (Dtype out_t : {Dtype::kF32, Dtype::kBF16}) {
      for (int64_t numel : {1, 10, 50, 333}) {
        const int32_t world = 3;
        BucketFixture fx(world, false, numel, master);
        FillShards(fx.b(), 12345.0f);
        for (int32_t d = 0; d < world; ++d) {
          // One element past the end is a guard: padding must never be written into the output.
          std::vector<char> out((numel + 1) * DtypeBytes(out_t), 0x5a);
          GatherBucket(fx.b(), d, out.data(), out_t);
          for (int64_t j = 0; j < numel; ++j) {
            const float got = out_t == Dtype::kF32 ? reinterpret_cast<float*>(out.data())[j]
                                                   : Bf16ToF32(reinterpret_cast<uint16_t*>(out.data())[j]);
            ASSERT_EQ(got, Value(j)) << "device " << d << " element " << j << " numel " << numel;
          }
          for (int32_t k = 0; k < DtypeBytes(out_t); ++k)
            ASSERT_EQ(out[numel * DtypeBytes(out_t) + k], 0x5a) << "gather wrote past the bucket's end";
        }
      }
    }
  }
}

TEST(GatherBucket, OwnersHoldingOnlyPadding) {
  BucketFixture fx(4, false, 10, Dtype::kF32);  // one 16-element shard holds all 10 elements
  FillShards(fx.b(), -1.0f);
  std::vector<float> out(10, 0.0f);
  GatherBucket(fx.b(), 3, out.data(), Dtype::kF32);
  for (int64_t j = 0; j < 10; ++j) EXPECT_EQ(out[j], Value(j)) << "element " << j;
}

// Full-size gradient pushed by device d: element j gets (d + 1) * 8 + j % 7 (small integers, exact in bf16 too,
// so every sum is exact whatever the order).
std::vector<float> Grad(int32_t d, int64_t numel) {
  std::vector<float> g(numel);
  for (int64_t j = 0; j < numel; ++j) g[j] = static_cast<float>((d + 1) * 8 + j % 7);
  return g;
}

void ExpectSums(const Bucket& b, bool deterministic, int32_t world) {
  for (int32_t o = 0; o < world; ++o) {
    std::vector<float> acc(b.layout.shard_numel, -1.0f);
    ReadAccumulator(b, o, deterministic, acc.data());
    for (int64_t i = 0; i < b.layout.shard_numel; ++i) {
      float want = 0.0f;
      if (i < b.layout.valid(o)) {
        for (int32_t d = 0; d < world; ++d) want += Grad(d, b.layout.numel)[b.layout.begin(o) + i];
      }
      ASSERT_EQ(acc[i], want) << "owner " << o << " element " << i << (i >= b.layout.valid(o) ? " (padding)" : "");
    }
  }
}

TEST(ScatterAccumulateBucket, SumsEveryPushIntoTheOwners) {
  for (bool deterministic : {false, true}) {
    for (Dtype grad_t : {Dtype::kF32, Dtype::kBF16}) {
      const int32_t world = 3;
      const int64_t numel = 70;
      BucketFixture fx(world, deterministic, numel, Dtype::kF32);
      for (int32_t d = 0; d < world; ++d) {
        const std::vector<float> g = Grad(d, numel);
        if (grad_t == Dtype::kF32) {
          ScatterAccumulateBucket(fx.b(), d, deterministic, g.data(), grad_t);
        } else {
          std::vector<uint16_t> h(numel);
          CopyConvert(h.data(), Dtype::kBF16, g.data(), Dtype::kF32, numel);
          ScatterAccumulateBucket(fx.b(), d, deterministic, h.data(), grad_t);
        }
      }
      SCOPED_TRACE(deterministic ? "deterministic" : "locked accumulators");
      ExpectSums(fx.b(), deterministic, world);
      if (deterministic) {
        // Pushes land in the pusher's own slot; the shared accumulator is untouched until read.
        for (int32_t o = 0; o < world; ++o) EXPECT_EQ(fx.b().accumulator(o)[0], 0.0f);
        EXPECT_EQ(fx.b().landing_slot(1, 2)[0], Grad(2, numel)[fx.b().layout.begin(1)]);
      }
      for (int32_t o = 0; o < world; ++o) ZeroAccumulator(fx.b(), o, deterministic);
      for (int32_t o = 0; o < world; ++o) {
        std::vector<float> acc(fx.b().layout.shard_numel, -1.0f);
        ReadAccumulator(fx.b(), o, deterministic, acc.data());
        for (float v : acc) ASSERT_EQ(v, 0.0f) << "ZeroAccumulator left a value at owner " << o;
      }
    }
  }
}

TEST(ScatterAccumulateBucket, ConcurrentPushesLoseNothing) {
  for (bool deterministic : {false, true}) {
    const int32_t world = 4;
    const int64_t numel = 4096;
    BucketFixture fx(world, deterministic, numel, Dtype::kF32);
    const int rounds = 50;
    std::vector<std::thread> threads;
    for (int32_t d = 0; d < world; ++d) {
      threads.emplace_back([&, d] {
        const std::vector<float> g = Grad(d, numel);
        for (int r = 0; r < rounds; ++r) ScatterAccumulateBucket(fx.b(), d, deterministic, g.data(), Dtype::kF32);
      });
    }
    for (auto& t : threads) t.join();
    for (int32_t o = 0; o < world; ++o) {
      std::vector<float> acc(fx.b().layout.shard_numel);
      ReadAccumulator(fx.b(), o, deterministic, acc.data());
      for (int64_t i = 0; i < fx.b().layout.valid(o); ++i) {
        float want = 0.0f;
        for (int32_t d = 0; d < world; ++d) want += rounds * Grad(d, numel)[fx.b().layout.begin(o) + i];
        ASSERT_EQ(acc[i], want) << (deterministic ? "deterministic" : "locked") << " owner " << o << " element "
                                << i << ": a concurrent push was lost";
      }
    }
  }
}

TEST(ReadAccumulator, DeterministicModeSumsInSourceOrder) {
  // fp32 addition is not associative: 1e8 + 1 == 1e8, so (1 + 1e8) - 1e8 == 0 but (1e8 - 1e8) + 1 == 1. The result
  // must be ((acc + s0) + s1) + s2 whatever order the pushes arrived in.
  const int32_t world = 3;
  const int64_t numel = 3;
  const float push[3] = {1.0f, 1e8f, -1e8f};  // device d pushes push[d] to every element
  float want = 0.0f;
  for (int32_t s = 0; s < world; ++s) want += push[s];
  for (const std::vector<int32_t>& arrival : {std::vector<int32_t>{0, 1, 2}, {2, 1, 0}, {1, 2, 0}}) {
    BucketFixture fx(world, true, numel, Dtype::kF32);
    for (int32_t d : arrival) {
      const std::vector<float> g(numel, push[d]);
      ScatterAccumulateBucket(fx.b(), d, true, g.data(), Dtype::kF32);
    }
    std::vector<float> acc(fx.b().layout.shard_numel);
    ReadAccumulator(fx.b(), 0, true, acc.data());
    EXPECT_EQ(Bits(acc[0]), Bits(want)) << "arrival order " << arrival[0] << arrival[1] << arrival[2] << " gave "
                                        << acc[0] << ", source order gives " << want;
  }
  // And the host-set base in the accumulator comes first.
  BucketFixture fx(world, true, numel, Dtype::kF32);
  fx.b().accumulator(0)[0] = 1.0f;
  for (int32_t d = 0; d < world; ++d) {
    const std::vector<float> g(numel, push[d]);
    ScatterAccumulateBucket(fx.b(), d, true, g.data(), Dtype::kF32);
  }
  std::vector<float> acc(fx.b().layout.shard_numel);
  ReadAccumulator(fx.b(), 0, true, acc.data());
  EXPECT_EQ(Bits(acc[0]), Bits(((1.0f + push[0]) + push[1]) + push[2]));
}

}  // namespace
}  // namespace jodc::cpu
