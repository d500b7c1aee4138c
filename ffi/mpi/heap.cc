#include "mpi/heap.h"

#include <climits>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/registry.h"

namespace jodc::mpi {
namespace {

std::atomic<int64_t> g_live_bytes{0};
std::atomic<int64_t> g_next_bucket_id{1};

HeapRegistry<Heap>& Heaps() {
  static auto* heaps = new HeapRegistry<Heap>("MPI heap");  // never destroyed: handlers may run during exit
  return *heaps;
}

constexpr int64_t kChunkBytes = int64_t{1} << 30;  // MPI counts are int: transfers go in 1 GiB pieces

// Allocates a window of `bytes` on every process of h.comm (collective), zeroed, passive-target epoch opened.
// shared: MPI_Win_allocate_shared (every process of h.comm on one node; each part allocated separately, near its
// process), else MPI_Win_allocate.
Error AllocateWindow(Heap& h, int64_t bytes, const char* what, bool shared, MPI_Win* win, char** base) {
  void* ptr = nullptr;
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "same_disp_unit", "true");
  if (shared) MPI_Info_set(info, "alloc_shared_noncontig", "true");
  int rc = shared ? MPI_Win_allocate_shared(static_cast<MPI_Aint>(bytes), 1, info, h.comm, &ptr, win)
                  : MPI_Win_allocate(static_cast<MPI_Aint>(bytes), 1, info, h.comm, &ptr, win);
  MPI_Info_free(&info);
  if (Error e = MpiCheck(rc, what, shared ? "MPI_Win_allocate_shared" : "MPI_Win_allocate"); e.failure()) return e;
  MPI_Win_set_errhandler(*win, MPI_ERRORS_RETURN);
  if (bytes > 0) std::memset(ptr, 0, bytes);
  *base = static_cast<char*>(ptr);
  if (Error e = MpiCheck(MPI_Win_lock_all(MPI_MODE_NOCHECK, *win), what, "MPI_Win_lock_all"); e.failure()) return e;
  MPI_Win_sync(*win);
  // Every process has zeroed its part before any peer may write into it.
  return MpiCheck(MPI_Barrier(h.comm), what, "MPI_Barrier");
}

void FreeWindow(MPI_Win* win) {
  if (*win == MPI_WIN_NULL) return;
  MPI_Win_unlock_all(*win);
  MPI_Win_free(win);
}

// Every process of the heap reaches the same collective step (registration, free) before it runs: each publishes its
// count of such steps and waits, with the barrier timeout, until all have reached it. A missing process then gives
// an error naming it instead of a hang inside a collective MPI call.
Error Rendezvous(Heap& h, const char* what) {
  std::unique_lock<std::mutex> lock(h.mu);
  if (!h.poisoned.empty()) return InvalidArgument(std::string("jodc ") + what + ": " + h.poisoned);
  const int64_t epoch = ++h.collective_epoch;
  lock.unlock();
  if (Error e = PublishControlWord(h, h.freeing_disp(h.rank), epoch); e.failure()) return e;
  lock.lock();
  auto all_there = [&] {
    for (int32_t r = 0; r < h.nprocs; ++r)
      if (h.seen[1 + h.world + r] < epoch) return false;
    return true;
  };
  const double timeout_s = h.barrier_timeout_s.load();
  Error mpi_err;
  const int rc = WaitControl(h, lock, timeout_s, all_there, &mpi_err);
  if (rc == 0) return Error::Success();
  if (rc == 1) return InvalidArgument(std::string("jodc ") + what + ": " + h.poisoned);
  std::string msg;
  if (rc == 3) {
    msg = mpi_err.message();
  } else {
    std::ostringstream m;
    m << "jodc " << what << " on heap " << h.id << ": process(es) [";
    bool first = true;
    for (int32_t r = 0; r < h.nprocs; ++r) {
      if (h.seen[1 + h.world + r] < epoch) {
        m << (first ? "" : ", ") << r;
        first = false;
      }
    }
    m << "] did not reach it within " << timeout_s << " s (process " << h.rank
      << " waited); collective heap calls (register, free) must be made by every process in the same order";
    msg = m.str();
  }
  lock.unlock();
  return InvalidArgument(Poison(h, msg));
}

}  // namespace

