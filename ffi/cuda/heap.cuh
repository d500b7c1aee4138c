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
#include <cstring>
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
// The longest poison message a multi-process heap shares through its control block (longer ones are cut).
constexpr int32_t kAbortReasonBytes = 1024;
enum AbortReasonState : int32_t { kReasonEmpty = 0, kReasonWriting = 1, kReasonReady = 2 };

// Which op a kernel belongs to (recorded with a device-side fault so the host can name it): the heap ops of
// ffi/common/ops.h, numbered from 1 in its order.
enum class OpCode : int32_t {
  kNone = 0,
#define JODC_OP_CODE(op, Camel) k##Camel,
  JODC_HEAP_OPS(JODC_OP_CODE)
#undef JODC_OP_CODE
};
const char* OpName(int32_t op);

// What one barrier kernel tells its handler: outcome, generation and the devices still missing. A heap owns one per
// position in pinned, mapped memory (allocated with the heap, freed with it); a barrier handler borrows a free one for
// the duration of its call (see Heap::AcquireReport).
struct BarrierReport {
  int32_t device;
  int32_t outcome;
  uint64_t generation;
  uint64_t missing;  // bit p: device p had not arrived when this device stopped waiting
};

// Zero-filled pinned host memory mapped into every context (cudaHostAllocMapped | cudaHostAllocPortable; with unified
// addressing the host pointer is also the device pointer): control blocks and barrier reports. Free with cudaFreeHost.
inline cudaError_t AllocateMappedZeros(size_t bytes, void** out) {
  *out = nullptr;
  const cudaError_t e = cudaHostAlloc(out, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *out = nullptr;
    return e;
  }
  std::memset(*out, 0, bytes);
  return cudaSuccess;
}

// A heap's barrier reports (one per position; the CUDA and NVSHMEM heaps each own one pool): allocated with the heap,
// so no barrier allocates (cudaHostAlloc synchronises) while peers may already spin, and freed with it. A barrier
// handler borrows a free report for the duration of its call.
class BarrierReports {
 public:
  BarrierReports() = default;
  BarrierReports(const BarrierReports&) = delete;
  BarrierReports& operator=(const BarrierReports&) = delete;
  ~BarrierReports() {
    if (reports_ != nullptr) cudaFreeHost(reports_);
    cudaGetLastError();  // at interpreter exit the runtime may already be unloading
  }

  // Allocates `count` (<= kMaxWorld) zeroed reports in the current device's context.
  cudaError_t Allocate(int32_t count) {
    void* p = nullptr;
    const cudaError_t e = AllocateMappedZeros(sizeof(BarrierReport) * count, &p);
    if (e == cudaSuccess) {
      reports_ = static_cast<BarrierReport*>(p);
      count_ = count;
    }
    return e;
  }

  struct Return {
    BarrierReports* pool;
    void operator()(BarrierReport* r) const { pool->busy_[r - pool->reports_].store(false, std::memory_order_release); }
  };
  using Lease = std::unique_ptr<BarrierReport, Return>;

  // A free report, given back when the lease ends; null when all are in use (more barriers of the heap in flight at
  // once than it has positions, which a correct program never does).
  Lease Borrow() {
    for (int32_t i = 0; i < count_; ++i) {
      if (!busy_[i].exchange(true, std::memory_order_acquire)) return Lease(reports_ + i, Return{this});
    }
    return Lease(nullptr, Return{this});
  }

 private:
  BarrierReport* reports_ = nullptr;
  int32_t count_ = 0;
  std::atomic<bool> busy_[kMaxWorld] = {};
};

// The message of a barrier that timed out (the CPU backend's wording): the missing devices, the one that waited.
std::string BarrierTimeoutMessage(double timeout_s, const BarrierReport& report, int32_t world, int64_t heap_id);

