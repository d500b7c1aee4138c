// CUDA IPC: one heap shared by several processes of one node (the common launch: one process per GPU). The kernels
// are the in-process ones: every position's memory is still a peer pointer, only some of them come from other
// processes through cudaIpcGetMemHandle / cudaIpcOpenMemHandle. Each process owns exactly one position; the handles
// travel through jodc/ops/transports/cuda_ipc.py (the jax.distributed key-value store or MPI).
//
// The control block (barrier arrivals, abort flag, fault word) is a POSIX shared-memory segment that every process of
// the heap maps and registers with CUDA as mapped memory: the barrier kernels of all processes read and write the same
// pages, an abort from any host releases every process's waiting barrier at once, and a fault recorded by any kernel
// poisons the heap everywhere, all without a device copy.
//
// Protocol (driven by Python, collectively): create the heap (the owner of position 0 creates the segment, the others
// open it; then it is unlinked), then per bucket: register (allocates this process's position and returns its three
// IPC handles: shard, accumulator, landing slots), import every other position's handles, publish (the bucket becomes
// visible to ops). Freeing is collective too (every process stops using peers' memory first).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/c_api.h"
#include "common/dtype.h"
#include "cuda/heap.cuh"

namespace jodc::cuda {

constexpr int64_t kIpcHandleBytes = sizeof(cudaIpcMemHandle_t);  // 64
constexpr int64_t kIpcBucketHandles = 3;                          // shard, accumulator, landing slots

Error MapSharedControl(const std::string& name, bool create, int32_t gpu, HeapControl** host, HeapControl** dev,
                       size_t* bytes) {
  const long page = sysconf(_SC_PAGESIZE);
  const size_t size = ((sizeof(HeapControl) + page - 1) / page) * page;
  const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) {
    return InvalidArgument(std::string(create ? "creating" : "opening") + " the heap's shared control block " + name +
                           " failed: " + std::strerror(errno) +
                           (create ? "" : " (the owner of position 0 creates it first; same node?)"));
  }
  if (create && ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const std::string why = std::strerror(errno);
    close(fd);
    shm_unlink(name.c_str());
    return Error::Internal("sizing the heap's shared control block " + name + " failed: " + why);
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    const std::string why = std::strerror(errno);
    if (create) shm_unlink(name.c_str());
    return Error::Internal("mapping the heap's shared control block " + name + " failed: " + why);
  }
  if (create) std::memset(p, 0, size);  // ftruncate zero-fills already; explicit for clarity
  ScopedDevice on(gpu);
  cudaError_t e = on.ok() ? cudaHostRegister(p, size, cudaHostRegisterMapped | cudaHostRegisterPortable) : on.status();
  void* d = nullptr;
  if (e == cudaSuccess) {
    e = cudaHostGetDevicePointer(&d, p, 0);
    if (e != cudaSuccess) cudaHostUnregister(p);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    munmap(p, size);
    if (create) shm_unlink(name.c_str());
    return Error::Internal(CudaMessage(
        ("registering the shared control block " + name + " with GPU " + std::to_string(gpu)).c_str(), e));
  }
  *host = static_cast<HeapControl*>(p);
  *dev = static_cast<HeapControl*>(d);
  *bytes = size;
  return Error::Success();
}

void ReleaseSharedControl(HeapControl* host, size_t bytes) {
  cudaHostUnregister(host);
  cudaGetLastError();
  munmap(host, bytes);
}

