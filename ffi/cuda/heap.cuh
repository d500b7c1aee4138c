// The CUDA symmetric heap: a process-wide registry of heaps whose buckets keep one master shard, one fp32
// accumulator and (in landing-slot mode) one fp32 landing slot per source device, each cudaMalloc'ed on the GPU that
// owns it. One process drives all of its GPUs; peer access is enabled between every pair of a heap's GPUs, so a
// kernel running on any of them can read and write every other one's shards through plain device pointers.
//
// Kernels never ask the host which mesh position they run for: the position is the int32 `device` operand (a device
// buffer), and every kernel receives the whole bucket as a BucketView (pointer table by value) and indexes it itself.
#ifndef JODC_FFI_CUDA_HEAP_CUH_
#define JODC_FFI_CUDA_HEAP_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/error.h"
#include "common/layout.h"
#include "common/ops.h"

// Symbols the Python side looks up with ctypes; everything else stays hidden (-fvisibility=hidden).
#define JODC_EXPORT extern "C" __attribute__((visibility("default")))

namespace jodc::cuda {

// Largest world a CUDA heap supports: a BucketView (three pointers per device) must fit the kernel parameter space
// with room to spare, and the barrier waits on every device with one thread of a single block.
constexpr int32_t kMaxWorld = 64;

// Which op a kernel belongs to (recorded with a device-side fault so the host can name it): the heap ops of
// ffi/common/ops.h, numbered from 1 in its order.
enum class OpCode : int32_t {
  kNone = 0,
#define JODC_OP_CODE(op, Camel) k##Camel,
  JODC_HEAP_OPS(JODC_OP_CODE)
#undef JODC_OP_CODE
};
const char* OpName(int32_t op);

// Per-heap state shared by the host and every GPU of the heap: pinned host memory mapped into all contexts
// (cudaHostAllocMapped | cudaHostAllocPortable; with unified addressing the host pointer is the device pointer).
// Living on the host makes barrier generations and device-side faults readable without any device transfer.
struct HeapControl {
  // arrivals[p]: how many barriers position p has entered. Written only by p's barrier kernel (a system-scope
  // release store), read by every other position's barrier kernel (system-scope acquire loads) and by the host.
  uint64_t arrivals[kMaxWorld];
  // 0, or the first device-side fault a kernel recorded (PackFault): a `device` operand outside [0, world).
  uint64_t fault;
  // Set by the host once the heap is poisoned or freed: barrier kernels still waiting give up at once.
  int32_t abort;
};

// One 64-bit word so that concurrent writers never produce a torn record.
JODC_HD inline uint64_t PackFault(OpCode op, int32_t device) {
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(static_cast<uint32_t>(op)) << 32) |
         static_cast<uint32_t>(device);
}
inline int32_t FaultOp(uint64_t fault) { return static_cast<int32_t>((fault >> 32) & 0x7fffffffu); }
inline int32_t FaultDevice(uint64_t fault) { return static_cast<int32_t>(static_cast<uint32_t>(fault)); }

// A bucket as every kernel sees it: layout plus, per position, the peer-addressable pointers of its memory. Passed to
// kernels by value (about 1.6 KB of parameter space), so no device-side table has to be kept in sync.
struct BucketView {
  BucketLayout layout;
  Dtype master = Dtype::kF32;
  bool landing_slots = false;  // accumulate into per-source landing slots instead of atomically into accumulators
  void* shard[kMaxWorld] = {};
  float* accumulator[kMaxWorld] = {};
  // landing[o] + s * shard_numel: the fp32 slot on owner o that only source s writes. Null without landing slots.
  float* landing[kMaxWorld] = {};
};

// One cudaMalloc'ed, zero-filled block on one GPU; frees itself (and keeps the process-wide byte tally).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  // Allocates and zeroes `bytes` on GPU `gpu`; an allocation the GPU cannot satisfy fails with kResourceExhausted.
  Error Allocate(int32_t gpu, int64_t bytes);
  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  int32_t gpu_ = -1;
  void* data_ = nullptr;
  int64_t bytes_ = 0;
};

