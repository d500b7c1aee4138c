// Plain C++ memcpy bandwidth with N threads: the ceiling the gather benchmark compares itself against.
#ifndef JODC_FFI_CPU_MEMCPY_BENCH_H_
#define JODC_FFI_CPU_MEMCPY_BENCH_H_

#include <cstdint>

namespace jodc::cpu {

// Each of `threads` threads copies its own `bytes`-sized buffer `iters` times (after one warm-up copy).
// Returns the aggregate bandwidth in GB/s (1e9 bytes per second).
double MemcpyBandwidth(int64_t bytes, int32_t threads, int32_t iters);

}  // namespace jodc::cpu

#endif  // JODC_FFI_CPU_MEMCPY_BENCH_H_
