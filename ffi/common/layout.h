// Layout of one bucket in the symmetric heap: how a flat vector of `numel` elements is split into one padded shard
// per device, and how many bytes its memory takes. Shared by the CPU and CUDA sides so the CPU tests exercise the
// same arithmetic the kernels use. Header-only and free of XLA: a plain C++ unit test can include it.
//
// Every size computed here is checked: a bucket whose byte counts do not fit int64 is refused (the checked functions
// return false) instead of wrapping round to a small allocation that the ops would then overrun.
// jodc/ops/layout.py mirrors these functions one for one.
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
constexpr int64_t kInt64Max = INT64_MAX;

// ---- checked arithmetic on sizes (non-negative int64) --------------------------------------------------------------

// *out = a + b; false (and *out untouched) when an operand is negative or the sum exceeds INT64_MAX.
JODC_HD inline bool CheckedAdd(int64_t a, int64_t b, int64_t* out) {
  if (a < 0 || b < 0 || a > kInt64Max - b) return false;
  *out = a + b;
  return true;
}

// *out = a * b; false (and *out untouched) when an operand is negative or the product exceeds INT64_MAX.
JODC_HD inline bool CheckedMul(int64_t a, int64_t b, int64_t* out) {
  if (a < 0 || b < 0) return false;
  if (a != 0 && b > kInt64Max / a) return false;
  *out = a * b;
  return true;
}

// *out = ceil(a / multiple) * multiple for a >= 0, multiple >= 1; false when the result exceeds INT64_MAX.
JODC_HD inline bool CheckedRoundUp(int64_t a, int64_t multiple, int64_t* out) {
  if (a < 0 || multiple < 1) return false;
  const int64_t q = a / multiple + (a % multiple != 0 ? 1 : 0);
  return CheckedMul(q, multiple, out);
}

// ---- the layout ----------------------------------------------------------------------------------------------------

struct BucketLayout {
  int64_t numel = 0;        // real elements of the bucket (the unpadded flat parameter vector)
  int32_t world = 0;        // devices sharing the bucket
  int64_t shard_numel = 0;  // elements per shard, padded; shard_numel * world >= numel
  int32_t master_bytes = 0; // bytes per master element (4: fp32, 2: bf16); accumulators are always fp32

  // Only meaningful for layouts that passed CheckedBucketBytes (then every product below fits int64).
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

// Elements per 64 bytes of the narrower of the master and accumulator (fp32) types: a shard is a multiple of it.
JODC_HD inline int64_t ShardQuantum(int32_t master_bytes) {
  const int64_t smallest = master_bytes < 4 ? master_bytes : 4;
  return kShardAlignBytes / smallest;
}

// Shard size: ceil(numel / world) rounded up so that both the master shard and the fp32 accumulator shard are a
// multiple of 64 bytes (then consecutive shards in one allocation all start aligned). False for invalid arguments
// (numel < 1, world < 1, master_bytes not 2 or 4) or when the rounding overflows.
JODC_HD inline bool CheckedShardNumel(int64_t numel, int32_t world, int32_t master_bytes, int64_t* out) {
  if (numel < 1 || world < 1 || (master_bytes != 2 && master_bytes != 4)) return false;
  const int64_t per = numel / world + (numel % world != 0 ? 1 : 0);  // ceil without numel + world - 1 overflowing
  return CheckedRoundUp(per, ShardQuantum(master_bytes), out);
}

// The same, or -1 when CheckedShardNumel refuses (the value the Python bindings report).
JODC_HD inline int64_t ShardNumel(int64_t numel, int32_t world, int32_t master_bytes) {
  int64_t out = -1;
  return CheckedShardNumel(numel, world, master_bytes, &out) ? out : -1;
}

JODC_HD inline BucketLayout MakeLayout(int64_t numel, int32_t world, int32_t master_bytes) {
  BucketLayout l;
  l.numel = numel;
  l.world = world;
  l.master_bytes = master_bytes;
  l.shard_numel = ShardNumel(numel, world, master_bytes);
  return l;
}

// Bytes of one bucket's memory, per device and in total over the world. Landing slots (deterministic mode, or CUDA
// without peer atomics) give every owner `world` fp32 slots of a shard each.
struct BucketBytes {
  int64_t shard = 0;        // one master shard
  int64_t accumulator = 0;  // one fp32 accumulator shard
  int64_t landing = 0;      // one owner's landing slots (0 without landing slots)
  int64_t per_device = 0;   // shard + accumulator + landing: what one device's memory holds
  int64_t total = 0;        // per_device * world: the whole bucket
};

// Fills *out for a layout made by MakeLayout; false when the layout is invalid (shard_numel < 1) or any byte count
// (including the 64-byte rounding of an allocation) does not fit int64.
JODC_HD inline bool CheckedBucketBytes(const BucketLayout& l, bool landing_slots, BucketBytes* out) {
  if (l.shard_numel < 1 || l.world < 1 || (l.master_bytes != 2 && l.master_bytes != 4)) return false;
  BucketBytes b;
  int64_t padded = 0, rounded = 0;
  if (!CheckedMul(l.shard_numel, l.world, &padded)) return false;                    // padded_numel()
  if (!CheckedMul(l.shard_numel, l.master_bytes, &b.shard)) return false;
  if (!CheckedMul(l.shard_numel, 4, &b.accumulator)) return false;
  if (landing_slots && !CheckedMul(b.accumulator, l.world, &b.landing)) return false;
  if (!CheckedAdd(b.shard, b.accumulator, &b.per_device) || !CheckedAdd(b.per_device, b.landing, &b.per_device))
    return false;
  if (!CheckedMul(b.per_device, l.world, &b.total)) return false;
  if (!CheckedRoundUp(b.total, kShardAlignBytes, &rounded)) return false;  // allocations round to 64 bytes
  *out = b;
  return true;
}

// ---- barrier timeouts ----------------------------------------------------------------------------------------------

// Longest wait, in nanoseconds, that the barriers treat as finite: about 292 years (INT64_MAX ns). A timeout at or
// beyond it (or +inf) means "wait forever"; no clock arithmetic can then overflow.
constexpr int64_t kForeverNs = INT64_MAX;

// A barrier timeout in seconds as nanoseconds: kForeverNs for +inf and for anything too large for int64
// nanoseconds; -1 for values that are not a valid timeout (NaN, zero, negative), which callers refuse.
JODC_HD inline int64_t TimeoutNanos(double seconds) {
  if (!(seconds > 0)) return -1;  // NaN compares false
  const double ns = seconds * 1e9;
  if (!(ns < 9.2e18)) return kForeverNs;  // below 2^63 with room for the rounding of the double
  const int64_t whole = static_cast<int64_t>(ns);
  return whole < 1 ? 1 : whole;
}

// now + timeout (both ns on one monotonic clock), saturating at kForeverNs instead of wrapping.
JODC_HD inline int64_t DeadlineNanos(int64_t now_ns, int64_t timeout_ns) {
  int64_t out = 0;
  if (timeout_ns >= kForeverNs || !CheckedAdd(now_ns < 0 ? 0 : now_ns, timeout_ns, &out)) return kForeverNs;
  return out;
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_LAYOUT_H_
