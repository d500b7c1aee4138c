// after: a token that exists only once every operand exists (the CUDA twin of ffi/cpu/after.cc). Stream order does
// the waiting; a one-thread kernel writes token + 1.
#include "cuda/device_util.cuh"
#include "cuda/handler_util.cuh"
#include "cuda/handlers.cuh"

namespace jodc::cuda {
namespace {

__global__ void AfterKernel(const int32_t* token_in, int32_t* token_out) { AdvanceToken(token_in, token_out); }

ffi::Error After(cudaStream_t stream, ffi::Buffer<ffi::S32> token, ffi::RemainingArgs values,
                 ffi::Result<ffi::Buffer<ffi::S32>> token_out) {
  if (ffi::Error e = CheckToken("after", token); e.failure()) return e;
  int32_t gpu = -1;
  if (ffi::Error e = SelectStreamDevice("after", stream, &gpu); e.failure()) return e;
  AfterKernel<<<1, 1, 0, stream>>>(token.typed_data(), token_out->typed_data());
  return LaunchResult("after");
}

}  // namespace
}  // namespace jodc::cuda

JODC_CUDA_HANDLER(After, jodc::cuda::After);
