// depend_on: returns its values unchanged (outputs alias inputs, so normally nothing moves) but only once the token
// exists: makes the consumers of the values wait for an op, e.g. a barrier.
#include <cstring>

#include "common/depend_on.h"
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

Error DependOn(Scalar token, ffi::RemainingArgs values, ffi::RemainingRets outs) {
  return ForwardValues(token, values, outs, [](void* dst, const void* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    return Error::Success();
  });
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(DependOn, jodc::cpu::DependOn);
