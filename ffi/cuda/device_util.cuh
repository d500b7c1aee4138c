// Device-side building blocks shared by the op kernels: element conversion (fp32 / bf16 bits), 8-element vector
// loads and stores, grid-stride copy and accumulate loops, system-scope loads and stores, device-index checks.
#ifndef JODC_FFI_CUDA_DEVICE_UTIL_CUH_
#define JODC_FFI_CUDA_DEVICE_UTIL_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/bf16.h"
#include "cuda/heap.cuh"

namespace jodc::cuda {

// bfloat16 travels as its raw 16 bits; conversions use the same rounding as the CPU side (common/bf16.h).
using Bf16Bits = uint16_t;

template <typename T>
inline constexpr bool kIsElement = std::is_same_v<T, float> || std::is_same_v<T, Bf16Bits>;

// Element conversion between fp32 and bf16 bits, with the CPU side's rounding; same-type "conversion" is a bit copy
// (NaN payloads survive untouched).
template <typename Dst, typename Src>
__device__ __forceinline__ Dst Convert(Src v) {
  static_assert(kIsElement<Dst> && kIsElement<Src>, "jodc moves float32 and bfloat16 only");
  if constexpr (std::is_same_v<Dst, Src>) {
    return v;
  } else if constexpr (std::is_same_v<Dst, float>) {
    return Bf16ToF32(v);
  } else {
    return F32ToBf16(v);
  }
}

// A kernel's element type for a bucket's or operand's Dtype, on the host: fn(ElementTag<float>{}) or
// fn(ElementTag<Bf16Bits>{}); fn reads the type as `typename decltype(tag)::type`. The one place handlers pick
// which instantiation of a kernel template to launch.
template <typename T>
struct ElementTag {
  using type = T;
};
template <typename Fn>
void WithElement(Dtype dtype, Fn&& fn) {
  if (dtype == Dtype::kF32) {
    fn(ElementTag<float>{});
  } else {
    fn(ElementTag<Bf16Bits>{});
  }
}

// An element as fp32 (what accumulators hold).
template <typename T>
__device__ __forceinline__ float ToF32(T v) {
  return Convert<float>(v);
}

// Eight consecutive elements: one 16-byte transaction for bf16, two for fp32.
constexpr int kPack = 8;
template <typename T>
struct alignas(16) Pack {
  T v[kPack];
};

// p must be 16-byte aligned (the caller checked; shards always are, XLA buffers almost always).
template <typename T>
__device__ __forceinline__ Pack<T> LoadPack(const T* p) {
  static_assert(sizeof(Pack<T>) % 16 == 0);
  Pack<T> out;
  const uint4* src = reinterpret_cast<const uint4*>(p);
  uint4* dst = reinterpret_cast<uint4*>(&out);
#pragma unroll
  for (int c = 0; c < static_cast<int>(sizeof(Pack<T>) / 16); ++c) dst[c] = src[c];
  return out;
}

template <typename T>
__device__ __forceinline__ void StorePack(T* p, const Pack<T>& in) {
  const uint4* src = reinterpret_cast<const uint4*>(&in);
  uint4* dst = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int c = 0; c < static_cast<int>(sizeof(Pack<T>) / 16); ++c) dst[c] = src[c];
}

// This thread's start and stride in a grid-stride loop over grid dimension x (dimension y picks a peer).
__device__ __forceinline__ int64_t StrideStart() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t StrideStep() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// The loop shape of every copy / add kernel: this thread's share of a grid-stride loop over [0, n), as whole groups
// of `width` consecutive elements, group(i) for the group starting at element i (only when `vectorized`: the pointers
// involved are 16-byte aligned), then the elements after the last whole group one by one, element(i). Consecutive
// threads take consecutive groups, so a warp's loads and stores are contiguous.
template <int width, typename Group, typename Element>
__device__ __forceinline__ void ForEachStrided(int64_t n, bool vectorized, Group group, Element element) {
  const int64_t start = StrideStart(), step = StrideStep();
  int64_t done = 0;
  if (vectorized) {
    const int64_t groups = n / width;
    for (int64_t k = start; k < groups; k += step) group(k * width);
    done = groups * width;
  }
  for (int64_t i = done + start; i < n; i += step) element(i);
}

