// What the MPI handlers share: the heap-op frame (common/host_op.h) bound to the MPI heap, and the CPU backend's
// dtype conversion (header-only, ffi/cpu/kernels.h), so both backends convert and accumulate identically
// (bit-for-bit in deterministic mode).
#ifndef JODC_FFI_MPI_HANDLER_UTIL_H_
#define JODC_FFI_MPI_HANDLER_UTIL_H_

#include <cstdint>
#include <string>
#include <utility>

#include "common/bindings.h"
#include "common/error.h"
#include "common/host_op.h"
#include "common/operands.h"
#include "cpu/kernels.h"
#include "mpi/heap.h"
#include "xla/ffi/api/ffi.h"

namespace jodc::mpi {

namespace ffi = xla::ffi;
using cpu::CopyConvert;

// An MPI call failed inside an op: the heap is poisoned (peers are told) and the op fails with the message.
inline Error MpiFailure(Heap& h, const char* op, const char* call, int code) {
  return Error::Internal(Poison(h, MpiCheck(code, op, call).message()));
}

// Runs `body(const OpTarget&, device) -> Error` as op `op` on bucket `bucket_id` (-1: a heap-level op) of heap
// `heap_id`, for one of this process's devices. Failures of MPI calls poison the heap themselves (MpiFailure);
// invalid operands leave it usable.
template <typename Body>
Error RunOp(const char* op, const Scalar& device, const Scalar& token, TokenOut& token_out, int64_t heap_id,
            int64_t bucket_id, Body&& body) {
  return RunHostOp(
      op, device, token, token_out,
      [&](int32_t d) { return ResolveTarget(op, heap_id, bucket_id, d, /*must_be_local=*/true); },
      std::forward<Body>(body), [](int32_t, const Error&) {});
}

}  // namespace jodc::mpi

// Defines the MPI handler symbol Jodc<Camel>Mpi of op Camel (ffi/common/ops.h, binding: ffi/common/bindings.h).
#define JODC_MPI_HANDLER(Camel, impl) JODC_DEFINE_HANDLER(Camel, Mpi, impl, ::xla::ffi::Ffi::Bind())

#endif  // JODC_FFI_MPI_HANDLER_UTIL_H_
