// Names and messages shared by every CUDA library of jodc (the CUDA backend and the NVSHMEM backend compile this
// file): op names for device faults, CUDA error messages, the barrier timeout check.
#include <string>

#include "cuda/heap.cuh"

namespace jodc::cuda {

const char* OpName(int32_t op) {
  switch (static_cast<OpCode>(op)) {
#define JODC_OP_NAME(name, Camel) \
  case OpCode::k##Camel:          \
    return #name;
    JODC_HEAP_OPS(JODC_OP_NAME)
#undef JODC_OP_NAME
    case OpCode::kNone:
      break;
  }
  return "unknown op";
}

std::string CudaMessage(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

Error CheckBarrierTimeout(double seconds) {
  if (TimeoutNanos(seconds) < 0) {
    return InvalidArgument("barrier timeout must be > 0 seconds (or inf to wait forever), got " +
                           std::to_string(seconds));
  }
  return Error::Success();
}

}  // namespace jodc::cuda
