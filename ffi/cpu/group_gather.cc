// group_gather: device d pulls the slot (its shard of a bucket, padding included) of every member of a group named
// at run time, into [k, shard] in the requested compute dtype, in list order: the forward half of an exchange among
// devices the planner chose (context parallelism). Starts with the caller's own slot and walks the list as a ring, so
// concurrent pulls read different members.
#include "common/group.h"
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

Error GroupGather(Scalar device, Scalar members, Scalar token, ffi::Result<ffi::AnyBuffer> out, TokenOut token_out,
                  int64_t heap_id, int64_t bucket_id) {
  return RunOp("group_gather", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) -> Error {
                 const Bucket& b = *t.bucket;
                 ErrorOr<GroupMembers> group = ReadMembers("group_gather", members, t.heap->world, d);
                 if (!group.has_value()) return group.error();
                 const int32_t k = group->size();
                 ErrorOr<Dtype> out_t = CheckGroupSlots("group_gather", "output", *out, b.layout, k);
                 if (!out_t.has_value()) return out_t.error();
                 const int64_t n = b.layout.shard_numel, slot_bytes = n * DtypeBytes(*out_t);
                 char* dst = static_cast<char*>(out->untyped_data());
                 for (int32_t j = 0; j < k; ++j) {
                   const int32_t i = (group->caller + j) % k;
                   CopyConvert(dst + i * slot_bytes, *out_t, b.shard(group->devices[i]), b.master, n);
                 }
                 return Error::Success();
               });
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(GroupGather, jodc::cpu::GroupGather);
