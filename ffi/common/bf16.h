// bfloat16 <-> float32 conversion (round to nearest even, NaN kept quiet), usable on host and device.
#ifndef JODC_FFI_COMMON_BF16_H_
#define JODC_FFI_COMMON_BF16_H_

#include <cstdint>
#include <cstring>

#include "common/layout.h"

namespace jodc {

JODC_HD inline float Bf16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

JODC_HD inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  }
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_BF16_H_
