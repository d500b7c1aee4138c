// The first step of registering a bucket, the same on every backend (CPU, CUDA, NVSHMEM): its size checked, its
// layout and byte counts computed with the checked arithmetic of common/layout.h, and the words that registration
// errors name it by. Nothing is allocated until this has succeeded.
#ifndef JODC_FFI_COMMON_BUCKET_PLAN_H_
#define JODC_FFI_COMMON_BUCKET_PLAN_H_

#include <cstdint>
#include <sstream>
#include <string>

#include "common/dtype.h"
#include "common/error.h"
#include "common/layout.h"

namespace jodc {

struct BucketPlan {
  BucketLayout layout;
  BucketBytes bytes;
  std::string what;  // "a bucket of N <dtype> elements over W devices in heap H"
};

// The plan of a bucket of `numel` elements of `master` over `world` devices of heap `heap_id` (landing_slots: every
// owner also keeps `world` fp32 slots). InvalidArgument for numel < 1, or when its memory overflows 64-bit byte counts.
inline ErrorOr<BucketPlan> PlanBucket(int64_t numel, Dtype master, int32_t world, bool landing_slots,
                                      int64_t heap_id) {
  if (numel < 1) return Fail(InvalidArgument("bucket size must be >= 1 element, got " + std::to_string(numel)));
  BucketPlan plan;
  plan.what = "a bucket of " + std::to_string(numel) + " " + DtypeName(master) + " elements over " +
              std::to_string(world) + " devices in heap " + std::to_string(heap_id);
  plan.layout = MakeLayout(numel, world, DtypeBytes(master));
  if (plan.layout.shard_numel < 1 || !CheckedBucketBytes(plan.layout, landing_slots, &plan.bytes)) {
    std::ostringstream msg;
    const double per_element = DtypeBytes(master) + 4.0 + (landing_slots ? 4.0 * world : 0.0);
    msg << plan.what << " is too large: its memory (about " << static_cast<double>(numel) * per_element
        << " bytes) overflows 64-bit byte counts";
    return Fail(InvalidArgument(msg.str()));
  }
  return plan;
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_BUCKET_PLAN_H_
