// scatter_accumulate: device d adds each owner's slice of a full-size gradient into that owner's fp32 accumulator.
// Race-free: non-deterministic mode takes the owner's lock (devices start at different owners of the ring, so
// all-to-one contention only arises when pushes are skewed); deterministic mode writes only its own landing slot.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

Error ScatterAccumulate(Scalar device, ffi::AnyBuffer grad, Scalar token, TokenOut token_out, int64_t heap_id,
                        int64_t bucket_id) {
  return RunOp("scatter_accumulate", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) -> Error {
                 const Bucket& b = *t.bucket;
                 ErrorOr<Dtype> grad_t = CheckFullBucket("scatter_accumulate", "gradient", grad, b.layout, bucket_id);
                 if (!grad_t.has_value()) return grad_t.error();
                 ScatterAccumulateBucket(b, d, t.heap->deterministic, grad.untyped_data(), *grad_t);
                 return Error::Success();
               });
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(ScatterAccumulate, jodc::cpu::ScatterAccumulate);
