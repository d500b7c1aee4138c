// The member list of the group ops (ffi/common/ops.h: group_gather, group_scatter_accumulate, group_barrier): an int32
// [k] operand of heap positions, read and checked on the host by every host backend with one wording, and the check of
// their [k, shard] slot operands. A list is valid when 1 <= k <= world, every entry is in [0, world), none repeats and
// the calling device is one of them.
#ifndef JODC_FFI_COMMON_GROUP_H_
#define JODC_FFI_COMMON_GROUP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/bindings.h"
#include "common/error.h"
#include "common/layout.h"
#include "common/operands.h"

namespace jodc {

// A checked member list and the caller's index in it.
struct GroupMembers {
  std::vector<int32_t> devices;  // heap positions, in list order (the order of the slots)
  int32_t caller = -1;           // index of the calling device in `devices`
  int32_t size() const { return static_cast<int32_t>(devices.size()); }
};

// The member list `members` (host memory) for the calling `device` of a heap of `world` devices, or an
// InvalidArgument error naming the op and the fault.
inline ErrorOr<GroupMembers> ReadMembers(const char* op, const Scalar& members, int32_t world, int32_t device) {
  const int64_t k = static_cast<int64_t>(members.element_count());
  const std::string where = std::string("jodc ") + op + ": member list ";
  if (k < 1 || k > world)
    return Fail(InvalidArgument(where + "has " + std::to_string(k) + " entries, expected 1 to " +
                                std::to_string(world) + " (the heap's devices)"));
  GroupMembers out;
  std::vector<char> seen(world, 0);
  const int32_t* data = members.typed_data();
  for (int64_t i = 0; i < k; ++i) {
    const int32_t m = data[i];
    if (m < 0 || m >= world)
      return Fail(InvalidArgument(where + "entry " + std::to_string(i) + " is " + std::to_string(m) + ", outside [0, " +
                                  std::to_string(world) + ")"));
    if (seen[m]) return Fail(InvalidArgument(where + "names device " + std::to_string(m) + " twice"));
    seen[m] = 1;
    if (m == device) out.caller = static_cast<int32_t>(i);
    out.devices.push_back(m);
  }
  if (out.caller < 0)
    return Fail(InvalidArgument(where + "does not hold the calling device " + std::to_string(device)));
  return out;
}

// A [k, shard] slots operand (group_gather's output, group_scatter_accumulate's slices): float32 or bfloat16,
// k * shard_numel elements. Returns its dtype.
inline ErrorOr<Dtype> CheckGroupSlots(const char* op, const char* what, const ffi::AnyBuffer& buf,
                                      const BucketLayout& layout, int32_t k) {
  Dtype t;
  if (!ToDtype(buf.element_type(), &t))
    return Fail(InvalidArgument(std::string("jodc ") + op + ": " + what + " must be float32 or bfloat16"));
  const int64_t want = layout.shard_numel * k;
  if (static_cast<int64_t>(buf.element_count()) != want) {
    return Fail(InvalidArgument(std::string("jodc ") + op + ": " + what + " has " +
                                std::to_string(buf.element_count()) + " elements, " + std::to_string(k) +
                                " members' slots of " + std::to_string(layout.shard_numel) + " have " +
                                std::to_string(want)));
  }
  return t;
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_GROUP_H_
