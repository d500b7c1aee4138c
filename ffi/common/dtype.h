// The element types the heap stores and the ops accept, independent of XLA's enum so CUDA code can use them too.
#ifndef JODC_FFI_COMMON_DTYPE_H_
#define JODC_FFI_COMMON_DTYPE_H_

#include <cstdint>
#include <string>

namespace jodc {

enum class Dtype : int32_t { kF32 = 0, kBF16 = 1 };

inline int32_t DtypeBytes(Dtype d) { return d == Dtype::kF32 ? 4 : 2; }
inline const char* DtypeName(Dtype d) { return d == Dtype::kF32 ? "float32" : "bfloat16"; }
inline bool ParseDtype(const std::string& name, Dtype* out) {
  if (name == "float32") { *out = Dtype::kF32; return true; }
  if (name == "bfloat16") { *out = Dtype::kBF16; return true; }
  return false;
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_DTYPE_H_