namespace {

ErrorOr<int64_t> CreateIpcHeap(int32_t world, bool deterministic, bool landing_slots, double barrier_timeout_s,
                               int32_t local_position, int32_t local_gpu, const std::string& shm_name, bool create) {
  if (world < 1 || world > kMaxWorld) {
    return Fail(InvalidArgument("heap world size must be in [1, " + std::to_string(kMaxWorld) + "] on CUDA, got " +
                                std::to_string(world)));
  }
  if (Error e = CheckBarrierTimeout(barrier_timeout_s); e.failure()) return Fail(e);
  if (local_position < 0 || local_position >= world) {
    return Fail(InvalidArgument("this process's position " + std::to_string(local_position) + " is outside [0, " +
                                std::to_string(world) + ")"));
  }
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || local_gpu < 0 || local_gpu >= count) {
    cudaGetLastError();
    return Fail(InvalidArgument("this process's GPU " + std::to_string(local_gpu) + " is not one of its " +
                                std::to_string(count) + " visible CUDA devices"));
  }
  if (shm_name.empty() || shm_name[0] != '/' || shm_name.find('/', 1) != std::string::npos) {
    return Fail(InvalidArgument("the shared control block's name must look like /name, got '" + shm_name + "'"));
  }
  auto heap = std::make_shared<Heap>();
  heap->world = world;
  heap->deterministic = deterministic;
  heap->landing_slots = deterministic || landing_slots;
  heap->barrier_timeout_s = barrier_timeout_s;
  heap->placement.assign(world, local_gpu);  // remote positions are reached through this process's GPU
  heap->local.assign(world, 0);
  heap->local[local_position] = 1;
  if (Error e = MapSharedControl(shm_name, create, local_gpu, &heap->control, &heap->control_dev, &heap->shm_bytes);
      e.failure()) {
    return Fail(e);
  }
  heap->shm_name = shm_name;
  ScopedDevice on(local_gpu);
  if (cudaError_t e = on.ok() ? heap->reports.Allocate(world) : on.status(); e != cudaSuccess) {
    cudaGetLastError();
    // ~Heap releases the shared control block
    return Fail(Error::Internal(CudaMessage("allocating the heap's barrier reports", e)));
  }
  return AddHeap(std::move(heap));
}

ErrorOr<std::shared_ptr<Bucket>> FindPending(const std::shared_ptr<Heap>& heap, int64_t bucket_id) {
  std::lock_guard<std::mutex> lock(heap->mu);
  auto it = heap->pending.find(bucket_id);
  if (it == heap->pending.end()) {
    return Fail(InvalidArgument("bucket " + std::to_string(bucket_id) + " of heap " + std::to_string(heap->id) +
                                " is not waiting for imports (unknown, already published, or freed)"));
  }
  return it->second;
}

// Heap `heap_id` and its pending bucket `bucket_id` (registered here, not yet published).
auto LocatePending(int64_t heap_id, int64_t bucket_id) {
  return LocateForHost(FindHeap(heap_id), FindPending, bucket_id, /*device=*/0);
}

Error ExportHandle(void* p, char* out) {
  if (p == nullptr) {
    std::memset(out, 0, kIpcHandleBytes);
    return Error::Success();
  }
  cudaIpcMemHandle_t handle;
  if (cudaError_t e = cudaIpcGetMemHandle(&handle, p); e != cudaSuccess) {
    cudaGetLastError();
    return Error::Internal(CudaMessage("cudaIpcGetMemHandle", e));
  }
  std::memcpy(out, &handle, kIpcHandleBytes);
  return Error::Success();
}

// The C API's failure code for `message` (kInvalidArgument), copied into (err, err_capacity).
int32_t Refuse(const std::string& message, char* err, int64_t err_capacity) {
  return Report(InvalidArgument(message), err, err_capacity);
}

}  // namespace
}  // namespace jodc::cuda

using namespace jodc;
using namespace jodc::cuda;

// The PCI bus id of CUDA device `gpu` ("0000:3b:00.0"): how processes name each other's GPUs.
JODC_EXPORT int32_t jodc_cuda_pci_bus_id(int32_t gpu, char* out, int64_t out_capacity, char* err,
                                         int64_t err_capacity) {
  char id[64] = {};
  if (cudaError_t e = cudaDeviceGetPCIBusId(id, sizeof(id), gpu); e != cudaSuccess) {
    cudaGetLastError();
    return Report(Error::Internal(CudaMessage(("cudaDeviceGetPCIBusId for GPU " + std::to_string(gpu)).c_str(), e)),
                  err, err_capacity);
  }
  CopyText(id, out, out_capacity);
  return 0;
}

