// The library's C API for Python (jodc/ops/transports/mpi_library.py, ctypes): heap and bucket management and host access to any
// device's shard or accumulator (remote ones through the window). Fallible functions follow common/c_api.h (0 on
// success, else the message in (err, err_cap)). Collective functions (create, register, free) must be called by every
// process of the communicator in the same order.
#include <cstring>
#include <string>

#include "common/c_api.h"
#include "mpi/handlers.h"
#include "mpi/heap.h"

using namespace jodc;
using namespace jodc::mpi;

namespace {

// Heap and bucket for a host-side access to `device`'s memory.
auto Lookup(int64_t heap_id, int64_t bucket_id, int32_t device) {
  return LocateForHost(
      FindHeap(heap_id), [](const std::shared_ptr<Heap>& h, int64_t id) { return FindBucket(*h, id); }, bucket_id,
      device);
}

}  // namespace

extern "C" {

// The handler of every heap op and group op (ffi/common/ops.h): names[i] / handlers[i] for i < capacity; returns how many there are.
JODC_MPI_EXPORT int32_t jodc_mpi_handlers(const char** names, void** handlers, int32_t capacity) {
#define JODC_MPI_HANDLER_ENTRY(op, Camel) {#op, reinterpret_cast<void*>(&Jodc##Camel##Mpi)},
  static const OpHandler kTable[] = {JODC_HEAP_OPS(JODC_MPI_HANDLER_ENTRY) JODC_GROUP_OPS(JODC_MPI_HANDLER_ENTRY)};
#undef JODC_MPI_HANDLER_ENTRY
  return CopyOpHandlers(kTable, names, handlers, capacity);
}

JODC_MPI_EXPORT int64_t jodc_mpi_shard_numel(int64_t numel, int32_t world, int32_t master_bytes) {
  return ShardNumel(numel, world, master_bytes);
}
JODC_MPI_EXPORT int64_t jodc_mpi_live_heaps() { return LiveHeapCount(); }
JODC_MPI_EXPORT int64_t jodc_mpi_live_bytes() { return LiveHeapBytes(); }

// The library's MPI: "<MPI_Get_library_version>" so Python can check it is the one mpi4py uses.
JODC_MPI_EXPORT int jodc_mpi_library_version(char* out, int64_t cap, char* err, int64_t err_cap) {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS)
    return Report(Error::Internal("MPI_Get_library_version failed"), err, err_cap);
  CopyText(std::string(text, len), out, cap);
  return 0;
}

JODC_MPI_EXPORT int jodc_mpi_heap_create(int64_t comm_f, int32_t world, int32_t deterministic, double timeout_s,
                                         const int32_t* dev_rank, const int32_t* dev_slot, int32_t progress_thread,
                                         int64_t* heap_id, char* err, int64_t err_cap) {
  MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(comm_f));
  auto id = CreateHeap(comm, world, deterministic != 0, timeout_s, dev_rank, dev_slot, progress_thread != 0);
  if (!id.has_value()) return Report(id.error(), err, err_cap);
  *heap_id = *id;
  return 0;
}

JODC_MPI_EXPORT int jodc_mpi_heap_free(int64_t heap_id, char* err, int64_t err_cap) {
  return Report(FreeHeap(heap_id), err, err_cap);
}

JODC_MPI_EXPORT int jodc_mpi_heap_set_barrier_timeout(int64_t heap_id, double timeout_s, char* err, int64_t err_cap) {
  return WithHeap(FindHeap(heap_id), err, err_cap, [&](Heap& h) {
    if (!(timeout_s > 0)) return InvalidArgument("barrier timeout must be > 0 seconds");
    h.barrier_timeout_s = timeout_s;
    return Error::Success();
  });
}

// Per device of the heap (every process's), the generation it last published; out holds `world` entries.
JODC_MPI_EXPORT int jodc_mpi_heap_generations(int64_t heap_id, uint64_t* out, int32_t cap, int32_t* world, char* err,
                                              int64_t err_cap) {
  return WithHeap(FindHeap(heap_id), err, err_cap, [&](Heap& h) {
    if (Error e = PollControl(h); e.failure()) return e;
    std::lock_guard<std::mutex> lock(h.mu);
    *world = h.world;
    if (cap < h.world) return InvalidArgument("generation buffer too small");
    for (int32_t d = 0; d < h.world; ++d) out[d] = static_cast<uint64_t>(h.seen[1 + d]);
    return Error::Success();
  });
}

// The heap's failure message ("" while healthy), a peer's abort included; len gets its full length.
JODC_MPI_EXPORT int jodc_mpi_heap_poisoned(int64_t heap_id, char* out, int64_t cap, int64_t* len, char* err,
                                           int64_t err_cap) {
  return WithHeap(FindHeap(heap_id), err, err_cap, [&](Heap& h) {
    PollControl(h);  // a peer's abort word counts too (best effort: an MPI error here is reported by the ops)
    std::lock_guard<std::mutex> lock(h.mu);
    *len = static_cast<int64_t>(h.poisoned.size());
    CopyText(h.poisoned, out, cap);
    return Error::Success();
  });
}

