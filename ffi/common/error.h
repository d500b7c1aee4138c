// How jodc's native code reports failures: XLA FFI's own types, everywhere. A fallible function returns ffi::Error
// (nothing else to return) or ffi::ErrorOr<T>; handlers return them to XLA as they are, the Python bindings turn
// them into exceptions by code (kResourceExhausted: MemoryError, others: ValueError), and nothing throws across a
// C, FFI or pybind11 boundary. Only this header names the XLA types, so a change of their API is fixed here.
#ifndef JODC_FFI_COMMON_ERROR_H_
#define JODC_FFI_COMMON_ERROR_H_

#include <optional>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jodc {

namespace ffi = xla::ffi;
using Error = ffi::Error;
template <typename T>
using ErrorOr = ffi::ErrorOr<T>;

inline Error InvalidArgument(std::string message) { return Error::InvalidArgument(std::move(message)); }
// An allocation that cannot be had (the bindings raise MemoryError for it).
inline Error OutOfMemory(std::string message) { return Error(ffi::ErrorCode::kResourceExhausted, std::move(message)); }

// The failed state of an ErrorOr<T>: `return Fail(InvalidArgument("..."));`.
inline ffi::Unexpected<Error> Fail(Error e) { return ffi::Unexpected<Error>(std::move(e)); }

// The code of `e` (Error::errc() is an optional in some jaxlib releases, a plain code in others).
inline ffi::ErrorCode CodeOf(ffi::ErrorCode code) { return code; }
template <typename Code>
ffi::ErrorCode CodeOf(const std::optional<Code>& code) {
  return code.has_value() ? static_cast<ffi::ErrorCode>(*code) : ffi::ErrorCode::kUnknown;
}
inline ffi::ErrorCode CodeOf(const Error& e) { return CodeOf(e.errc()); }

// `e` with "jodc <op>: " before its message (same code): what an op reports for a failure of the code it called.
inline Error ForOp(const char* op, const Error& e) {
  return Error(CodeOf(e), std::string("jodc ") + op + ": " + e.message());
}

// Whether `e` is an allocation that cannot be had (OutOfMemory).
inline bool IsOutOfMemory(const Error& e) { return e.failure() && CodeOf(e) == ffi::ErrorCode::kResourceExhausted; }

}  // namespace jodc

#endif  // JODC_FFI_COMMON_ERROR_H_
