// Layout of one bucket in the symmetric heap: how a flat vector of `numel` elements is split into one padded shard
// per device. Shared by the CPU and CUDA sides so the CPU tests exercise the same arithmetic the kernels use.
#ifndef JODC_FFI_COMMON_LAYOUT_H_
#define JODC_FFI_COMMON_LAYOUT_H_

#include <cstdint>

#if defined(__CUDACC__)
#define JODC_HD __host__ __device__
#else
#define JODC_HD
#endif

namespace jodc {

// Every shard (master and accumulator) starts on a 64-byte boundary.
constexpr int64_t kShardAlignBytes = 64;

struct BucketLayout {
  int64_t numel = 0;        // real elements of the bucket (the unpadded flat parameter vector)
  int32_t world = 0;        // devices sharing the bucket
  int64_t shard_numel = 0;  // elements per shard, padded; shard_numel * world >= numel
  int32_t master_bytes = 0; // bytes per master element (4: fp32, 2: bf16); accumulators are always fp32

  JODC_HD int64_t padded_numel() const { return shard_numel * world; }
  // [begin, end) of owner's slice within the unpadded vector; empty for owners that hold only padding.
  JODC_HD int64_t begin(int32_t owner) const {
    int64_t b = shard_numel * owner;
    return b < numel ? b : numel;
  }
  JODC_HD int64_t end(int32_t owner) const {
    int64_t e = shard_numel * (owner + 1);
    return e < numel ? e : numel;
  }
  JODC_HD int64_t valid(int32_t owner) const { return end(owner) - begin(owner); }
};

// Shard size: ceil(numel / world) rounded up so that both the master shard and the fp32 accumulator shard are a
// multiple of 64 bytes (then consecutive shards in one allocation all start aligned).
JODC_HD inline int64_t ShardNumel(int64_t numel, int32_t world, int32_t master_bytes) {
  int64_t per = (numel + world - 1) / world;
  int64_t smallest = master_bytes < 4 ? master_bytes : 4;
  int64_t quantum = kShardAlignBytes / smallest;  // elements per 64 bytes of the narrower type
  if (per == 0) per = 1;
  return (per + quantum - 1) / quantum * quantum;
}

JODC_HD inline BucketLayout MakeLayout(int64_t numel, int32_t world, int32_t master_bytes) {
  BucketLayout l;
  l.numel = numel;
  l.world = world;
  l.master_bytes = master_bytes;
  l.shard_numel = ShardNumel(numel, world, master_bytes);
  return l;
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_LAYOUT_H_
