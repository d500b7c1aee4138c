// Names and messages shared by every CUDA library of jodc (the CUDA backend and the NVSHMEM backend compile this
// file): op names for device faults, CUDA error messages, the barrier timeout check and message.
#include <sstream>
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

std::string BarrierTimeoutMessage(double timeout_s, const BarrierReport& report, int32_t world, int64_t heap_id) {
  std::ostringstream msg;
  msg << "jodc barrier timed out after " << timeout_s << " s in generation " << report.generation << " of heap "
      << heap_id << ": device(s) [";
  bool first = true;
  for (int32_t d = 0; d < world; ++d) {
    if ((report.missing >> d) & 1u) {
      msg << (first ? "" : ", ") << d;
      first = false;
    }
  }
  msg << "] never arrived (device " << report.device << " waited); the heap is now unusable: free and re-create it";
  return msg.str();
}

}  // namespace jodc::cuda