// The barrier kernel's timeout in %globaltimer nanoseconds from the heap's seconds: saturating (+inf and timeouts
// beyond int64 nanoseconds become about 292 years, which the kernel's elapsed-time comparison never reaches), >= 1.
inline uint64_t BarrierTimeoutTicks(double seconds) {
  const int64_t ns = TimeoutNanos(seconds);
  return ns > 0 ? static_cast<uint64_t>(ns) : uint64_t{1};
}

// A barrier handler found every report of its heap borrowed.
inline Error TooManyBarriers(int32_t world, int64_t heap_id) {
  return Error::Internal("jodc barrier: more than " + std::to_string(world) + " barriers of heap " +
                         std::to_string(heap_id) + " are in flight at once (one per device is the most a program can "
                         "have); is the same computation running twice concurrently?");
}

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
  // Multi-process heaps (CUDA IPC): the first poison message of any process sharing this block, so the other
  // processes fail with the real cause instead of a bare "aborted elsewhere". Host-only (kernels never read it).
  // abort_reason_state: kReasonEmpty, kReasonWriting (claimed by one process, text in progress) or kReasonReady;
  // the claimer writes the text, then the state (release), then `abort`.
  int32_t abort_reason_state;
  int32_t abort_reason_position;  // the heap position of the process that wrote abort_reason
  char abort_reason[kAbortReasonBytes];
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
  // Multi-process heaps (CUDA IPC): memory of other processes' positions, mapped with cudaIpcOpenMemHandle into the
  // context of `import_gpu`; closed with the bucket. Remote positions own no DeviceBuffer here.
  std::vector<void*> imported;
  int32_t import_gpu = -1;
  std::vector<uint8_t> attached;  // per position: its memory is in `view` (local, or imported)

  const BucketLayout& layout() const { return view.layout; }
  ~Bucket();
};

struct Heap {
  // Immutable after CreateHeap: read without locks by every handler.
  int64_t id = 0;
  int32_t world = 0;
  bool deterministic = false;
  // True when pushes go to per-source landing slots: deterministic mode, or some pair of GPUs lacks native peer
  // atomics (PCIe) so atomicAdd into a peer's memory is not available.
  bool landing_slots = false;
  std::vector<int32_t> placement;  // placement[p]: the CUDA device ordinal holding position p's memory (for a remote
                                   // position of a multi-process heap: the local GPU its memory is mapped through)
  // Per position: whether this process allocated its memory. Empty: every position is local (one process).
  std::vector<uint8_t> local;
  HeapControl* control = nullptr;      // host view of the control block: pinned, mapped into every context
  HeapControl* control_dev = nullptr;  // the same block as kernels address it (equal to `control` under UVA)
  // Multi-process heaps: the control block is a POSIX shared-memory segment registered with CUDA (every process on
  // the node maps the same pages), so barriers, aborts and faults are shared by all processes without any copy.
  std::string shm_name;
  size_t shm_bytes = 0;
  BarrierReports reports;  // `world` reports, borrowed by barrier handlers

  std::atomic<double> barrier_timeout_s{300.0};

  // Guards buckets and poisoned. Held only for map lookups and updates: never across a CUDA call that may wait for
  // a GPU (allocations, copies, synchronisation), so handlers of this heap never queue behind one.
  std::mutex mu;
  std::map<int64_t, std::shared_ptr<Bucket>> buckets;
  // Multi-process heaps: buckets registered here whose remote positions are not all imported yet (no op sees them).
  std::map<int64_t, std::shared_ptr<Bucket>> pending;
  std::string poisoned;  // non-empty once a barrier timed out or a kernel faulted: every later op fails with it

  // Records that a handler queued work for this heap on `stream` (of GPU `gpu`): an event per stream, re-recorded
  // after each launch. Freeing waits for these events only, i.e. for this heap's own work, never for unrelated
  // kernels (another heap's barrier spinning on the same GPU). Fails on a CUDA error.
  Error NoteLaunch(cudaStream_t stream, int32_t gpu);
  // Waits until every launch noted so far has finished on the GPU. Errors are ignored (teardown paths).
  void WaitForLaunches();

