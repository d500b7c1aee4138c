// The CPU handlers' core loops on plain buffers, free of XLA types, so C++ unit tests (and Bazel's cc_tests) call
// them directly: element conversion, accumulation, and the gather / scatter_accumulate walks over a bucket.
#ifndef JODC_FFI_CPU_KERNELS_H_
#define JODC_FFI_CPU_KERNELS_H_

#include <cstdint>
#include <cstring>
#include <mutex>

#include "common/bf16.h"
#include "common/dtype.h"
#include "cpu/heap.h"

namespace jodc::cpu {

// dst[i] = src[i] with conversion between fp32 and bf16 (plain memcpy when the types agree).
inline void CopyConvert(void* dst, Dtype dst_t, const void* src, Dtype src_t, int64_t n) {
  if (dst_t == src_t) {
    std::memcpy(dst, src, n * DtypeBytes(dst_t));
  } else if (dst_t == Dtype::kF32) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = Bf16ToF32(s[i]);
  } else {
    const float* s = static_cast<const float*>(src);
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = F32ToBf16(s[i]);
  }
}

// acc[i] += src[i] in fp32, whatever the source type.
inline void AccumulateF32(float* __restrict acc, const void* src, Dtype src_t, int64_t n) {
  if (src_t == Dtype::kF32) {
    const float* __restrict s = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] += s[i];
  } else {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] += Bf16ToF32(s[i]);
  }
}

// gather's core: device `device` copies every owner's valid slice of bucket `b` into `dst` (numel elements of
// `out_t`), starting with its own shard and walking the ring so concurrent gathers read different owners.
inline void GatherBucket(const Bucket& b, int32_t device, void* dst, Dtype out_t) {
  char* out = static_cast<char*>(dst);
  const int32_t world = b.layout.world;
  for (int32_t k = 0; k < world; ++k) {
    const int32_t owner = (device + k) % world;
    const int64_t n = b.layout.valid(owner);
    if (n <= 0) continue;
    CopyConvert(out + b.layout.begin(owner) * DtypeBytes(out_t), out_t, b.shard(owner), b.master, n);
  }
}

// scatter_accumulate's core: device `device` adds each owner's slice of the full-size gradient `src` (numel
// elements of `grad_t`) into that owner's fp32 accumulator (under the owner's lock), or, in deterministic mode,
// into its own landing slot at that owner (no lock: only this device writes it).
inline void ScatterAccumulateBucket(const Bucket& b, int32_t device, bool deterministic, const void* src,
                                    Dtype grad_t) {
  const char* in = static_cast<const char*>(src);
  const int32_t world = b.layout.world;
  for (int32_t k = 1; k <= world; ++k) {
    const int32_t owner = (device + k) % world;  // own shard last: remote owners are served first
    const int64_t n = b.layout.valid(owner);
    if (n <= 0) continue;
    const void* slice = in + b.layout.begin(owner) * DtypeBytes(grad_t);
    if (deterministic) {
      AccumulateF32(b.landing_slot(owner, device), slice, grad_t, n);
    } else {
      std::lock_guard<std::mutex> lock(*b.owner_locks[owner]);
      AccumulateF32(b.accumulator(owner), slice, grad_t, n);
    }
  }
}

}  // namespace jodc::cpu

#endif  // JODC_FFI_CPU_KERNELS_H_