// dst[0, n) = convert(src[0, n)), shared by the threads of grid dimension x. `vectorized`: both pointers are 16-byte
// aligned, so whole packs move with 16-byte loads and stores and only the tail goes element by element.
template <typename Dst, typename Src>
__device__ void CopyRange(Dst* __restrict__ dst, const Src* __restrict__ src, int64_t n, bool vectorized) {
  ForEachStrided<kPack>(
      n, vectorized,
      [=](int64_t i) {
        const Pack<Src> in = LoadPack(src + i);
        Pack<Dst> out;
#pragma unroll
        for (int j = 0; j < kPack; ++j) out.v[j] = Convert<Dst>(in.v[j]);
        StorePack(dst + i, out);
      },
      [=](int64_t i) { dst[i] = Convert<Dst>(src[i]); });
}

// acc[0, n) += fp32(src[0, n)) with plain loads and stores: only for memory that no other device writes meanwhile
// (a landing slot belongs to exactly one source, and one device's kernels run in stream order).
template <typename Src>
__device__ void AddRange(float* __restrict__ acc, const Src* __restrict__ src, int64_t n, bool vectorized) {
  ForEachStrided<kPack>(
      n, vectorized,
      [=](int64_t i) {
        const Pack<Src> in = LoadPack(src + i);
        Pack<float> sum = LoadPack(acc + i);
#pragma unroll
        for (int j = 0; j < kPack; ++j) sum.v[j] += ToF32(in.v[j]);
        StorePack(acc + i, sum);
      },
      [=](int64_t i) { acc[i] += ToF32(src[i]); });
}

// read_accumulator's fixed-order reduction in fp32: out[0, n) = acc + slot 0 + slot 1 + ... + slot count-1, in that
// order whatever the timing of the pushes (the CPU backend's order: deterministic heaps give the same bits on every
// backend). Slot s is slots + s * n; count 0 makes it a copy of acc. `vectorized`: out, acc and slots are 16-byte
// aligned (shards are whole multiples of 64 bytes).
__device__ __forceinline__ void SumInSourceOrder(float* __restrict__ out, const float* acc, const float* slots,
                                                 int32_t count, int64_t n, bool vectorized) {
  ForEachStrided<kPack>(
      n, vectorized,
      [=](int64_t i) {
        Pack<float> sum = LoadPack(acc + i);
        for (int32_t s = 0; s < count; ++s) {
          const Pack<float> slot = LoadPack(slots + s * n + i);
#pragma unroll
          for (int j = 0; j < kPack; ++j) sum.v[j] += slot.v[j];
        }
        StorePack(out + i, sum);
      },
      [=](int64_t i) {
        float sum = acc[i];
        for (int32_t s = 0; s < count; ++s) sum += slots[s * n + i];
        out[i] = sum;
      });
}

// zero_accumulator's stores: grid row y = 0 zeroes acc[0, n), row y = 1 + s landing slot s (landing + s * n), with
// 16-byte stores when `vectorized` (both 16-byte aligned). Then fences, so peers' next pushes land on the zeros
// instead of being overwritten by them.
__device__ __forceinline__ void ZeroRegions(float* acc, float* landing, int64_t n, bool vectorized) {
  float* region = blockIdx.y == 0 ? acc : landing + (blockIdx.y - 1) * n;
  ForEachStrided<4>(
      n, vectorized, [=](int64_t i) { *reinterpret_cast<float4*>(region + i) = make_float4(0.f, 0.f, 0.f, 0.f); },
      [=](int64_t i) { region[i] = 0.f; });
  __threadfence_system();
}

