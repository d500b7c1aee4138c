// gather: device d pulls every owner's shard of a bucket into one full vector in the requested compute dtype.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

Error Gather(Scalar device, Scalar token, ffi::Result<ffi::AnyBuffer> out, TokenOut token_out, int64_t heap_id,
             int64_t bucket_id) {
  return RunOp("gather", device, token, token_out, heap_id, bucket_id, [&](const OpTarget& t, int32_t d) -> Error {
    const Bucket& b = *t.bucket;
    ErrorOr<Dtype> out_t = CheckFullBucket("gather", "output", *out, b.layout, bucket_id);
    if (!out_t.has_value()) return out_t.error();
    GatherBucket(b, d, out->untyped_data(), *out_t);
    return Error::Success();
  });
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(Gather, jodc::cpu::Gather);
