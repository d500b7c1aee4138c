// accumulator: device d reads (as fp32) or zeroes the gradient accumulated into its own shard of a bucket.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

Error ReadAcc(Scalar device, Scalar token, ffi::Result<ffi::Buffer<ffi::F32>> out, TokenOut token_out,
              int64_t heap_id, int64_t bucket_id) {
  return RunOp("read_accumulator", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) -> Error {
                 if (Error e = CheckAccumulatorOut(*out, t.bucket->layout); e.failure()) return e;
                 ReadAccumulator(*t.bucket, d, t.heap->deterministic, out->typed_data());
                 return Error::Success();
               });
}

Error ZeroAcc(Scalar device, Scalar token, TokenOut token_out, int64_t heap_id, int64_t bucket_id) {
  return RunOp("zero_accumulator", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) -> Error {
                 ZeroAccumulator(*t.bucket, d, t.heap->deterministic);
                 return Error::Success();
               });
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(ReadAccumulator, jodc::cpu::ReadAcc);
JODC_CPU_HANDLER(ZeroAccumulator, jodc::cpu::ZeroAcc);