std::string MpiErrorString(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, len);
}

Error MpiCheck(int code, const char* op, const char* call) {
  if (code == MPI_SUCCESS) return Error::Success();
  return Error::Internal(std::string("jodc ") + op + ": " + call + " failed: " + MpiErrorString(code));
}

int GetBytes(void* dst, int64_t bytes, int32_t rank, int64_t disp, MPI_Win win) {
  char* d = static_cast<char*>(dst);
  for (int64_t off = 0; off < bytes; off += kChunkBytes) {
    const int c = static_cast<int>(std::min(kChunkBytes, bytes - off));
    int rc = MPI_Get(d + off, c, MPI_BYTE, rank, static_cast<MPI_Aint>(disp + off), c, MPI_BYTE, win);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_Win_flush(rank, win);
}

int PutBytes(const void* src, int64_t bytes, int32_t rank, int64_t disp, MPI_Win win) {
  const char* s = static_cast<const char*>(src);
  for (int64_t off = 0; off < bytes; off += kChunkBytes) {
    const int c = static_cast<int>(std::min(kChunkBytes, bytes - off));
    int rc = MPI_Put(s + off, c, MPI_BYTE, rank, static_cast<MPI_Aint>(disp + off), c, MPI_BYTE, win);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;  // the caller flushes
}

int AccumulateF32(const float* src, int64_t n, int32_t rank, int64_t disp, MPI_Op op, MPI_Win win) {
  constexpr int64_t kChunk = kChunkBytes / 4;
  for (int64_t off = 0; off < n; off += kChunk) {
    const int c = static_cast<int>(std::min(kChunk, n - off));
    int rc = MPI_Accumulate(src + off, c, MPI_FLOAT, rank, static_cast<MPI_Aint>(disp + off * 4), c, MPI_FLOAT, op,
                            win);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;  // the caller flushes
}

int ReadF32Atomic(float* dst, int64_t n, int32_t rank, int64_t disp, MPI_Win win) {
  constexpr int64_t kChunk = kChunkBytes / 4;
  MPI_Win_sync(win);
  for (int64_t off = 0; off < n; off += kChunk) {
    const int c = static_cast<int>(std::min(kChunk, n - off));
    int rc = MPI_Get_accumulate(nullptr, 0, MPI_FLOAT, dst + off, c, MPI_FLOAT, rank,
                                static_cast<MPI_Aint>(disp + off * 4), c, MPI_FLOAT, MPI_NO_OP, win);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_Win_flush(rank, win);
}

int ReadAccumulator(const Heap& h, const Bucket& b, int32_t device, float* out) {
  const int32_t r = h.dev_rank[device], slot = h.dev_slot[device];
  const int64_t n = b.layout.shard_numel;
  int rc = ReadF32Atomic(out, n, r, b.acc_disp(r, slot), b.win);
  if (rc != MPI_SUCCESS || !h.deterministic) return rc;
  // Fixed order, as on one process: accumulator (host-set base) + source 0 + source 1 + ...
  std::vector<float> slot_buf(n);
  for (int32_t s = 0; s < h.world; ++s) {
    rc = ReadF32Atomic(slot_buf.data(), n, r, b.landing_disp(r, slot, s), b.win);
    if (rc != MPI_SUCCESS) return rc;
    for (int64_t i = 0; i < n; ++i) out[i] += slot_buf[i];
  }
  return MPI_SUCCESS;
}

int ZeroAccumulator(const Heap& h, const Bucket& b, int32_t device) {
  const int32_t r = h.dev_rank[device], slot = h.dev_slot[device];
  const int64_t n = b.layout.shard_numel;
  std::vector<float> zeros(n, 0.0f);
  int rc = AccumulateF32(zeros.data(), n, r, b.acc_disp(r, slot), MPI_REPLACE, b.win);
  for (int32_t s = 0; rc == MPI_SUCCESS && h.deterministic && s < h.world; ++s)
    rc = AccumulateF32(zeros.data(), n, r, b.landing_disp(r, slot, s), MPI_REPLACE, b.win);
  if (rc != MPI_SUCCESS) return rc;
  return MPI_Win_flush(r, b.win);
}

Error PublishControlWord(Heap& h, int64_t disp, int64_t value) {
  for (int32_t r = 0; r < h.nprocs; ++r) {
    int rc = MPI_Accumulate(&value, 1, MPI_INT64_T, r, static_cast<MPI_Aint>(disp), 1, MPI_INT64_T, MPI_REPLACE,
                            h.ctl);
    if (Error e = MpiCheck(rc, "control", "MPI_Accumulate"); e.failure()) return e;
  }
  return MpiCheck(MPI_Win_flush_all(h.ctl), "control", "MPI_Win_flush_all");
}

Error PollControl(Heap& h) {
  std::vector<int64_t> words(h.ctl_words());
  MPI_Win_sync(h.ctl);
  int rc = MPI_Get_accumulate(nullptr, 0, MPI_INT64_T, words.data(), static_cast<int>(words.size()), MPI_INT64_T,
                              h.rank, 0, static_cast<int>(words.size()), MPI_INT64_T, MPI_NO_OP, h.ctl);
  if (rc == MPI_SUCCESS) rc = MPI_Win_flush(h.rank, h.ctl);
  if (Error e = MpiCheck(rc, "control", "MPI_Get_accumulate"); e.failure()) return e;
  std::string abort_msg;
  if (words[0] != 0) {
    const int32_t from = static_cast<int32_t>(words[0] - 1);
    std::vector<char> text(kAbortMessageBytes + 1, '\0');
    if (from >= 0 && from < h.nprocs &&
        GetBytes(text.data(), kAbortMessageBytes, h.rank, h.message_disp(from), h.ctl) == MPI_SUCCESS) {
      abort_msg = "process " + std::to_string(from) + " failed: " + std::string(text.data());
    } else {
      abort_msg = "a peer process failed (abort word " + std::to_string(words[0]) + ")";
    }
  }
  std::lock_guard<std::mutex> lock(h.mu);
  h.seen = std::move(words);
  if (!abort_msg.empty() && h.poisoned.empty()) {
    h.poisoned = abort_msg;
    h.cv.notify_all();
  }
  return Error::Success();
}

std::string Poison(Heap& h, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lock(h.mu);
    if (!h.poisoned.empty()) return h.poisoned;  // the first failure is the one reported
    h.poisoned = msg;
    h.cv.notify_all();
  }
  if (h.windows_freed) return msg;
  // Tell the peers: message first, then the abort word (they read the message once they see the word).
  std::vector<char> text(kAbortMessageBytes, '\0');
  std::memcpy(text.data(), msg.data(), std::min<size_t>(msg.size(), kAbortMessageBytes - 1));
  for (int32_t r = 0; r < h.nprocs; ++r) {
    if (r == h.rank) continue;
    if (PutBytes(text.data(), kAbortMessageBytes, r, h.message_disp(h.rank), h.ctl) == MPI_SUCCESS)
      MPI_Win_flush(r, h.ctl);
  }
  std::string ignored;
  const int64_t word = h.rank + 1;
  for (int32_t r = 0; r < h.nprocs; ++r) {
    if (r == h.rank) continue;
    if (MPI_Accumulate(&word, 1, MPI_INT64_T, r, 0, 1, MPI_INT64_T, MPI_REPLACE, h.ctl) == MPI_SUCCESS)
      MPI_Win_flush(r, h.ctl);
  }
  return msg;
}

ErrorOr<int64_t> CreateHeap(MPI_Comm user_comm, int32_t world, bool deterministic, double timeout_s,
                            const int32_t* dev_rank, const int32_t* dev_slot, bool progress_thread) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    return Fail(InvalidArgument("jodc MPI heap: MPI is not initialised (import mpi4py.MPI first) or already finalised"));
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    return Fail(InvalidArgument("jodc MPI heap: MPI was initialised without MPI_THREAD_MULTIPLE (got level " +
                                std::to_string(provided) + "); XLA runs a process's ops on several threads. Leave "
                                "mpi4py.rc.thread_level at 'multiple'"));
  }
  if (world < 1) return Fail(InvalidArgument("jodc MPI heap: world size must be >= 1, got " + std::to_string(world)));
  if (!(timeout_s > 0)) return Fail(InvalidArgument("jodc MPI heap: barrier timeout must be > 0 seconds"));
  auto h = std::make_shared<Heap>();
  h->world = world;
  h->deterministic = deterministic;
  h->barrier_timeout_s = timeout_s;
  if (Error e = MpiCheck(MPI_Comm_dup(user_comm, &h->comm), "MPI heap", "MPI_Comm_dup"); e.failure()) return Fail(e);
  MPI_Comm_set_errhandler(h->comm, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(h->comm, &rank);
  MPI_Comm_size(h->comm, &size);
  h->rank = rank;
  h->nprocs = size;
  h->dev_rank.assign(dev_rank, dev_rank + world);
  h->dev_slot.assign(dev_slot, dev_slot + world);
  h->rank_devices.assign(size, 0);
  for (int32_t d = 0; d < world; ++d) {
    if (dev_rank[d] < 0 || dev_rank[d] >= size) {
      MPI_Comm_free(&h->comm);
      return Fail(InvalidArgument("jodc MPI heap: device " + std::to_string(d) + " placed on process " +
                                  std::to_string(dev_rank[d]) + ", outside the communicator's " +
                                  std::to_string(size) + " processes"));
    }
    h->rank_devices[dev_rank[d]]++;
  }
  for (int32_t d = 0; d < world; ++d) {
    if (dev_slot[d] < 0 || dev_slot[d] >= h->rank_devices[dev_rank[d]]) {
      MPI_Comm_free(&h->comm);
      return Fail(InvalidArgument("jodc MPI heap: device " + std::to_string(d) + " has local slot " +
                                  std::to_string(dev_slot[d]) + " but process " + std::to_string(dev_rank[d]) +
                                  " holds " + std::to_string(h->rank_devices[dev_rank[d]]) + " devices"));
    }
  }
  // Shared-memory bucket windows when every process is on this node, and all processes agree (the environment
  // switch is per process; the allocation call must be the same everywhere).
  {
    MPI_Comm node = MPI_COMM_NULL;
    int node_size = 0;
    if (MPI_Comm_split_type(h->comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
      MPI_Comm_size(node, &node_size);
      MPI_Comm_free(&node);
    }
    const char* env = std::getenv("JODC_MPI_SHARED_MEMORY");
    const bool refused = env != nullptr && std::string(env) == "0";
    int mine = (node_size == size && !refused) ? 1 : 0, all = 0;
    if (Error e = MpiCheck(MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, h->comm), "MPI heap", "MPI_Allreduce");
        e.failure()) {
      MPI_Comm_free(&h->comm);
      return Fail(e);
    }
    h->shared_memory = all == 1;
  }
  h->arrivals.assign(world, 0);
  h->pair_arrivals.assign(static_cast<size_t>(world) * world, 0);
  h->seen.assign(h->ctl_words(), 0);
  char* base = nullptr;
  const int64_t ctl_bytes = h->ctl_words() * 8 + int64_t{h->nprocs} * kAbortMessageBytes;
  if (Error e = AllocateWindow(*h, ctl_bytes, "MPI heap", /*shared=*/false, &h->ctl, &base); e.failure()) {
    MPI_Comm_free(&h->comm);
    return Fail(e);
  }
  h->ctl_base = reinterpret_cast<int64_t*>(base);
  g_live_bytes += ctl_bytes;
  if (progress_thread) {
    // Software RMA transports (e.g. osc/ucx over TCP) only progress a target's side while it is inside MPI: this
    // thread enters MPI every ~50 us so peers' gets and accumulates complete while this process computes.
    Heap* raw = h.get();
    h->progress = std::thread([raw] {
      while (!raw->stop_progress.load(std::memory_order_relaxed)) {
        int flag = 0;
        MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, raw->comm, &flag, MPI_STATUS_IGNORE);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    });
  }
  return Heaps().Add(h);
}

ErrorOr<std::shared_ptr<Heap>> FindHeap(int64_t heap_id) { return Heaps().Find(heap_id, "(freed?)"); }

ErrorOr<std::shared_ptr<Bucket>> FindBucket(Heap& heap, int64_t bucket_id) {
  return Heaps().FindBucket(heap, bucket_id);
}

Error FreeHeap(int64_t heap_id) {
  auto found = FindHeap(heap_id);
  if (!found.has_value()) return found.error();
  const std::shared_ptr<Heap>& h = *found;
  // Free is collective: windows are released only when every process got here; otherwise (a peer failed or never
  // frees) they are left allocated rather than hanging in MPI_Win_free. Either way the heap is gone for this process.
  const bool together = Rendezvous(*h, "free").success();
  Heaps().Remove(heap_id, "");
  std::map<int64_t, std::shared_ptr<Bucket>> buckets;
  {
    std::lock_guard<std::mutex> lock(h->mu);
    if (h->poisoned.empty()) h->poisoned = "MPI heap " + std::to_string(heap_id) + " was freed";
    buckets.swap(h->buckets);
    h->cv.notify_all();
  }
  h->stop_progress = true;
  if (h->progress.joinable()) h->progress.join();
  for (auto& [id, b] : buckets) g_live_bytes -= b->local_bytes;
  g_live_bytes -= h->ctl_words() * 8 + int64_t{h->nprocs} * kAbortMessageBytes;
  if (together) {
    for (auto& [id, b] : buckets) FreeWindow(&b->win);
    h->windows_freed = true;
    FreeWindow(&h->ctl);
    MPI_Comm_free(&h->comm);
  }
  return Error::Success();
}

ErrorOr<int64_t> RegisterBucket(int64_t heap_id, int64_t numel, Dtype master) {
  auto found = FindHeap(heap_id);
  if (!found.has_value()) return Fail(found.error());
  const std::shared_ptr<Heap>& h = *found;
  if (numel < 1) return Fail(InvalidArgument("bucket size must be >= 1 element, got " + std::to_string(numel)));
  if (Error e = Rendezvous(*h, "register"); e.failure()) return Fail(e);
  auto b = std::make_shared<Bucket>();
  b->id = g_next_bucket_id++;
  b->master = master;
  b->layout = MakeLayout(numel, h->world, DtypeBytes(master));
  // Per process: [shards: n_r x shard][accumulators: n_r x fp32 shard][landing: n_r x world x fp32 shard].
  b->acc_offset.assign(h->nprocs, 0);
  b->landing_offset.assign(h->nprocs, 0);
  int64_t shard_bytes = 0, acc_bytes = 0, my_bytes = 0;
  bool ok = b->layout.shard_numel >= 1 &&  // MakeLayout's -1: the padded size overflows
            CheckedMul(b->layout.shard_numel, DtypeBytes(master), &shard_bytes) &&
            CheckedMul(b->layout.shard_numel, 4, &acc_bytes);
  for (int32_t r = 0; ok && r < h->nprocs; ++r) {
    const int64_t n_r = h->rank_devices[r];
    int64_t shards = 0, accs = 0, landing = 0, total = 0;
    ok = CheckedMul(n_r, shard_bytes, &shards) && CheckedMul(n_r, acc_bytes, &accs);
    if (ok && h->deterministic) ok = CheckedMul(accs, h->world, &landing);
    ok = ok && CheckedRoundUp(shards, kShardAlignBytes, &shards) && CheckedAdd(shards, accs, &total) && CheckedAdd(total, landing, &total);
    b->acc_offset[r] = shards;
    b->landing_offset[r] = shards + accs;
    if (r == h->rank) my_bytes = total;
  }
  if (!ok) {
    return Fail(InvalidArgument("bucket of " + std::to_string(numel) +
                                " elements is too large: its window size overflows int64"));
  }
  if (Error e = AllocateWindow(*h, my_bytes, "register", h->shared_memory, &b->win, &b->base); e.failure()) {
    Poison(*h, e.message());
    return Fail(e);
  }
  if (h->shared_memory) {
    b->peer_base.assign(h->nprocs, nullptr);
    for (int32_t r = 0; r < h->nprocs; ++r) {
      MPI_Aint size = 0;
      int disp_unit = 0;
      void* ptr = nullptr;
      if (Error e = MpiCheck(MPI_Win_shared_query(b->win, r, &size, &disp_unit, &ptr), "register",
                             "MPI_Win_shared_query");
          e.failure()) {
        Poison(*h, e.message());  // the window stays allocated: freeing it is collective and the peers may not be here
        return Fail(e);
      }
      b->peer_base[r] = size > 0 ? static_cast<char*>(ptr) : nullptr;
    }
  }
  b->local_bytes = my_bytes;
  g_live_bytes += my_bytes;
  std::lock_guard<std::mutex> lock(h->mu);
  h->buckets[b->id] = b;
  return b->id;
}

Error FreeBucket(int64_t heap_id, int64_t bucket_id) {
  auto h = FindHeap(heap_id);
  if (!h.has_value()) return h.error();
  auto b = FindBucket(**h, bucket_id);
  if (!b.has_value()) return b.error();
  Error together = Rendezvous(**h, "free bucket");
  {
    std::lock_guard<std::mutex> lock((*h)->mu);
    (*h)->buckets.erase(bucket_id);
  }
  g_live_bytes -= (*b)->local_bytes;
  if (together.success()) FreeWindow(&(*b)->win);
  return together;
}

int64_t LiveHeapCount() { return Heaps().Count(); }

int64_t LiveHeapBytes() { return g_live_bytes.load(); }

ErrorOr<OpTarget> ResolveTarget(const char* op, int64_t heap_id, int64_t bucket_id, int32_t device,
                                bool must_be_local) {
  OpTarget out;
  auto found = FindHeap(heap_id);
  if (!found.has_value()) return Fail(ForOp(op, found.error()));
  out.heap = *found;
  Heap& h = *out.heap;
  {
    std::lock_guard<std::mutex> lock(h.mu);
    if (!h.poisoned.empty()) return Fail(InvalidArgument(std::string("jodc ") + op + ": " + h.poisoned));
  }
  if (device < 0 || device >= h.world) {
    return Fail(InvalidArgument(std::string("jodc ") + op + ": device index " + std::to_string(device) +
                                " outside [0, " + std::to_string(h.world) + ") of MPI heap " +
                                std::to_string(heap_id)));
  }
  if (must_be_local && !h.is_local(device)) {
    return Fail(InvalidArgument(std::string("jodc ") + op + ": device " + std::to_string(device) +
                                " belongs to process " + std::to_string(h.dev_rank[device]) +
                                ", but this is process " + std::to_string(h.rank) +
                                " (the mesh's device order does not match the heap's placement)"));
  }
  if (bucket_id >= 0) {
    auto bucket = FindBucket(h, bucket_id);
    if (!bucket.has_value()) return Fail(ForOp(op, bucket.error()));
    out.bucket = *bucket;
  }
  return out;
}

}  // namespace jodc::mpi
