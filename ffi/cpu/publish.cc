// publish: device d overwrites its own master shard of a bucket (after its optimizer step) so peers gather it.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

Error Publish(Scalar device, ffi::AnyBuffer shard, Scalar token, TokenOut token_out, int64_t heap_id,
              int64_t bucket_id) {
  return RunOp("publish", device, token, token_out, heap_id, bucket_id, [&](const OpTarget& t, int32_t d) -> Error {
    const Bucket& b = *t.bucket;
    if (Error e = CheckShard(shard, b.layout, b.master); e.failure()) return e;
    CopyConvert(b.shard(d), b.master, shard.untyped_data(), b.master, b.layout.shard_numel);
    return Error::Success();
  });
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(Publish, jodc::cpu::Publish);
