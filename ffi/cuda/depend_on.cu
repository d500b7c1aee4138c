// depend_on: its values unchanged (results alias operands; copied on the stream when XLA did not alias them), but
// only once the token exists (the CUDA twin of ffi/cpu/depend_on.cc; the checks are common/depend_on.h's).
#include "common/depend_on.h"
#include "cuda/device_util.cuh"
#include "cuda/handler_util.cuh"
#include "cuda/handlers.cuh"

namespace jodc::cuda {
namespace {

ffi::Error DependOn(cudaStream_t stream, Scalar token, ffi::RemainingArgs values, ffi::RemainingRets outs) {
  int32_t gpu = -1;
  if (ffi::Error e = SelectStreamDevice("depend_on", stream, &gpu); e.failure()) return e;
  return ForwardValues(token, values, outs, [stream](void* dst, const void* src, size_t bytes) -> ffi::Error {
    const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
    if (e == cudaSuccess) return ffi::Error::Success();
    cudaGetLastError();
    return ffi::Error::Internal("jodc depend_on: " + CudaMessage("copying a value", e));
  });
}

}  // namespace
}  // namespace jodc::cuda

JODC_CUDA_HANDLER(DependOn, jodc::cuda::DependOn);
