// The MPI symmetric heap: a heap whose devices live in several processes. Every process holds the shards, fp32
// accumulators (and, in deterministic mode, per-source landing slots) of its own devices in one MPI window per
// bucket (MPI_Win_allocate, passive target, MPI_Win_lock_all once); peers reach them with one-sided operations:
// gather = MPI_Get from the owners, scatter_accumulate = MPI_Accumulate(MPI_SUM) into the owners' accumulators.
//
// A small control window per heap carries, on every process, an abort word, the barrier generation of every device
// (each device publishes its own arrivals to all processes) and a "freeing" flag per process, so barriers, aborts
// and collective frees can be waited for with a timeout (MPI_Barrier cannot time out).
//
// When every process of the heap shares one node's memory, the bucket windows are allocated with
// MPI_Win_allocate_shared instead, and every process maps its peers' parts (MPI_Win_shared_query): gather then
// reads a peer's shard with a plain (streaming) copy instead of an MPI_Get. The window stays a regular RMA window,
// so everything else (accumulates, atomic reads, host access) goes through MPI as before. Heaps spanning nodes keep
// MPI_Win_allocate; JODC_MPI_SHARED_MEMORY=0 in the environment forces that path on one node too.
//
// Built into its own shared library (jodc/_ffi_mpi.so, linked against libmpi) and loaded by jodc/ops/transports/mpi_library.py only
// when a heap spans processes: the CPU extension never depends on MPI.
#ifndef JODC_FFI_MPI_HEAP_H_
#define JODC_FFI_MPI_HEAP_H_

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.h"
#include "common/error.h"
#include "common/layout.h"

namespace jodc::mpi {

// Bytes of abort message each process may leave in every peer's control window.
constexpr int64_t kAbortMessageBytes = 1024;

struct Heap;

struct Bucket {
  int64_t id = 0;
  BucketLayout layout;
  Dtype master = Dtype::kF32;
  MPI_Win win = MPI_WIN_NULL;
  char* base = nullptr;        // this process's part of the window
  int64_t local_bytes = 0;     // size of that part
  std::vector<int64_t> acc_offset;      // per rank: byte offset of its accumulators in its window part
  std::vector<int64_t> landing_offset;  // per rank: byte offset of its landing slots (deterministic mode)
  std::vector<char*> peer_base;         // per rank: its window part mapped here (shared-memory heaps), else empty

  int64_t shard_bytes() const { return layout.shard_numel * DtypeBytes(master); }
  int64_t acc_bytes() const { return layout.shard_numel * static_cast<int64_t>(sizeof(float)); }
  // Byte displacements inside the window part of the process that holds local slot `slot`.
  int64_t shard_disp(int32_t slot) const { return slot * shard_bytes(); }
  int64_t acc_disp(int32_t rank, int32_t slot) const { return acc_offset[rank] + slot * acc_bytes(); }
  int64_t landing_disp(int32_t rank, int32_t slot, int32_t source) const {
    return landing_offset[rank] + (static_cast<int64_t>(slot) * layout.world + source) * acc_bytes();
  }
};

struct Heap {
  int64_t id = 0;
  int32_t world = 0;
  bool deterministic = false;
  std::atomic<double> barrier_timeout_s{300.0};  // +inf: wait forever

  MPI_Comm comm = MPI_COMM_NULL;  // a duplicate of the caller's communicator
  int32_t rank = 0, nprocs = 0;
  std::vector<int32_t> dev_rank, dev_slot;  // per global device: owning process, local slot there
  std::vector<int32_t> rank_devices;        // per process: how many devices of the heap it holds
  bool shared_memory = false;               // all processes on one node: bucket windows are shared memory

  // Control window: int64 words [abort][arrivals: world][freeing: nprocs][pair arrivals: world * world], then nprocs
  // abort messages. Pair word (from, to) is the number of group barriers device `from` has entered with `to` among
  // the members, written by `from` into the window of `to`'s process (group_barrier.cc).
  MPI_Win ctl = MPI_WIN_NULL;
  int64_t* ctl_base = nullptr;
  int64_t ctl_words() const { return 1 + world + nprocs + static_cast<int64_t>(world) * world; }
  int64_t arrivals_disp(int32_t device) const { return (1 + device) * 8; }
  int64_t freeing_disp(int32_t r) const { return (1 + world + r) * 8; }
  int64_t pair_word(int32_t from, int32_t to) const {
    return 1 + world + nprocs + static_cast<int64_t>(from) * world + to;
  }
  int64_t message_disp(int32_t r) const { return ctl_words() * 8 + r * kAbortMessageBytes; }

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  std::map<int64_t, std::shared_ptr<Bucket>> buckets;
  std::vector<uint64_t> arrivals;  // per global device (only this process's are counted here)
  std::vector<uint64_t> pair_arrivals;  // [from * world + to]: group barriers entered, rows of this process's devices
  std::vector<int64_t> seen;       // last polled control words (abort, arrivals, freeing)
  bool polling = false;            // one thread at a time polls the control window
  std::string poisoned;            // non-empty after a failure: every later op fails with it
  bool windows_freed = false;
  int64_t collective_epoch = 0;   // collective steps (register, free) this process has entered

