// depend_on: returns its values unchanged (outputs alias inputs, so normally nothing moves) but only once the token
// exists: makes the consumers of the values wait for an op, e.g. a barrier.
#include <cstring>

#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

Error DependOn(Scalar token, ffi::RemainingArgs values, ffi::RemainingRets outs) {
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
    if ((*out)->untyped_data() != in->untyped_data())  // not aliased by XLA: copy
      std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
  }
  return Error::Success();
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(DependOn, jodc::cpu::DependOn);
