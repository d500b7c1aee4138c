// The library's C API for Python (jodc/ops/_mpi.py, ctypes): heap and bucket management and host access to any
// device's shard or accumulator (remote ones through the window). Fallible functions return 0 on success and
// otherwise copy their message into (err, err_cap). Collective functions (create, register, free) must be called
// by every process of the communicator in the same order.
#include <cstring>
#include <string>

#include "mpi/handlers.h"
#include "mpi/heap.h"

using namespace jodc;
using namespace jodc::mpi;

namespace {

int Fail(const std::string& msg, char* err, int64_t cap) {
  if (err != nullptr && cap > 0) {
    const size_t n = std::min<size_t>(msg.size(), static_cast<size_t>(cap - 1));
    std::memcpy(err, msg.data(), n);
    err[n] = '\0';
  }
  return 1;
}

bool Lookup(int64_t heap_id, int64_t bucket_id, int32_t device, std::shared_ptr<Heap>* h,
            std::shared_ptr<Bucket>* b, std::string* err) {
  *h = FindHeap(heap_id, err);
  if (!*h) return false;
  *b = FindBucket(**h, bucket_id, err);
  if (!*b) return false;
  if (device < 0 || device >= (*h)->world) {
    *err = "device " + std::to_string(device) + " outside [0, " + std::to_string((*h)->world) + ")";
    return false;
  }
  return true;
}

}  // namespace

extern "C" {

JODC_MPI_EXPORT int64_t jodc_mpi_shard_numel(int64_t numel, int32_t world, int32_t master_bytes) {
  return ShardNumel(numel, world, master_bytes);
}
JODC_MPI_EXPORT int64_t jodc_mpi_live_heaps() { return LiveHeapCount(); }
JODC_MPI_EXPORT int64_t jodc_mpi_live_bytes() { return LiveHeapBytes(); }

// The library's MPI: "<MPI_Get_library_version>" so Python can check it is the one mpi4py uses.
JODC_MPI_EXPORT int jodc_mpi_library_version(char* out, int64_t cap, char* err, int64_t err_cap) {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return Fail("MPI_Get_library_version failed", err, err_cap);
  Fail(std::string(text, len), out, cap);  // copies the text
  return 0;
}

JODC_MPI_EXPORT int jodc_mpi_heap_create(int64_t comm_f, int32_t world, int32_t deterministic, double timeout_s,
                                         const int32_t* dev_rank, const int32_t* dev_slot, int32_t progress_thread,
                                         int64_t* heap_id, char* err, int64_t err_cap) {
  std::string e;
  MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(comm_f));
  int64_t id = CreateHeap(comm, world, deterministic != 0, timeout_s, dev_rank, dev_slot, progress_thread != 0, &e);
  if (id < 0) return Fail(e, err, err_cap);
  *heap_id = id;
  return 0;
}

JODC_MPI_EXPORT int jodc_mpi_heap_free(int64_t heap_id, char* err, int64_t err_cap) {
  std::string e;
  return FreeHeap(heap_id, &e) ? 0 : Fail(e, err, err_cap);
}

JODC_MPI_EXPORT int jodc_mpi_heap_set_barrier_timeout(int64_t heap_id, double timeout_s, char* err, int64_t err_cap) {
  std::string e;
  auto h = FindHeap(heap_id, &e);
  if (!h) return Fail(e, err, err_cap);
  if (!(timeout_s > 0)) return Fail("barrier timeout must be > 0 seconds", err, err_cap);
  h->barrier_timeout_s = timeout_s;
  return 0;
}

// Per device of the heap (every process's), the generation it last published; out holds `world` entries.
JODC_MPI_EXPORT int jodc_mpi_heap_generations(int64_t heap_id, uint64_t* out, int32_t cap, int32_t* world, char* err,
                                              int64_t err_cap) {
  std::string e;
  auto h = FindHeap(heap_id, &e);
  if (!h) return Fail(e, err, err_cap);
  if (!PollControl(*h, &e)) return Fail(e, err, err_cap);
  std::lock_guard<std::mutex> lock(h->mu);
  *world = h->world;
  if (cap < h->world) return Fail("generation buffer too small", err, err_cap);
  for (int32_t d = 0; d < h->world; ++d) out[d] = static_cast<uint64_t>(h->seen[1 + d]);
  return 0;
}

// The heap's failure message ("" while healthy), a peer's abort included; len gets its full length.
JODC_MPI_EXPORT int jodc_mpi_heap_poisoned(int64_t heap_id, char* out, int64_t cap, int64_t* len, char* err,
                                           int64_t err_cap) {
  std::string e;
  auto h = FindHeap(heap_id, &e);
  if (!h) return Fail(e, err, err_cap);
  PollControl(*h, &e);  // a peer's abort word counts too (best effort: an MPI error here is reported by the ops)
  std::lock_guard<std::mutex> lock(h->mu);
  *len = static_cast<int64_t>(h->poisoned.size());
  Fail(h->poisoned, out, cap);
  return 0;
}

// Marks the heap failed with `msg` and sets the abort word of every peer (e.g. a Python-side failure).
JODC_MPI_EXPORT int jodc_mpi_heap_abort(int64_t heap_id, const char* msg, char* err, int64_t err_cap) {
  std::string e;
  auto h = FindHeap(heap_id, &e);
  if (!h) return Fail(e, err, err_cap);
  Poison(*h, msg);
  return 0;
}

