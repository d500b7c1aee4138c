// Small helpers shared by the CPU handlers: error construction, scalar operands, element conversion loops.
#ifndef JODC_FFI_CPU_HANDLER_UTIL_H_
#define JODC_FFI_CPU_HANDLER_UTIL_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "common/bf16.h"
#include "common/dtype.h"
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

// dst[i] = src[i] with conversion between fp32 and bf16 (plain memcpy when the types agree).
inline void CopyConvert(void* dst, Dtype dst_t, const void* src, Dtype src_t, int64_t n) {
  if (dst_t == src_t) {
    std::memcpy(dst, src, n * DtypeBytes(dst_t));
  } else if (dst_t == Dtype::kF32) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    float* d = static_cast<float*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = Bf16ToF32(s[i]);
  } else {
    const float* s = static_cast<const float*>(src);
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = F32ToBf16(s[i]);
  }
}

// acc[i] += src[i] in fp32, whatever the source type.
inline void AccumulateF32(float* __restrict acc, const void* src, Dtype src_t, int64_t n) {
  if (src_t == Dtype::kF32) {
    const float* __restrict s = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] += s[i];
  } else {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) acc[i] += Bf16ToF32(s[i]);
  }
}

}  // namespace jodc::cpu

#endif  // JODC_FFI_CPU_HANDLER_UTIL_H_