// Over the GPUs named by `peers` (PCI bus ids, one per line): whether `gpu` can access every one of them directly and
// whether native atomics work over every link. A peer GPU this process cannot see counts as "no atomics" (landing
// slots then keep accumulation correct) and as "access unknown" (the import reports a real failure).
JODC_EXPORT int32_t jodc_cuda_ipc_links(int32_t gpu, const char* peers, int32_t* all_access, int32_t* all_atomics,
                                        char* err, int64_t err_capacity) {
  *all_access = 1;
  *all_atomics = 1;
  std::istringstream lines(peers != nullptr ? peers : "");
  std::string id;
  while (std::getline(lines, id)) {
    if (id.empty()) continue;
    int other = -1;
    if (cudaDeviceGetByPCIBusId(&other, id.c_str()) != cudaSuccess) {
      cudaGetLastError();
      *all_atomics = 0;
      continue;
    }
    if (other == gpu) continue;
    int access = 0, atomics = 0;
    if (cudaDeviceCanAccessPeer(&access, gpu, other) != cudaSuccess) {
      cudaGetLastError();
      return Report(Error::Internal("querying peer access from GPU " + std::to_string(gpu) + " to " + id + " failed"),
                    err, err_capacity);
    }
    if (cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, gpu, other) != cudaSuccess) {
      cudaGetLastError();
      atomics = 0;
    }
    if (!access) *all_access = 0;
    if (!atomics) *all_atomics = 0;
  }
  return 0;
}

// A heap of `world` positions of which this process owns `local_position` (on its GPU `local_gpu`). `create`: this
// process creates the shared control block `shm_name` (the owner of position 0); the others open it.
JODC_EXPORT int32_t jodc_cuda_ipc_heap_create(int32_t world, int32_t deterministic, int32_t landing_slots,
                                              double barrier_timeout_s, int32_t local_position, int32_t local_gpu,
                                              const char* shm_name, int32_t create, int64_t* heap_id, char* err,
                                              int64_t err_capacity) {
  auto id = CreateIpcHeap(world, deterministic != 0, landing_slots != 0, barrier_timeout_s, local_position, local_gpu,
                          shm_name != nullptr ? shm_name : "", create != 0);
  if (!id.has_value()) return Report(id.error(), err, err_capacity);
  *heap_id = *id;
  return 0;
}

// Removes the shared control block's name once every process has opened it (the pages live on while mapped).
JODC_EXPORT int32_t jodc_cuda_ipc_unlink(const char* shm_name, char* err, int64_t err_capacity) {
  if (shm_name == nullptr || shm_unlink(shm_name) != 0)
    return Refuse(std::string("removing shared memory ") + (shm_name ? shm_name : "(null)") + " failed: " +
                      std::strerror(errno), err, err_capacity);
  return 0;
}

// Registers a bucket: allocates this process's position and writes its IPC handles (shard, accumulator, landing
// slots; 64 bytes each, zeros where absent) into `handles`. The bucket stays pending until published.
JODC_EXPORT int32_t jodc_cuda_ipc_bucket_register(int64_t heap_id, int64_t numel, const char* dtype,
                                                  int64_t* bucket_id, char* handles, int64_t handles_capacity,
                                                  char* err, int64_t err_capacity) {
  if (handles == nullptr || handles_capacity < kIpcHandleBytes * kIpcBucketHandles)
    return Refuse("the handle buffer needs " + std::to_string(kIpcHandleBytes * kIpcBucketHandles) + " bytes", err,
                  err_capacity);
  Dtype master;
  const std::string name = dtype != nullptr ? dtype : "";
  if (!ParseDtype(name, &master)) return Refuse("master dtype must be float32 or bfloat16, got " + name, err,
                                                err_capacity);
  auto registered = RegisterBucket(heap_id, numel, master);
  if (!registered.has_value()) return Report(registered.error(), err, err_capacity);  // 2 for out of memory
  const int64_t id = *registered;
  auto found = LocatePending(heap_id, id);
  if (!found.has_value()) return Report(found.error(), err, err_capacity);
  const std::shared_ptr<Heap>& heap = found->heap;
  const std::shared_ptr<Bucket>& b = found->bucket;
  int32_t mine = -1;
  for (int32_t p = 0; p < heap->world; ++p) {
    if (heap->IsLocal(p)) mine = p;
  }
  ScopedDevice on(heap->placement[mine]);
  Error e = ExportHandle(b->view.shard[mine], handles);
  if (e.success()) e = ExportHandle(b->view.accumulator[mine], handles + kIpcHandleBytes);
  if (e.success()) e = ExportHandle(b->view.landing[mine], handles + 2 * kIpcHandleBytes);
  if (e.failure()) {
    FreeBucket(heap_id, id);  // best effort: the export's failure is what the caller needs to see
    return Report(Error::Internal("exporting bucket memory: " + e.message()), err, err_capacity);
  }
  *bucket_id = id;
  return 0;
}

