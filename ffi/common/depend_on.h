// depend_on's backend-independent half: its operands checked and each value forwarded to its result. XLA normally
// aliases every result to its value, so nothing moves; a value it did not alias is copied by the backend's `copy`
// (memcpy on the host, cudaMemcpyAsync on the op's stream).
#ifndef JODC_FFI_COMMON_DEPEND_ON_H_
#define JODC_FFI_COMMON_DEPEND_ON_H_

#include <cstddef>
#include <string>

#include "common/bindings.h"
#include "common/error.h"
#include "common/operands.h"

namespace jodc {

// token: an int32 scalar; values and results: as many of each, pairwise of one size. copy(dst, src, bytes) -> Error
// runs for each pair XLA did not alias.
template <typename Copy>
Error ForwardValues(const Scalar& token, ffi::RemainingArgs values, ffi::RemainingRets outs, Copy&& copy) {
  if (Error e = CheckToken("depend_on", token); e.failure()) return e;
  if (values.size() != outs.size())
    return InvalidArgument("jodc depend_on: " + std::to_string(values.size()) + " values but " +
                           std::to_string(outs.size()) + " results");
  for (size_t i = 0; i < values.size(); ++i) {
    auto in = values.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) return InvalidArgument("jodc depend_on: operands must be arrays");
    if (in->size_bytes() != (*out)->size_bytes())
      return InvalidArgument("jodc depend_on: result " + std::to_string(i) + " differs in size from its value");
    if ((*out)->untyped_data() == in->untyped_data()) continue;  // aliased by XLA: nothing to move
    if (Error e = copy((*out)->untyped_data(), in->untyped_data(), in->size_bytes()); e.failure()) return e;
  }
  return Error::Success();
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_DEPEND_ON_H_