// Marks the heap failed with `msg` and sets the abort word of every peer (e.g. a Python-side failure).
JODC_MPI_EXPORT int jodc_mpi_heap_abort(int64_t heap_id, const char* msg, char* err, int64_t err_cap) {
  return WithHeap(FindHeap(heap_id), err, err_cap, [&](Heap& h) {
    Poison(h, msg);
    return Error::Success();
  });
}

JODC_MPI_EXPORT int jodc_mpi_bucket_register(int64_t heap_id, int64_t numel, const char* dtype, int64_t* bucket_id,
                                             char* err, int64_t err_cap) {
  Dtype d;
  if (!ParseDtype(dtype, &d))
    return Report(InvalidArgument(std::string("master dtype must be float32 or bfloat16, got ") + dtype), err, err_cap);
  auto id = RegisterBucket(heap_id, numel, d);
  if (!id.has_value()) return Report(id.error(), err, err_cap);
  *bucket_id = *id;
  return 0;
}

JODC_MPI_EXPORT int jodc_mpi_bucket_free(int64_t heap_id, int64_t bucket_id, char* err, int64_t err_cap) {
  return Report(FreeBucket(heap_id, bucket_id), err, err_cap);
}

JODC_MPI_EXPORT int jodc_mpi_bucket_shard_numel(int64_t heap_id, int64_t bucket_id, int64_t* out, char* err,
                                                int64_t err_cap) {
  auto found = Lookup(heap_id, bucket_id, 0);
  if (!found.has_value()) return Report(found.error(), err, err_cap);
  *out = found->bucket->layout.shard_numel;
  return 0;
}

JODC_MPI_EXPORT int jodc_mpi_bucket_get_shard(int64_t heap_id, int64_t bucket_id, int32_t device, void* dst,
                                              int64_t bytes, char* err, int64_t err_cap) {
  auto found = Lookup(heap_id, bucket_id, device);
  if (!found.has_value()) return Report(found.error(), err, err_cap);
  const Heap& h = *found->heap;
  const Bucket& b = *found->bucket;
  if (bytes != b.shard_bytes())
    return Report(InvalidArgument("shard needs " + std::to_string(b.shard_bytes()) + " bytes"), err, err_cap);
  const int32_t r = h.dev_rank[device];
  MPI_Win_sync(b.win);
  int rc = GetBytes(dst, bytes, r, b.shard_disp(h.dev_slot[device]), b.win);
  return Report(MpiCheck(rc, "get_shard", "MPI_Get"), err, err_cap);
}

JODC_MPI_EXPORT int jodc_mpi_bucket_set_shard(int64_t heap_id, int64_t bucket_id, int32_t device, const void* src,
                                              int64_t bytes, char* err, int64_t err_cap) {
  auto found = Lookup(heap_id, bucket_id, device);
  if (!found.has_value()) return Report(found.error(), err, err_cap);
  const Heap& h = *found->heap;
  const Bucket& b = *found->bucket;
  if (bytes != b.shard_bytes()) {
    return Report(InvalidArgument("shard needs " + std::to_string(b.shard_bytes()) + " bytes, got " +
                                  std::to_string(bytes)),
                  err, err_cap);
  }
  const int32_t r = h.dev_rank[device];
  int rc = PutBytes(src, bytes, r, b.shard_disp(h.dev_slot[device]), b.win);
  if (rc == MPI_SUCCESS) rc = MPI_Win_flush(r, b.win);
  if (rc == MPI_SUCCESS) rc = MPI_Win_sync(b.win);
  return Report(MpiCheck(rc, "set_shard", "MPI_Put"), err, err_cap);
}

JODC_MPI_EXPORT int jodc_mpi_bucket_get_accumulator(int64_t heap_id, int64_t bucket_id, int32_t device, float* dst,
                                                    int64_t bytes, char* err, int64_t err_cap) {
  auto found = Lookup(heap_id, bucket_id, device);
  if (!found.has_value()) return Report(found.error(), err, err_cap);
  const Bucket& b = *found->bucket;
  if (bytes != b.acc_bytes())
    return Report(InvalidArgument("accumulator needs " + std::to_string(b.acc_bytes()) + " bytes"), err, err_cap);
  int rc = ReadAccumulator(*found->heap, b, device, dst);
  return Report(MpiCheck(rc, "get_accumulator", "MPI_Get_accumulate"), err, err_cap);
}

JODC_MPI_EXPORT int jodc_mpi_bucket_zero_accumulator(int64_t heap_id, int64_t bucket_id, int32_t device, char* err,
                                                     int64_t err_cap) {
  auto found = Lookup(heap_id, bucket_id, device);
  if (!found.has_value()) return Report(found.error(), err, err_cap);
  int rc = ZeroAccumulator(*found->heap, *found->bucket, device);
  return Report(MpiCheck(rc, "zero_accumulator", "MPI_Accumulate"), err, err_cap);
}

// 1 when the heap's bucket windows are shared memory (every process on one node: gather copies peers' shards
// directly), 0 when they go through MPI_Get (several nodes, or JODC_MPI_SHARED_MEMORY=0).
JODC_MPI_EXPORT int jodc_mpi_heap_shared_memory(int64_t heap_id, int32_t* out, char* err, int64_t err_cap) {
  return WithHeap(FindHeap(heap_id), err, err_cap, [&](Heap& h) {
    *out = h.shared_memory ? 1 : 0;
    return Error::Success();
  });
}

}  // extern "C"
