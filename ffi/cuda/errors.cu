// Names and messages shared by every CUDA library of jodc (the CUDA backend and the NVSHMEM backend compile this
// file): op names for device faults, CUDA error messages, the barrier timeout check.
#include <string>

#include "cuda/heap.cuh"

namespace jodc::cuda {

const char* OpName(int32_t op) {
  switch (static_cast<OpCode>(op)) {
    case OpCode::kGather: return "gather";
    case OpCode::kScatterAccumulate: return "scatter_accumulate";
    case OpCode::kBarrier: return "barrier";
    case OpCode::kReadAccumulator: return "read_accumulator";
    case OpCode::kZeroAccumulator: return "zero_accumulator";
    case OpCode::kPublish: return "publish";
  }
  return "unknown op";
}

std::string CudaMessage(const char* what, cudaError_t e) {
  return std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

bool CheckBarrierTimeout(double seconds, std::string* err) {
  if (TimeoutNanos(seconds) < 0) {
    *err = "barrier timeout must be > 0 seconds (or inf to wait forever), got " + std::to_string(seconds);
    return false;
  }
  return true;
}

}  // namespace jodc::cuda
