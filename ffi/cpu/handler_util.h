// Small helpers shared by the CPU handlers: error construction, scalar operands (the XLA-free loops: kernels.h).
#ifndef JODC_FFI_CPU_HANDLER_UTIL_H_
#define JODC_FFI_CPU_HANDLER_UTIL_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "common/bf16.h"
#include "common/dtype.h"
#include "cpu/kernels.h"  // CopyConvert, AccumulateF32 and the core loops, XLA-free
#include "xla/ffi/api/ffi.h"

namespace jodc::cpu {

namespace ffi = xla::ffi;

inline ffi::Error InvalidArgument(const std::string& msg) { return ffi::Error::InvalidArgument(msg); }

// Reads an int32 scalar operand (device index, token); fails if the operand is not a single element.
inline bool ReadScalar(const char* op, const char* what, const ffi::Buffer<ffi::S32>& buf, int32_t* out,
                       std::string* err) {
  if (buf.element_count() != 1) {
    *err = std::string("jodc ") + op + ": operand '" + what + "' must be an int32 scalar, got " +
           std::to_string(buf.element_count()) + " elements";
    return false;
  }
  *out = buf.typed_data()[0];
  return true;
}

inline bool ToDtype(ffi::DataType t, Dtype* out) {
  if (t == ffi::DataType::F32) { *out = Dtype::kF32; return true; }
  if (t == ffi::DataType::BF16) { *out = Dtype::kBF16; return true; }
  return false;
}

}  // namespace jodc::cpu

#endif  // JODC_FFI_CPU_HANDLER_UTIL_H_