  std::thread progress;
  std::atomic<bool> stop_progress{false};

  bool is_local(int32_t device) const { return dev_rank[device] == rank; }
};

// Registry (process-wide). Failures are returned as errors (common/error.h), never thrown across the C or FFI
// boundary.
ErrorOr<int64_t> CreateHeap(MPI_Comm user_comm, int32_t world, bool deterministic, double timeout_s,
                            const int32_t* dev_rank, const int32_t* dev_slot, bool progress_thread);
Error FreeHeap(int64_t heap_id);
ErrorOr<std::shared_ptr<Heap>> FindHeap(int64_t heap_id);
ErrorOr<std::shared_ptr<Bucket>> FindBucket(Heap& heap, int64_t bucket_id);
ErrorOr<int64_t> RegisterBucket(int64_t heap_id, int64_t numel, Dtype master);
Error FreeBucket(int64_t heap_id, int64_t bucket_id);
int64_t LiveHeapCount();
int64_t LiveHeapBytes();

// Resolves heap + bucket and checks that `device` is one of this process's devices (handlers only run there).
struct OpTarget {
  std::shared_ptr<Heap> heap;
  std::shared_ptr<Bucket> bucket;  // null for heap-level ops
};
ErrorOr<OpTarget> ResolveTarget(const char* op, int64_t heap_id, int64_t bucket_id, int32_t device,
                                bool must_be_local);

// Marks the heap failed with `msg` and tells every peer process (abort word + message in their control windows),
// best effort. Returns msg.
std::string Poison(Heap& h, const std::string& msg);

// Reads this process's control words atomically (MPI_Get_accumulate NO_OP) into h.seen; if a peer set the abort
// word, poisons the heap with its message. Call with h.mu NOT held. Fails on an MPI error.
Error PollControl(Heap& h);

// Publishes the int64 `value` at byte displacement `disp` of every process's control window (atomic replace) and
// flushes. Fails on an MPI error.
Error PublishControlWord(Heap& h, int64_t disp, int64_t value);

// Waits (h.mu held through `lock`) until `done()` holds on the polled control words, the heap is poisoned, or the
// deadline passes. One waiter at a time polls; the others sleep on h.cv. Returns 0: done, 1: poisoned, 2: timeout,
// 3: MPI error (*err set).
template <typename Done>
int WaitControl(Heap& h, std::unique_lock<std::mutex>& lock, double timeout_s, Done done, Error* err);

// The master shard of `device` mapped into this process (any device of a shared-memory heap, this process's own
// devices otherwise), or nullptr when it is only reachable through MPI.
inline const char* MappedShard(const Heap& h, const Bucket& b, int32_t device) {
  const int32_t r = h.dev_rank[device];
  const char* base = r == h.rank ? b.base : (b.peer_base.empty() ? nullptr : b.peer_base[r]);
  return base == nullptr ? nullptr : base + b.shard_disp(h.dev_slot[device]);
}

// MPI error code -> text.
std::string MpiErrorString(int code);
// An MPI return code as an error: kInternal "jodc <op>: <call> failed: <text>" unless it is MPI_SUCCESS.
Error MpiCheck(int code, const char* op, const char* call);

// One-sided transfers of any byte size (MPI counts are int: large transfers are split in 1 GiB pieces).
int GetBytes(void* dst, int64_t bytes, int32_t rank, int64_t disp, MPI_Win win);
int PutBytes(const void* src, int64_t bytes, int32_t rank, int64_t disp, MPI_Win win);
int AccumulateF32(const float* src, int64_t n, int32_t rank, int64_t disp, MPI_Op op, MPI_Win win);
int ReadF32Atomic(float* dst, int64_t n, int32_t rank, int64_t disp, MPI_Win win);  // Get_accumulate NO_OP

// Host/handler helpers on a device's accumulator (any device: remote ones through the window).
int ReadAccumulator(const Heap& h, const Bucket& b, int32_t device, float* out);
int ZeroAccumulator(const Heap& h, const Bucket& b, int32_t device);

}  // namespace jodc::mpi

#include "mpi/wait_control.h"

#endif  // JODC_FFI_MPI_HEAP_H_
