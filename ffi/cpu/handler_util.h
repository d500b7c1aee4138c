// What the CPU handlers share: the heap-op frame (common/host_op.h) bound to the CPU heap, and the core loops
// (kernels.h, XLA-free).
#ifndef JODC_FFI_CPU_HANDLER_UTIL_H_
#define JODC_FFI_CPU_HANDLER_UTIL_H_

#include <cstdint>
#include <utility>

#include "common/bindings.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/host_op.h"
#include "common/operands.h"
#include "cpu/heap.h"
#include "cpu/kernels.h"  // CopyConvert, AccumulateF32 and the core loops, XLA-free
#include "xla/ffi/api/ffi.h"

namespace jodc::cpu {

namespace ffi = xla::ffi;

// Runs `body(const OpTarget&, device) -> Error` as op `op` on bucket `bucket_id` (-1: a heap-level op) of heap
// `heap_id`. Any error aborts the heap, so peers waiting in a barrier for this device fail at once.
template <typename Body>
Error RunOp(const char* op, const Scalar& device, const Scalar& token, TokenOut& token_out, int64_t heap_id,
            int64_t bucket_id, Body&& body) {
  return RunHostOp(
      op, device, token, token_out, [&](int32_t d) { return ResolveTarget(op, heap_id, bucket_id, d); },
      std::forward<Body>(body), [&](int32_t d, const Error& e) { AbortOnHandlerError(heap_id, d, e.message()); });
}

}  // namespace jodc::cpu

// Defines the CPU handler symbol Jodc<Camel>Cpu of op Camel (ffi/common/ops.h, binding: ffi/common/bindings.h).
#define JODC_CPU_HANDLER(Camel, impl) JODC_DEFINE_HANDLER(Camel, Cpu, impl, ::xla::ffi::Ffi::Bind())

#endif  // JODC_FFI_CPU_HANDLER_UTIL_H_