// Four consecutive source elements as fp32 (src 8-byte aligned for bf16, 16-byte aligned for fp32).
template <typename Src>
__device__ __forceinline__ float4 LoadQuadAsF32(const Src* p) {
  if constexpr (std::is_same_v<Src, float>) {
    return *reinterpret_cast<const float4*>(p);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);  // 4 x bf16
    return make_float4(Bf16ToF32(static_cast<Bf16Bits>(raw.x & 0xffffu)), Bf16ToF32(static_cast<Bf16Bits>(raw.x >> 16)),
                       Bf16ToF32(static_cast<Bf16Bits>(raw.y & 0xffffu)), Bf16ToF32(static_cast<Bf16Bits>(raw.y >> 16)));
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// One 16-byte reduction (sm_90+): acc[0..3] += v atomically per element, at system scope, fire-and-forget.
__device__ __forceinline__ void RedAddF32x4System(float* acc, float4 v) {
  asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(__cvta_generic_to_global(acc)),
               "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
#endif

// acc[0, n) += fp32(src[0, n)) with atomics: any number of devices may push into the same accumulator at once.
// System scope, because the concurrent adders run on different GPUs (a plain atomicAdd is only atomic among the
// threads of one GPU). The result is unused, so each compiles to a fire-and-forget reduction (RED ... ADD.F32) that
// NVLink executes at the owner's memory. Over PCIe peer atomics are generally not available; the heap then uses
// landing slots instead (see Heap::landing_slots).
//
// Lanes are contiguous: consecutive threads of a warp reduce consecutive elements (sm_80: one 4-byte RED each, a warp
// covers 128 contiguous bytes) or consecutive 16-byte groups (sm_90+: one vector RED.E.ADD.F32x4 each, a warp covers
// 512 contiguous bytes), so every reduction instruction of a warp is fully coalesced. `acc` is 16-byte aligned
// (shard allocations); `vectorized` says `src` is too.
//
// Subnormals: float atomics on global memory run in flush-to-zero mode on every architecture (scalar and vector
// forms), whatever -ftz says. A subnormal contribution (|x| < 2^-126, about 1.2e-38) or a subnormal running sum
// therefore becomes a signed zero in atomic mode, while landing-slot mode (plain fp32 adds, like the CPU backend)
// keeps it. Gradients that small are far below anything an optimizer step can resolve; a heap that must match the
// CPU backend bit for bit is deterministic anyway (landing slots). docs/cuda.md records this.
template <typename Src>
__device__ void AtomicAddRange(float* acc, const Src* __restrict__ src, int64_t n, bool vectorized) {
  const int64_t start = StrideStart(), step = StrideStep();
  int64_t done = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (vectorized) {
    const int64_t quads = n / 4;
    for (int64_t k = start; k < quads; k += step) RedAddF32x4System(acc + 4 * k, LoadQuadAsF32(src + 4 * k));
    done = quads * 4;
  }
#else
  (void)vectorized;
#endif
  for (int64_t i = done + start; i < n; i += step) atomicAdd_system(acc + i, ToF32(src[i]));
}

// ---- system scope: memory shared with the host and with peer GPUs ---------------------------------------------

__device__ __forceinline__ uint64_t LoadAcquireSystem(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t LoadRelaxedSystem(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int32_t LoadRelaxedSystem(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.sys.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSystem(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void StoreRelaxedSystem(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Nanoseconds of the GPU's global timer (comparable across the SMs of one GPU).
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- the device operand ------------------------------------------------------------------------------------------

// Reads the calling device's mesh position from its operand. An index outside [0, world) can only come from
// bypassing jodc.ops' wrappers; the kernel must then touch nothing: the first thread of the grid records the fault
// in the heap's control block (the host reports it at the next barrier or op, and poisons the heap) and still
// advances the token, so that nothing downstream waits on an unwritten value.
__device__ __forceinline__ bool ValidDevice(const int32_t* device_operand, int32_t world, HeapControl* control,
                                            OpCode op, const int32_t* token_in, int32_t* token_out,
                                            int32_t* device) {
  *device = *device_operand;
  if (*device >= 0 && *device < world) return true;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    StoreRelaxedSystem(&control->fault, PackFault(op, *device));
    __threadfence_system();
    token_out[0] = token_in[0] + 1;
  }
  return false;
}

// Makes this thread's writes into memory that other GPUs read later (peers' accumulators and landing slots, its
// own published shard, its zeroed accumulator) performed at system scope before the kernel ends, so that the barrier
// kernel's release, which follows in stream order, covers them. One fence per thread per kernel: negligible.
__device__ __forceinline__ void FenceWritesForPeers() { __threadfence_system(); }

// The first thread of the grid writes the next token (token in + 1): computed on the device, never read by the host.
__device__ __forceinline__ void AdvanceToken(const int32_t* token_in, int32_t* token_out) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) token_out[0] = token_in[0] + 1;
}

// What a barrier kernel tells its handler (BarrierReport::outcome), in both GPU backends (CUDA, NVSHMEM).
enum BarrierOutcome : int32_t { kPending = 0, kPassed = 1, kTimedOut = 2, kAborted = 3, kBadDevice = 4 };

// A barrier kernel of either GPU backend (one block of kMaxWorld threads; every thread calls it). Thread 0 reads the
// device operand and, for a device in [0, world), calls arrive(device), which makes this device's earlier writes
// visible to its peers, publishes its arrival (a store into the host-mapped counter for CUDA, puts to every PE for
// NVSHMEM) and returns the new generation. Then thread p < world waits until peer p's arrival counter reaches that
// generation, the abort flag is set or `timeout_ns` passed, backing off with __nanosleep; thread 0 finally writes the
// report and the token. A device outside [0, world) touches nothing and is reported as kBadDevice.
template <typename Arrive>
__device__ __forceinline__ void RunBarrier(const uint64_t* arrivals, const int32_t* abort, int32_t world,
                                           const int32_t* device_operand, const int32_t* token_in, int32_t* token_out,
                                           uint64_t timeout_ns, BarrierReport* report, Arrive arrive) {
  __shared__ int32_t device;
  __shared__ uint64_t generation;
  __shared__ unsigned long long missing;
  __shared__ int32_t aborted;
  __shared__ uint64_t start_ns;
  const int32_t p = static_cast<int32_t>(threadIdx.x);
  if (p == 0) {
    device = *device_operand;
    missing = 0;
    aborted = 0;
    generation = 0;
    start_ns = GlobalTimerNs();
    if (device >= 0 && device < world) generation = arrive(device);
  }
  __syncthreads();
  if (device < 0 || device >= world) {
    if (p == 0) {
      report->device = device;
      report->outcome = kBadDevice;
      token_out[0] = token_in[0] + 1;
      __threadfence_system();
    }
    return;
  }
  if (p < world) {
    unsigned sleep_ns = 64;
    while (LoadAcquireSystem(&arrivals[p]) < generation) {
      if (LoadRelaxedSystem(abort) != 0) {
        aborted = 1;
        atomicOr(&missing, 1ull << p);
        break;
      }
      if (GlobalTimerNs() - start_ns > timeout_ns) {
        atomicOr(&missing, 1ull << p);
        break;
      }
      __nanosleep(sleep_ns);
      if (sleep_ns < 2048) sleep_ns *= 2;
    }
    __threadfence_system();  // what device p wrote before arriving is visible to this device's later kernels
  }
  __syncthreads();
  if (p == 0) {
    report->device = device;
    report->generation = generation;
    report->missing = missing;
    report->outcome = missing == 0 ? kPassed : (aborted ? kAborted : kTimedOut);
    token_out[0] = token_in[0] + 1;
    __threadfence_system();
  }
}

}  // namespace jodc::cuda

#endif  // JODC_FFI_CUDA_DEVICE_UTIL_CUH_