// Maps position `position`'s memory (its owner's 3 handles) into this process for a pending bucket.
JODC_EXPORT int32_t jodc_cuda_ipc_bucket_import(int64_t heap_id, int64_t bucket_id, int32_t position,
                                                const char* handles, int64_t bytes, char* err, int64_t err_capacity) {
  auto found = LocatePending(heap_id, bucket_id);
  if (!found.has_value()) return Report(found.error(), err, err_capacity);
  const std::shared_ptr<Heap>& heap = found->heap;
  const std::shared_ptr<Bucket>& b = found->bucket;
  if (position < 0 || position >= heap->world || heap->IsLocal(position))
    return Refuse("position " + std::to_string(position) + " is not a remote position of heap " +
                      std::to_string(heap_id), err, err_capacity);
  if (b->attached[position]) return Refuse("position " + std::to_string(position) + " is already imported", err,
                                           err_capacity);
  if (handles == nullptr || bytes != kIpcHandleBytes * kIpcBucketHandles)
    return Refuse("expected " + std::to_string(kIpcHandleBytes * kIpcBucketHandles) + " bytes of handles, got " +
                      std::to_string(bytes), err, err_capacity);
  const int32_t gpu = heap->placement[position];
  ScopedDevice on(gpu);
  void* mapped[kIpcBucketHandles] = {};
  for (int64_t k = 0; k < kIpcBucketHandles; ++k) {
    const char* h = handles + k * kIpcHandleBytes;
    const bool absent = std::all_of(h, h + kIpcHandleBytes, [](char c) { return c == 0; });
    const bool wanted = k < 2 || b->view.landing_slots;
    if (absent != !wanted) {
      return Refuse("position " + std::to_string(position) + "'s handle " + std::to_string(k) +
                        (absent ? " is missing" : " is unexpected (the processes disagree on landing slots)"),
                    err, err_capacity);
    }
    if (absent) continue;
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, h, kIpcHandleBytes);
    cudaError_t e = on.ok() ? cudaIpcOpenMemHandle(&mapped[k], handle, cudaIpcMemLazyEnablePeerAccess) : on.status();
    if (e != cudaSuccess) {
      cudaGetLastError();
      for (int64_t j = 0; j < k; ++j) {
        if (mapped[j] != nullptr) cudaIpcCloseMemHandle(mapped[j]);
      }
      return Report(Error::Internal(CudaMessage(("opening position " + std::to_string(position) + "'s memory on GPU " +
                                                 std::to_string(gpu) +
                                                 " (cudaIpcOpenMemHandle; both GPUs on one node with P2P?)")
                                                    .c_str(),
                                                e)),
                    err, err_capacity);
    }
  }
  b->import_gpu = gpu;
  for (void* p : mapped) {
    if (p != nullptr) b->imported.push_back(p);
  }
  b->view.shard[position] = mapped[0];
  b->view.accumulator[position] = static_cast<float*>(mapped[1]);
  b->view.landing[position] = static_cast<float*>(mapped[2]);
  b->attached[position] = 1;
  return 0;
}

// Makes a pending bucket visible to ops once every position is attached.
JODC_EXPORT int32_t jodc_cuda_ipc_bucket_publish(int64_t heap_id, int64_t bucket_id, char* err,
                                                 int64_t err_capacity) {
  return WithHeap(FindHeap(heap_id), err, err_capacity, [&](Heap& heap) -> Error {
    std::lock_guard<std::mutex> lock(heap.mu);
    auto it = heap.pending.find(bucket_id);
    if (it == heap.pending.end()) return InvalidArgument("bucket " + std::to_string(bucket_id) + " is not pending");
    for (int32_t p = 0; p < heap.world; ++p) {
      if (!it->second->attached[p]) {
        return InvalidArgument("bucket " + std::to_string(bucket_id) + ": position " + std::to_string(p) +
                               " is not imported yet");
      }
    }
    heap.buckets[bucket_id] = it->second;
    heap.pending.erase(it);
    return Error::Success();
  });
}