  bool IsLocal(int32_t position) const { return local.empty() || local[position] != 0; }
  // The one position this process owns in a multi-process heap; -1 for an in-process heap (every position local).
  int32_t LocalPosition() const;

  ~Heap();

 private:
  struct StreamEvent {
    cudaStream_t stream;
    int32_t gpu;
    cudaEvent_t event;
  };
  std::mutex launches_mu_;  // guards launches_ (a short vector scan; no CUDA call that waits for the GPU)
  std::vector<StreamEvent> launches_;
};

class ScopedDevice;

// Makes `gpu` the calling thread's current device for the scope and afterwards restores exactly the context that was
// current before: another one, or none at all (then no context is left current and none is created on GPU 0, as a
// plain cudaSetDevice(0) "restore" would). Management calls from Python never leave the thread on an unexpected
// device and never touch a GPU the heap does not use.
class ScopedDevice {
 public:
  explicit ScopedDevice(int32_t gpu);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  bool ok() const { return status_ == cudaSuccess; }
  cudaError_t status() const { return status_; }

 private:
  void* previous_context_ = nullptr;  // CUcontext current before (null: none); used when the driver calls resolved
  bool restore_context_ = false;
  int previous_ = -1;  // fallback without the driver's context calls
  cudaError_t status_ = cudaSuccess;
};

// The driver's view of the calling thread (resolved at run time through cudaGetDriverEntryPointByVersion, so the
// library still links without libcuda): the device of the current context, or -1 when no context is current. False
// when the driver calls are unavailable.
bool CurrentContextDevice(int32_t* device);
// Whether `gpu`'s primary context is active (created by someone in this process). False when unavailable.
bool PrimaryContextActive(int32_t gpu, bool* active);

// A process-wide non-blocking stream per GPU for jodc's own host-initiated copies and memsets (never the legacy
// default stream, which would wait behind every kernel of blocking streams: another heap's spinning barrier).
ErrorOr<cudaStream_t> HostStream(int32_t gpu);

std::string CudaMessage(const char* what, cudaError_t e);

// Registry operations. Failures are returned as errors (common/error.h), never thrown across the C boundary.
// `placement[p]` is the CUDA device holding position p's memory (the mesh's GPUs; empty: position p on visible GPU
// p % count, which only tests driving the handlers by hand use). Only these GPUs are touched: peer access between
// them, the control block and barrier reports on placement[0]'s context. Placement never changes afterwards.
ErrorOr<int64_t> CreateHeap(int32_t world, bool deterministic, double barrier_timeout_s,
                            const std::vector<int32_t>& placement);
// A barrier timeout is valid when > 0 (+inf: wait forever); an error for NaN, zero or negative values.
Error CheckBarrierTimeout(double seconds);
Error FreeHeap(int64_t heap_id);
ErrorOr<std::shared_ptr<Heap>> FindHeap(int64_t heap_id);
ErrorOr<std::shared_ptr<Bucket>> FindBucket(const std::shared_ptr<Heap>& heap, int64_t bucket_id);
// Multi-process control blocks (ipc.cu): maps the POSIX shared-memory segment `name` (creating and zeroing it when
// `create`) and registers it with CUDA as mapped memory on `gpu`; *host / *dev are its host and kernel addresses.
Error MapSharedControl(const std::string& name, bool create, int32_t gpu, HeapControl** host, HeapControl** dev,
                       size_t* bytes);
void ReleaseSharedControl(HeapControl* host, size_t bytes);

// Registers a heap built elsewhere (ipc.cu) in the process-wide registry and gives it an id.
int64_t AddHeap(std::shared_ptr<Heap> heap);
// Fails when the bucket's byte counts overflow int64 (kInvalidArgument) or a GPU cannot hold its part
// (kResourceExhausted: the C API reports it as such, Python raises MemoryError).
// Allocates only the heap's local positions; a multi-process heap's bucket stays pending (invisible to ops) until
// every remote position is imported (ipc.cu).
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
