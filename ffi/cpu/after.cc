// after: a token that exists only once every operand exists. XLA expands optimization barriers before it
// schedules, so an ordering must be carried by a real operand of a call it cannot see through: this one.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

ffi::Error After(ffi::Buffer<ffi::S32> token, ffi::RemainingArgs values, ffi::Result<ffi::Buffer<ffi::S32>> token_out) {
  if (token.element_count() != 1) return InvalidArgument("jodc after: the token must be an int32 scalar");
  token_out->typed_data()[0] = token.typed_data()[0] + 1;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jodc::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcAfterCpu, jodc::cpu::After,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .RemainingArgs()                         // values to wait for (not read)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());