JODC_MPI_EXPORT int jodc_mpi_bucket_register(int64_t heap_id, int64_t numel, const char* dtype, int64_t* bucket_id,
                                             char* err, int64_t err_cap) {
  Dtype d;
  if (!ParseDtype(dtype, &d)) return Fail(std::string("master dtype must be float32 or bfloat16, got ") + dtype, err,
                                          err_cap);
  std::string e;
  int64_t id = RegisterBucket(heap_id, numel, d, &e);
  if (id < 0) return Fail(e, err, err_cap);
  *bucket_id = id;
  return 0;
}

JODC_MPI_EXPORT int jodc_mpi_bucket_free(int64_t heap_id, int64_t bucket_id, char* err, int64_t err_cap) {
  std::string e;
  return FreeBucket(heap_id, bucket_id, &e) ? 0 : Fail(e, err, err_cap);
}

JODC_MPI_EXPORT int jodc_mpi_bucket_shard_numel(int64_t heap_id, int64_t bucket_id, int64_t* out, char* err,
                                                int64_t err_cap) {
  std::string e;
  auto h = FindHeap(heap_id, &e);
  if (!h) return Fail(e, err, err_cap);
  auto b = FindBucket(*h, bucket_id, &e);
  if (!b) return Fail(e, err, err_cap);
  *out = b->layout.shard_numel;
  return 0;
}

JODC_MPI_EXPORT int jodc_mpi_bucket_get_shard(int64_t heap_id, int64_t bucket_id, int32_t device, void* dst,
                                              int64_t bytes, char* err, int64_t err_cap) {
  std::shared_ptr<Heap> h;
  std::shared_ptr<Bucket> b;
  std::string e;
  if (!Lookup(heap_id, bucket_id, device, &h, &b, &e)) return Fail(e, err, err_cap);
  if (bytes != b->shard_bytes()) return Fail("shard needs " + std::to_string(b->shard_bytes()) + " bytes", err, err_cap);
  const int32_t r = h->dev_rank[device];
  MPI_Win_sync(b->win);
  int rc = GetBytes(dst, bytes, r, b->shard_disp(h->dev_slot[device]), b->win);
  return MpiOk(rc, "get_shard", "MPI_Get", &e) ? 0 : Fail(e, err, err_cap);
}

JODC_MPI_EXPORT int jodc_mpi_bucket_set_shard(int64_t heap_id, int64_t bucket_id, int32_t device, const void* src,
                                              int64_t bytes, char* err, int64_t err_cap) {
  std::shared_ptr<Heap> h;
  std::shared_ptr<Bucket> b;
  std::string e;
  if (!Lookup(heap_id, bucket_id, device, &h, &b, &e)) return Fail(e, err, err_cap);
  if (bytes != b->shard_bytes())
    return Fail("shard needs " + std::to_string(b->shard_bytes()) + " bytes, got " + std::to_string(bytes), err,
                err_cap);
  const int32_t r = h->dev_rank[device];
  int rc = PutBytes(src, bytes, r, b->shard_disp(h->dev_slot[device]), b->win);
  if (rc == MPI_SUCCESS) rc = MPI_Win_flush(r, b->win);
  if (rc == MPI_SUCCESS) rc = MPI_Win_sync(b->win);
  return MpiOk(rc, "set_shard", "MPI_Put", &e) ? 0 : Fail(e, err, err_cap);
}

JODC_MPI_EXPORT int jodc_mpi_bucket_get_accumulator(int64_t heap_id, int64_t bucket_id, int32_t device, float* dst,
                                                    int64_t bytes, char* err, int64_t err_cap) {
  std::shared_ptr<Heap> h;
  std::shared_ptr<Bucket> b;
  std::string e;
  if (!Lookup(heap_id, bucket_id, device, &h, &b, &e)) return Fail(e, err, err_cap);
  if (bytes != b->acc_bytes()) return Fail("accumulator needs " + std::to_string(b->acc_bytes()) + " bytes", err,
                                           err_cap);
  int rc = ReadAccumulator(*h, *b, device, dst);
  return MpiOk(rc, "get_accumulator", "MPI_Get_accumulate", &e) ? 0 : Fail(e, err, err_cap);
}

JODC_MPI_EXPORT int jodc_mpi_bucket_zero_accumulator(int64_t heap_id, int64_t bucket_id, int32_t device, char* err,
                                                     int64_t err_cap) {
  std::shared_ptr<Heap> h;
  std::shared_ptr<Bucket> b;
  std::string e;
  if (!Lookup(heap_id, bucket_id, device, &h, &b, &e)) return Fail(e, err, err_cap);
  int rc = ZeroAccumulator(*h, *b, device);
  return MpiOk(rc, "zero_accumulator", "MPI_Accumulate", &e) ? 0 : Fail(e, err, err_cap);
}

// 1 when the heap's bucket windows are shared memory (every process on one node: gather copies peers' shards
// directly), 0 when they go through MPI_Get (several nodes, or JODC_MPI_SHARED_MEMORY=0).
JODC_MPI_EXPORT int jodc_mpi_heap_shared_memory(int64_t heap_id, int32_t* out, char* err, int64_t err_cap) {
  std::string e;
  auto h = FindHeap(heap_id, &e);
  if (!h) return Fail(e, err, err_cap);
  *out = h->shared_memory ? 1 : 0;
  return 0;
}

}  // extern "C"
