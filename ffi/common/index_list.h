// "[0, 3, 5]": the indices i in [0, n) for which `pick(i)` holds, as the barriers' timeout messages name the devices
// (and processes) that never arrived.
#ifndef JODC_FFI_COMMON_INDEX_LIST_H_
#define JODC_FFI_COMMON_INDEX_LIST_H_

#include <cstdint>
#include <string>

namespace jodc {

template <typename Pick>
std::string IndexList(int32_t n, Pick pick) {
  std::string out = "[";
  for (int32_t i = 0; i < n; ++i) {
    if (!pick(i)) continue;
    if (out.size() > 1) out += ", ";
    out += std::to_string(i);
  }
  return out + "]";
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_INDEX_LIST_H_
