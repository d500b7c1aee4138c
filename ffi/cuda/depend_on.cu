// depend_on: its values unchanged (results alias operands; copied on the stream when XLA did not alias them), but
// only once the token exists (the CUDA twin of ffi/cpu/depend_on.cc).
#include "cuda/device_util.cuh"
#include "cuda/handler_util.cuh"
#include "cuda/handlers.cuh"

namespace jodc::cuda {
namespace {

ffi::Error DependOn(cudaStream_t stream, ffi::Buffer<ffi::S32> token, ffi::RemainingArgs values,
                    ffi::RemainingRets outs) {
  if (token.element_count() != 1) return InvalidArgument("jodc depend_on: the token must be an int32 scalar");
  if (values.size() != outs.size()) return InvalidArgument("jodc depend_on: as many results as values needed");
  int32_t gpu = -1;
  if (ffi::Error e = SelectStreamDevice("depend_on", stream, &gpu); e.failure()) return e;
  for (size_t i = 0; i < values.size(); ++i) {
    auto in = values.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) return InvalidArgument("jodc depend_on: operands must be arrays");
    if (in->size_bytes() != (*out)->size_bytes())
      return InvalidArgument("jodc depend_on: result " + std::to_string(i) + " differs in size from its value");
    if ((*out)->untyped_data() != in->untyped_data()) {
      cudaError_t e = cudaMemcpyAsync((*out)->untyped_data(), in->untyped_data(), in->size_bytes(),
                                      cudaMemcpyDeviceToDevice, stream);
      if (e != cudaSuccess) return ffi::Error::Internal(std::string("jodc depend_on: ") + cudaGetErrorString(e));
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jodc::cuda

JODC_CUDA_HANDLER(DependOn, jodc::cuda::DependOn);
