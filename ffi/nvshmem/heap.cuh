// The NVSHMEM backend: ODC across nodes. One process per GPU, one NVSHMEM PE per process, PE p = mesh position p.
// Every bucket's shard, fp32 accumulator and (landing-slot mode) landing slots live in NVSHMEM's symmetric heap
// (nvshmem_malloc: the same offsets on every PE), so a kernel names any position's memory by (symmetric address, PE):
//   gather              nvshmemx_getmem_block from each owner (same dtype) or element gets (fp32 <-> bf16);
//   scatter_accumulate  nvshmemx_float_atomic_add into the owner's accumulator (atomic mode), or get-add-put into this
//                       source's own landing slot on the owner (no other PE writes it: no atomics needed);
//   barrier             nvshmem_quiet (every earlier put and atomic of this PE is complete at its target), then
//                       nvshmem_uint64_p of this PE's arrival count into every PE's arrivals[me]; each PE polls its own
//                       local copy with a timeout and the heap's abort flag (set remotely by a failing PE's host);
//   read / zero / publish touch only this PE's own memory.
// Same operands, attributes and errors as the CUDA and CPU backends; registered as jodc_nvshmem_<op>.
#ifndef JODC_FFI_NVSHMEM_HEAP_CUH_
#define JODC_FFI_NVSHMEM_HEAP_CUH_

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "common/dtype.h"
#include "common/error.h"
#include "common/layout.h"
#include "cuda/heap.cuh"  // kMaxWorld, HeapControl (the fault word), BarrierReport, OpCode, CudaMessage

namespace jodc::nvshmem_backend {

using cuda::BarrierReport;
using cuda::HeapControl;
using cuda::kMaxWorld;

// A bucket: its layout and symmetric addresses (valid on every PE; this PE's own memory is plain device memory).
struct SymBucketView {
  BucketLayout layout;
  Dtype master = Dtype::kF32;
  bool landing_slots = false;
  void* shard = nullptr;          // shard_numel elements of the master dtype
  float* accumulator = nullptr;   // shard_numel floats
  float* landing = nullptr;       // world * shard_numel floats (landing-slot mode): slot s written only by PE s
};

struct SymBucket {
  int64_t id = 0;
  SymBucketView view;
  BucketBytes bytes;
  ~SymBucket();
};

struct NvHeap {
  int64_t id = 0;
  int32_t world = 0;
  int32_t me = 0;  // this PE
  bool deterministic = false;
  bool landing_slots = false;
  std::atomic<double> barrier_timeout_s{300.0};
  uint64_t* arrivals = nullptr;  // symmetric, kMaxWorld: arrivals[p] on every PE is written only by PE p
  int32_t* abort = nullptr;      // symmetric: set (remotely too) when the heap is poisoned anywhere
  HeapControl* control = nullptr;  // pinned, local: the fault word of this PE's kernels
  cuda::BarrierReports reports;  // `world` reports, borrowed by barrier handlers
  std::mutex mu;  // guards buckets and poisoned (never held across a CUDA or NVSHMEM call)
  std::map<int64_t, std::shared_ptr<SymBucket>> buckets;
  std::string poisoned;
  ~NvHeap();
};

// Lookups in the process-wide registry (ffi/common/registry.h): an error naming the heap or bucket when absent.
ErrorOr<std::shared_ptr<NvHeap>> FindHeap(int64_t heap_id);
ErrorOr<std::shared_ptr<SymBucket>> FindBucket(const std::shared_ptr<NvHeap>& heap, int64_t bucket_id);
// The poison message ("" while healthy), first turning a device fault or a remote abort into poison.
std::string CurrentPoison(NvHeap& heap);
// Poisons the heap (the first message stays) and sets the abort flag on every PE.
void Poison(NvHeap& heap, const std::string& message);

}  // namespace jodc::nvshmem_backend

#endif  // JODC_FFI_NVSHMEM_HEAP_CUH_
