// group_scatter_accumulate: device d adds slice i of [k, shard] into the fp32 accumulator of the i-th member of a group
// named at run time: the backward half of an exchange among devices the planner chose (the reduce-scatter of the
// gathered slots' cotangents). Race-free as scatter_accumulate: the owner's lock, or, in deterministic mode, the
// caller's own landing slot at the owner. Remote members first, the caller's own slot last.
#include <mutex>

#include "common/group.h"
#include "cpu/handler_util.h"
#include "cpu/handlers.h"

namespace jodc::cpu {
namespace {

Error GroupScatterAccumulate(Scalar device, Scalar members, ffi::AnyBuffer slices, Scalar token, TokenOut token_out,
                             int64_t heap_id, int64_t bucket_id) {
  return RunOp("group_scatter_accumulate", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) -> Error {
                 const Bucket& b = *t.bucket;
                 ErrorOr<GroupMembers> group = ReadMembers("group_scatter_accumulate", members, t.heap->world, d);
                 if (!group.has_value()) return group.error();
                 const int32_t k = group->size();
                 ErrorOr<Dtype> in_t = CheckGroupSlots("group_scatter_accumulate", "slices", slices, b.layout, k);
                 if (!in_t.has_value()) return in_t.error();
                 const int64_t n = b.layout.shard_numel, slot_bytes = n * DtypeBytes(*in_t);
                 const char* src = static_cast<const char*>(slices.untyped_data());
                 for (int32_t j = 1; j <= k; ++j) {
                   const int32_t i = (group->caller + j) % k;
                   const int32_t owner = group->devices[i];
                   if (t.heap->deterministic) {
                     AccumulateF32(b.landing_slot(owner, d), src + i * slot_bytes, *in_t, n);
                   } else {
                     std::lock_guard<std::mutex> lock(*b.owner_locks[owner]);
                     AccumulateF32(b.accumulator(owner), src + i * slot_bytes, *in_t, n);
                   }
                 }
                 return Error::Success();
               });
}

}  // namespace
}  // namespace jodc::cpu

JODC_CPU_HANDLER(GroupScatterAccumulate, jodc::cpu::GroupScatterAccumulate);
