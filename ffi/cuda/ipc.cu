// CUDA IPC: one heap shared by several processes of one node (the common launch: one process per GPU). The kernels
// are the in-process ones: every position's memory is still a peer pointer, only some of them come from other
// processes through cudaIpcGetMemHandle / cudaIpcOpenMemHandle. Each process owns exactly one position; the handles
// travel through jodc/ops/_cuda_ipc.py (the jax.distributed key-value store or MPI).
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

#include "common/dtype.h"
#include "cuda/heap.cuh"

namespace jodc::cuda {

constexpr int64_t kIpcHandleBytes = sizeof(cudaIpcMemHandle_t);  // 64
constexpr int64_t kIpcBucketHandles = 3;                          // shard, accumulator, landing slots

bool MapSharedControl(const std::string& name, bool create, int32_t gpu, HeapControl** host, HeapControl** dev,
                      size_t* bytes, std::string* err) {
  const long page = sysconf(_SC_PAGESIZE);
  const size_t size = ((sizeof(HeapControl) + page - 1) / page) * page;
  const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) {
    *err = std::string(create ? "creating" : "opening") + " the heap's shared control block " + name + " failed: " +
           std::strerror(errno) + (create ? "" : " (the owner of position 0 creates it first; same node?)");
    return false;
  }
  if (create && ftruncate(fd, static_cast<off_t>(size)) != 0) {
    *err = "sizing the heap's shared control block " + name + " failed: " + std::strerror(errno);
    close(fd);
    shm_unlink(name.c_str());
    return false;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    *err = "mapping the heap's shared control block " + name + " failed: " + std::strerror(errno);
    if (create) shm_unlink(name.c_str());
    return false;
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
    *err = CudaMessage(("registering the shared control block " + name + " with GPU " + std::to_string(gpu)).c_str(),
                       e);
    return false;
  }
  *host = static_cast<HeapControl*>(p);
  *dev = static_cast<HeapControl*>(d);
  *bytes = size;
  return true;
}

void ReleaseSharedControl(HeapControl* host, size_t bytes) {
  cudaHostUnregister(host);
  cudaGetLastError();
  munmap(host, bytes);
}

namespace {

int32_t Fail(const std::string& message, char* err, int64_t err_capacity) {
  if (err != nullptr && err_capacity > 0) {
    const size_t n = std::min<size_t>(message.size(), static_cast<size_t>(err_capacity - 1));
    std::memcpy(err, message.data(), n);
    err[n] = '\0';
  }
  return 1;
}

int64_t CreateIpcHeap(int32_t world, bool deterministic, bool landing_slots, double barrier_timeout_s,
                      int32_t local_position, int32_t local_gpu, const std::string& shm_name, bool create,
                      std::string* err) {
  if (world < 1 || world > kMaxWorld) {
    *err = "heap world size must be in [1, " + std::to_string(kMaxWorld) + "] on CUDA, got " + std::to_string(world);
    return -1;
  }
  if (!CheckBarrierTimeout(barrier_timeout_s, err)) return -1;
  if (local_position < 0 || local_position >= world) {
    *err = "this process's position " + std::to_string(local_position) + " is outside [0, " + std::to_string(world) +
           ")";
    return -1;
  }
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || local_gpu < 0 || local_gpu >= count) {
    cudaGetLastError();
    *err = "this process's GPU " + std::to_string(local_gpu) + " is not one of its " + std::to_string(count) +
           " visible CUDA devices";
    return -1;
  }
  if (shm_name.empty() || shm_name[0] != '/' || shm_name.find('/', 1) != std::string::npos) {
    *err = "the shared control block's name must look like /name, got '" + shm_name + "'";
    return -1;
  }
  auto heap = std::make_shared<Heap>();
  heap->world = world;
  heap->deterministic = deterministic;
  heap->landing_slots = deterministic || landing_slots;
  heap->barrier_timeout_s = barrier_timeout_s;
  heap->placement.assign(world, local_gpu);  // remote positions are reached through this process's GPU
  heap->local.assign(world, 0);
  heap->local[local_position] = 1;
  if (!MapSharedControl(shm_name, create, local_gpu, &heap->control, &heap->control_dev, &heap->shm_bytes, err))
    return -1;
  heap->shm_name = shm_name;
  ScopedDevice on(local_gpu);
  void* reports = nullptr;
  cudaError_t e = on.ok() ? cudaHostAlloc(&reports, sizeof(BarrierReport) * world,
                                          cudaHostAllocMapped | cudaHostAllocPortable)
                          : on.status();
  if (e != cudaSuccess) {
    cudaGetLastError();
    *err = CudaMessage("allocating the heap's barrier reports", e);
    return -1;  // ~Heap releases the shared control block
  }
  std::memset(reports, 0, sizeof(BarrierReport) * world);
  heap->reports = static_cast<BarrierReport*>(reports);
  return AddHeap(std::move(heap));
}

