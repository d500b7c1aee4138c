// What every GPU handler does around its launch, shared by the CUDA and NVSHMEM handlers: selecting the GPU of the
// stream it runs on (every launch happens only after it), turning a failed launch into an error, and the frame of a
// heap op (RunGpuOp).
#ifndef JODC_FFI_CUDA_STREAM_DEVICE_CUH_
#define JODC_FFI_CUDA_STREAM_DEVICE_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "cuda/heap.cuh"  // CudaMessage
#include "xla/ffi/api/ffi.h"

namespace jodc::cuda {

// Whether `p` allows 16-byte vector loads and stores (null counts as aligned: nothing is accessed through it).
inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Makes the stream's GPU the calling thread's current device (every handler, the token ops included, launches only
// after this: a launch on another device's stream fails or, worse, runs against the wrong context) and returns it.
inline ::xla::ffi::Error SelectStreamDevice(const char* op, cudaStream_t stream, int32_t* gpu_out) {
  int gpu = -1;
#if CUDART_VERSION >= 12080
  if (cudaStreamGetDevice(stream, &gpu) != cudaSuccess) {
    cudaGetLastError();
    gpu = -1;
  }
#endif
  if (gpu < 0 && cudaGetDevice(&gpu) != cudaSuccess) {  // XLA makes the stream's context current before calling us
    cudaGetLastError();
    return ::xla::ffi::Error::Internal(std::string("jodc ") + op + ": cannot tell which GPU the stream belongs to");
  }
  const cudaError_t e = cudaSetDevice(gpu);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return ::xla::ffi::Error::Internal(std::string("jodc ") + op + ": " + CudaMessage("selecting the stream's GPU", e));
  }
  *gpu_out = gpu;
  return ::xla::ffi::Error::Success();
}

// Turns a failed kernel launch (bad configuration, no kernel image for this GPU, ...) into an error.
inline ::xla::ffi::Error LaunchResult(const char* op) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return ::xla::ffi::Error::Success();
  return ::xla::ffi::Error::Internal(std::string("jodc ") + op + ": " + CudaMessage("launching the kernel", e));
}

// The frame of a GPU heap op's handler: prepare(&target) resolves the operands, heap and bucket and selects the
// stream's GPU; body(target) checks the op's own operands and launches its kernel; launched(target) checks the launch
// and records it. A failure at any step goes through abort(error) -> error, which poisons the heap so that peers
// spinning in a barrier for this device leave at once (issue 15 defect 5), and is returned to XLA.
template <typename Target, typename Prepare, typename Body, typename Launched, typename Abort>
::xla::ffi::Error RunGpuOp(Prepare&& prepare, Body&& body, Launched&& launched, Abort&& abort) {
  ::xla::ffi::Error e = [&]() -> ::xla::ffi::Error {
    Target t;
    if (::xla::ffi::Error failed = prepare(&t); failed.failure()) return failed;
    if (::xla::ffi::Error failed = body(static_cast<const Target&>(t)); failed.failure()) return failed;
    return launched(static_cast<const Target&>(t));
  }();
  return abort(std::move(e));
}

}  // namespace jodc::cuda

#endif  // JODC_FFI_CUDA_STREAM_DEVICE_CUH_