int64_t LiveHeapBytes();

struct Bucket {
  int64_t id = 0;
  BucketView view;                         // immutable after registration
  BucketBytes bytes;                       // checked at registration: every offset the kernels compute fits int64
  std::vector<DeviceBuffer> shards;        // per position, master dtype, layout.shard_numel elements
  std::vector<DeviceBuffer> accumulators;  // per position, fp32
  std::vector<DeviceBuffer> landing;       // per owner, world * shard_numel fp32 (landing-slot mode only)

  const BucketLayout& layout() const { return view.layout; }
};

struct Heap {
  int64_t id = 0;
  int32_t world = 0;
  bool deterministic = false;
  // True when pushes go to per-source landing slots: deterministic mode, or some pair of GPUs lacks native peer
  // atomics (PCIe) so atomicAdd into a peer's memory is not available.
  bool landing_slots = false;
  std::atomic<double> barrier_timeout_s{300.0};
  std::vector<int32_t> placement;  // placement[p]: the CUDA device ordinal holding position p's memory
  HeapControl* control = nullptr;  // pinned, mapped into every context

  std::mutex mu;  // guards buckets, placement changes and poisoned
  std::map<int64_t, std::shared_ptr<Bucket>> buckets;
  std::string poisoned;  // non-empty once a barrier timed out or a kernel faulted: every later op fails with it

  ~Heap();
};

// Makes `gpu` the calling thread's current device for the scope and restores the previous one afterwards, so
// management calls from Python never leave the thread on an unexpected device.
class ScopedDevice {
 public:
  explicit ScopedDevice(int32_t gpu);
  ~ScopedDevice();
  bool ok() const { return status_ == cudaSuccess; }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

std::string CudaMessage(const char* what, cudaError_t e);

// Registry operations. Failures are returned as errors (common/error.h), never thrown across the C boundary.
ErrorOr<int64_t> CreateHeap(int32_t world, bool deterministic, double barrier_timeout_s);
// A barrier timeout is valid when > 0 (+inf: wait forever); an error for NaN, zero or negative values.
Error CheckBarrierTimeout(double seconds);
Error SetPlacement(int64_t heap_id, const std::vector<int32_t>& gpus);
Error FreeHeap(int64_t heap_id);
ErrorOr<std::shared_ptr<Heap>> FindHeap(int64_t heap_id);
ErrorOr<std::shared_ptr<Bucket>> FindBucket(const std::shared_ptr<Heap>& heap, int64_t bucket_id);
// Fails when the bucket's byte counts overflow int64 (kInvalidArgument) or a GPU cannot hold its part
// (kResourceExhausted: the C API reports it as such, Python raises MemoryError).
ErrorOr<int64_t> RegisterBucket(int64_t heap_id, int64_t numel, Dtype master);
Error FreeBucket(int64_t heap_id, int64_t bucket_id);
int64_t LiveHeapCount();

// Marks the heap unusable with `message` (kept if one is already recorded) and releases waiting barrier kernels.
// Returns the message now recorded. Requires heap.mu to be held.
const std::string& PoisonLocked(Heap& heap, const std::string& message);

// Aborts the heap: poisons it with "aborted: <reason>; ..." (a first cause already recorded stays) and releases
// waiting barrier kernels. Returns the poison message now recorded ("" when the heap does not exist).
std::string AbortHeap(int64_t heap_id, const std::string& reason);

// What a handler calls when it returns an error: aborts the heap naming the GPU and the error, so peers spinning in
// a barrier kernel for this device leave at once instead of waiting for the timeout.
void AbortOnHandlerError(int64_t heap_id, const std::string& message);

// The message for a device-side fault word, naming the op and the offending device index.
std::string FaultMessage(const Heap& heap, uint64_t fault);

// The heap's poison message ("" while healthy), first turning a fault recorded by a kernel into poison.
std::string CurrentPoison(Heap& heap);

}  // namespace jodc::cuda

#endif  // JODC_FFI_CUDA_HEAP_CUH_
