// Helpers shared by the MPI handlers. Operand reading and dtype conversion are the CPU backend's (header-only,
// ffi/cpu/handler_util.h), so both backends convert and accumulate identically (bit-for-bit in deterministic mode).
#ifndef JODC_FFI_MPI_HANDLER_UTIL_H_
#define JODC_FFI_MPI_HANDLER_UTIL_H_

#include <string>

#include "cpu/handler_util.h"
#include "mpi/heap.h"
#include "xla/ffi/api/ffi.h"

namespace jodc::mpi {

namespace ffi = xla::ffi;
using cpu::CopyConvert;
using cpu::ReadScalar;
using cpu::ToDtype;

inline ffi::Error InvalidArgument(const std::string& msg) { return ffi::Error::InvalidArgument(msg); }

// An MPI call failed inside an op: the heap is poisoned (peers are told) and the op fails with the message.
inline ffi::Error MpiFailure(Heap& h, const char* op, const char* call, int code) {
  std::string err;
  MpiOk(code, op, call, &err);
  return ffi::Error(ffi::ErrorCode::kInternal, Poison(h, err));
}

// Reads the (device, token) scalar operands every handler starts with.
inline bool ReadDeviceAndToken(const char* op, const ffi::Buffer<ffi::S32>& device_buf,
                               const ffi::Buffer<ffi::S32>& token, int32_t* device, int32_t* tok, std::string* err) {
  return ReadScalar(op, "device", device_buf, device, err) && ReadScalar(op, "token", token, tok, err);
}

}  // namespace jodc::mpi

#endif  // JODC_FFI_MPI_HANDLER_UTIL_H_
