// Selecting the GPU of the stream a handler runs on: shared by the CUDA and NVSHMEM handlers (every launch happens
// only after it).
#ifndef JODC_FFI_CUDA_STREAM_DEVICE_CUH_
#define JODC_FFI_CUDA_STREAM_DEVICE_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/heap.cuh"  // CudaMessage
#include "xla/ffi/api/ffi.h"

namespace jodc::cuda {

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

}  // namespace jodc::cuda

#endif  // JODC_FFI_CUDA_STREAM_DEVICE_CUH_
