// The frame of every heap op whose device index and token are host scalars (the CPU and MPI backends): read both,
// resolve the heap (and bucket) for the device, run the op's body, advance the token; on any failure let the backend
// react (the CPU heap aborts, so peers waiting in a barrier for this device fail at once) and return the error.
#ifndef JODC_FFI_COMMON_HOST_OP_H_
#define JODC_FFI_COMMON_HOST_OP_H_

#include <cstdint>
#include <string>
#include <utility>

#include "common/bindings.h"
#include "common/error.h"
#include "common/operands.h"

namespace jodc {

// An int32 scalar operand in host memory (device index, token); an error unless it holds exactly one element.
inline ErrorOr<int32_t> ReadScalar(const char* op, const char* what, const Scalar& buf) {
  if (Error e = CheckScalar(op, what, buf); e.failure()) return Fail(std::move(e));
  return buf.typed_data()[0];
}

// resolve(device) -> ErrorOr<Target>; body(const Target&, device) -> Error; on_error(device, error): the backend's
// reaction to a failure (device is -1 when the operands could not be read).
template <typename Resolve, typename Body, typename OnError>
Error RunHostOp(const char* op, const Scalar& device_buf, const Scalar& token, TokenOut& token_out, Resolve&& resolve,
                Body&& body, OnError&& on_error) {
  int32_t device = -1;
  Error e = [&]() -> Error {
    ErrorOr<int32_t> d = ReadScalar(op, "device", device_buf);
    if (!d.has_value()) return d.error();
    ErrorOr<int32_t> tok = ReadScalar(op, "token", token);
    if (!tok.has_value()) return tok.error();
    device = *d;
    auto target = resolve(device);
    if (!target.has_value()) return target.error();
    if (Error failed = body(*target, device); failed.failure()) return failed;
    token_out->typed_data()[0] = *tok + 1;
    return Error::Success();
  }();
  if (e.failure()) on_error(device, e);
  return e;
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_HOST_OP_H_
