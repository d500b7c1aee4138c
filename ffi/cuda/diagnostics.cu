// Read-only facts about the CUDA installation for `make test-gpu`'s report and for tests: driver and runtime
// versions, a GPU's name and architecture, peer access and native peer atomics between two GPUs, and which context
// the calling thread has current (to check that jodc touches only the GPUs of a heap). Same C conventions as
// management.cu: 0 on success, 1 with a message in `err`.
#include <cstring>
#include <string>

#include "common/c_api.h"
#include "cuda/heap.cuh"

namespace {

// A failed query: its message into (err, err_capacity), the C API's failure code (common/c_api.h).
int32_t Fail(const std::string& message, char* err, int64_t err_capacity) {
  return jodc::Report(jodc::Error::Internal(message), err, err_capacity);
}

}  // namespace

using jodc::cuda::CudaMessage;

// CUDA versions as 1000 * major + 10 * minor: the driver's (0 when no driver is installed) and the runtime linked in.
JODC_EXPORT int32_t jodc_cuda_versions(int32_t* driver, int32_t* runtime, char* err, int64_t err_capacity) {
  int d = 0, r = 0;
  if (cudaError_t e = cudaRuntimeGetVersion(&r); e != cudaSuccess) {
    cudaGetLastError();
    return Fail(CudaMessage("cudaRuntimeGetVersion", e), err, err_capacity);
  }
  if (cudaDriverGetVersion(&d) != cudaSuccess) {
    cudaGetLastError();
    d = 0;
  }
  *driver = d;
  *runtime = r;
  return 0;
}

// The GPU's name (NUL-terminated, truncated to name_capacity), compute capability and memory in bytes.
JODC_EXPORT int32_t jodc_cuda_device_info(int32_t gpu, char* name, int64_t name_capacity, int32_t* cc_major,
                                          int32_t* cc_minor, int64_t* total_bytes, char* err, int64_t err_capacity) {
  cudaDeviceProp prop;
  if (cudaError_t e = cudaGetDeviceProperties(&prop, gpu); e != cudaSuccess) {
    cudaGetLastError();
    return Fail(CudaMessage(("cudaGetDeviceProperties for GPU " + std::to_string(gpu)).c_str(), e), err,
                err_capacity);
  }
  jodc::CopyText(prop.name, name, name_capacity);
  *cc_major = prop.major;
  *cc_minor = prop.minor;
  *total_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  return 0;
}

// Whether GPU a can access GPU b's memory directly, and whether native atomics work over their link.
JODC_EXPORT int32_t jodc_cuda_peer_info(int32_t a, int32_t b, int32_t* can_access, int32_t* native_atomics,
                                        char* err, int64_t err_capacity) {
  int access = 0, atomics = 0;
  if (cudaError_t e = cudaDeviceCanAccessPeer(&access, a, b); e != cudaSuccess) {
    cudaGetLastError();
    return Fail(CudaMessage(("cudaDeviceCanAccessPeer(" + std::to_string(a) + ", " + std::to_string(b) + ")").c_str(),
                            e),
                err, err_capacity);
  }
  if (cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, a, b) != cudaSuccess) {
    cudaGetLastError();
    atomics = 0;
  }
  *can_access = access;
  *native_atomics = atomics;
  return 0;
}

// The device of the calling thread's current context, or -1 when none is current.
JODC_EXPORT int32_t jodc_cuda_context_device(int32_t* device, char* err, int64_t err_capacity) {
  if (!jodc::cuda::CurrentContextDevice(device))
    return Fail("the driver's context calls are unavailable (no driver, or too old)", err, err_capacity);
  return 0;
}

// Whether `gpu`'s primary context is active (has been created in this process).
JODC_EXPORT int32_t jodc_cuda_primary_context_active(int32_t gpu, int32_t* active, char* err, int64_t err_capacity) {
  bool on = false;
  if (!jodc::cuda::PrimaryContextActive(gpu, &on))
    return Fail("cannot query GPU " + std::to_string(gpu) + "'s primary context (no driver, or no such GPU)", err,
                err_capacity);
  *active = on ? 1 : 0;
  return 0;
}
