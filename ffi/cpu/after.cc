// after: a token that exists only once every operand exists. XLA expands optimization barriers before it
// schedules, so an ordering must be carried by a real operand of a call it cannot see through: this one.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

Error After(Scalar token, ffi::RemainingArgs values, TokenOut token_out) {
  if (Error e = CheckToken("after", token); e.failure()) return e;
  token_out->typed_data()[0] = token.typed_data()[0] + 1;
  return Error::Success();
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(After, jodc::cpu::After);