std::shared_ptr<Bucket> FindPending(const std::shared_ptr<Heap>& heap, int64_t bucket_id, std::string* err) {
  std::lock_guard<std::mutex> lock(heap->mu);
  auto it = heap->pending.find(bucket_id);
  if (it == heap->pending.end()) {
    *err = "bucket " + std::to_string(bucket_id) + " of heap " + std::to_string(heap->id) +
           " is not waiting for imports (unknown, already published, or freed)";
    return nullptr;
  }
  return it->second;
}

bool ExportHandle(void* p, char* out, std::string* err) {
  if (p == nullptr) {
    std::memset(out, 0, kIpcHandleBytes);
    return true;
  }
  cudaIpcMemHandle_t handle;
  if (cudaError_t e = cudaIpcGetMemHandle(&handle, p); e != cudaSuccess) {
    cudaGetLastError();
    *err = CudaMessage("cudaIpcGetMemHandle", e);
    return false;
  }
  std::memcpy(out, &handle, kIpcHandleBytes);
  return true;
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
    return Fail(CudaMessage(("cudaDeviceGetPCIBusId for GPU " + std::to_string(gpu)).c_str(), e), err, err_capacity);
  }
  Fail(id, out, out_capacity);  // the same truncating copy
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
      return Fail("querying peer access from GPU " + std::to_string(gpu) + " to " + id + " failed", err, err_capacity);
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
  std::string why;
  const int64_t id = CreateIpcHeap(world, deterministic != 0, landing_slots != 0, barrier_timeout_s, local_position,
                                   local_gpu, shm_name != nullptr ? shm_name : "", create != 0, &why);
  if (id < 0) return Fail(why, err, err_capacity);
  *heap_id = id;
  return 0;
}

// Removes the shared control block's name once every process has opened it (the pages live on while mapped).
JODC_EXPORT int32_t jodc_cuda_ipc_unlink(const char* shm_name, char* err, int64_t err_capacity) {
  if (shm_name == nullptr || shm_unlink(shm_name) != 0)
    return Fail(std::string("removing shared memory ") + (shm_name ? shm_name : "(null)") + " failed: " +
                std::strerror(errno), err, err_capacity);
  return 0;
}

