#include "cpu/memcpy_bench.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "cpu/heap.h"

namespace jodc::cpu {

double MemcpyBandwidth(int64_t bytes, int32_t threads, int32_t iters) {
  std::vector<std::unique_ptr<AlignedBuffer>> src, dst;
  for (int32_t t = 0; t < threads; ++t) {
    src.push_back(std::make_unique<AlignedBuffer>(bytes));
    dst.push_back(std::make_unique<AlignedBuffer>(bytes));
    std::memset(src.back()->data(), t + 1, bytes);
    std::memcpy(dst.back()->data(), src.back()->data(), bytes);  // warm-up: fault every page in
  }
  auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int32_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int32_t i = 0; i < iters; ++i) std::memcpy(dst[t]->data(), src[t]->data(), bytes);
    });
  }
  for (auto& th : pool) th.join();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(bytes) * threads * iters / seconds / 1e9;
}

}  // namespace jodc::cpu