// Registers a bucket: allocates this process's position and writes its IPC handles (shard, accumulator, landing
// slots; 64 bytes each, zeros where absent) into `handles`. The bucket stays pending until published.
JODC_EXPORT int32_t jodc_cuda_ipc_bucket_register(int64_t heap_id, int64_t numel, const char* dtype,
                                                  int64_t* bucket_id, char* handles, int64_t handles_capacity,
                                                  char* err, int64_t err_capacity) {
  if (handles == nullptr || handles_capacity < kIpcHandleBytes * kIpcBucketHandles)
    return Fail("the handle buffer needs " + std::to_string(kIpcHandleBytes * kIpcBucketHandles) + " bytes", err,
                err_capacity);
  Dtype master;
  const std::string name = dtype != nullptr ? dtype : "";
  if (!ParseDtype(name, &master)) return Fail("master dtype must be float32 or bfloat16, got " + name, err,
                                              err_capacity);
  std::string why;
  bool out_of_memory = false;
  const int64_t id = RegisterBucket(heap_id, numel, master, &why, &out_of_memory);
  if (id < 0) {
    Fail(why, err, err_capacity);
    return out_of_memory ? 2 : 1;
  }
  auto heap = FindHeap(heap_id, &why);
  auto b = heap ? FindPending(heap, id, &why) : nullptr;
  if (!b) return Fail(why, err, err_capacity);
  int32_t mine = -1;
  for (int32_t p = 0; p < heap->world; ++p) {
    if (heap->IsLocal(p)) mine = p;
  }
  ScopedDevice on(heap->placement[mine]);
  if (!ExportHandle(b->view.shard[mine], handles, &why) ||
      !ExportHandle(b->view.accumulator[mine], handles + kIpcHandleBytes, &why) ||
      !ExportHandle(b->view.landing[mine], handles + 2 * kIpcHandleBytes, &why)) {
    FreeBucket(heap_id, id, &why);
    return Fail("exporting bucket memory: " + why, err, err_capacity);
  }
  *bucket_id = id;
  return 0;
}

// Maps position `position`'s memory (its owner's 3 handles) into this process for a pending bucket.
JODC_EXPORT int32_t jodc_cuda_ipc_bucket_import(int64_t heap_id, int64_t bucket_id, int32_t position,
                                                const char* handles, int64_t bytes, char* err, int64_t err_capacity) {
  std::string why;
  auto heap = FindHeap(heap_id, &why);
  if (!heap) return Fail(why, err, err_capacity);
  auto b = FindPending(heap, bucket_id, &why);
  if (!b) return Fail(why, err, err_capacity);
  if (position < 0 || position >= heap->world || heap->IsLocal(position))
    return Fail("position " + std::to_string(position) + " is not a remote position of heap " +
                std::to_string(heap_id), err, err_capacity);
  if (b->attached[position]) return Fail("position " + std::to_string(position) + " is already imported", err,
                                         err_capacity);
  if (handles == nullptr || bytes != kIpcHandleBytes * kIpcBucketHandles)
    return Fail("expected " + std::to_string(kIpcHandleBytes * kIpcBucketHandles) + " bytes of handles, got " +
                std::to_string(bytes), err, err_capacity);
  const int32_t gpu = heap->placement[position];
  ScopedDevice on(gpu);
  void* mapped[kIpcBucketHandles] = {};
  for (int64_t k = 0; k < kIpcBucketHandles; ++k) {
    const char* h = handles + k * kIpcHandleBytes;
    const bool absent = std::all_of(h, h + kIpcHandleBytes, [](char c) { return c == 0; });
    const bool wanted = k < 2 || b->view.landing_slots;
    if (absent != !wanted) {
      return Fail("position " + std::to_string(position) + "'s handle " + std::to_string(k) +
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
      return Fail(CudaMessage(("opening position " + std::to_string(position) + "'s memory on GPU " +
                               std::to_string(gpu) + " (cudaIpcOpenMemHandle; both GPUs on one node with P2P?)")
                                  .c_str(),
                              e),
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
  std::string why;
  auto heap = FindHeap(heap_id, &why);
  if (!heap) return Fail(why, err, err_capacity);
  std::lock_guard<std::mutex> lock(heap->mu);
  auto it = heap->pending.find(bucket_id);
  if (it == heap->pending.end()) return Fail("bucket " + std::to_string(bucket_id) + " is not pending", err,
                                             err_capacity);
  for (int32_t p = 0; p < heap->world; ++p) {
    if (!it->second->attached[p])
      return Fail("bucket " + std::to_string(bucket_id) + ": position " + std::to_string(p) + " is not imported yet",
                  err, err_capacity);
  }
  heap->buckets[bucket_id] = it->second;
  heap->pending.erase(it);
  return 0;
}
