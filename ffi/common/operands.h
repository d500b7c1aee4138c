// The checks every backend makes of an op's array operands before touching memory, with one wording: a wrong dtype
// or size is an InvalidArgument error naming the op, the operand and both sizes.
#ifndef JODC_FFI_COMMON_OPERANDS_H_
#define JODC_FFI_COMMON_OPERANDS_H_

#include <cstdint>
#include <string>

#include "common/bindings.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/layout.h"

namespace jodc {

// An int32 scalar operand (device index, token): an error naming the op and the operand unless it holds exactly one
// element. (On GPUs the values stay on the device: only the count can be checked on the host.)
inline Error CheckScalar(const char* op, const char* what, const Scalar& buf) {
  if (buf.element_count() == 1) return Error::Success();
  return InvalidArgument(std::string("jodc ") + op + ": operand '" + what + "' must be an int32 scalar, got " +
                         std::to_string(buf.element_count()) + " elements");
}

// The (device, token) operands every heap op starts with.
inline Error CheckScalars(const char* op, const Scalar& device, const Scalar& token) {
  if (Error e = CheckScalar(op, "device", device); e.failure()) return e;
  return CheckScalar(op, "token", token);
}

// The jodc dtype of an XLA element type: float32 and bfloat16 only.
inline bool ToDtype(ffi::DataType t, Dtype* out) {
  if (t == ffi::DataType::F32) {
    *out = Dtype::kF32;
    return true;
  }
  if (t == ffi::DataType::BF16) {
    *out = Dtype::kBF16;
    return true;
  }
  return false;
}

// A full-bucket operand (gather's output, scatter_accumulate's gradient): float32 or bfloat16, the bucket's numel
// elements. Returns its dtype.
inline ErrorOr<Dtype> CheckFullBucket(const char* op, const char* what, const ffi::AnyBuffer& buf,
                                      const BucketLayout& layout, int64_t bucket_id) {
  Dtype t;
  if (!ToDtype(buf.element_type(), &t))
    return Fail(InvalidArgument(std::string("jodc ") + op + ": " + what + " must be float32 or bfloat16"));
  if (static_cast<int64_t>(buf.element_count()) != layout.numel) {
    return Fail(InvalidArgument(std::string("jodc ") + op + ": " + what + " has " +
                                std::to_string(buf.element_count()) + " elements, bucket " +
                                std::to_string(bucket_id) + " has " + std::to_string(layout.numel)));
  }
  return t;
}

// publish's new shard: the bucket's master dtype, shard_numel elements.
inline Error CheckShard(const ffi::AnyBuffer& shard, const BucketLayout& layout, Dtype master) {
  Dtype t;
  if (!ToDtype(shard.element_type(), &t) || t != master)
    return InvalidArgument(std::string("jodc publish: shard must have the bucket's master dtype ") + DtypeName(master));
  if (static_cast<int64_t>(shard.element_count()) != layout.shard_numel) {
    return InvalidArgument("jodc publish: shard has " + std::to_string(shard.element_count()) +
                           " elements, the bucket's shards have " + std::to_string(layout.shard_numel));
  }
  return Error::Success();
}

// read_accumulator's output: the device's fp32 shard, shard_numel elements.
inline Error CheckAccumulatorOut(const ffi::Buffer<ffi::F32>& out, const BucketLayout& layout) {
  if (static_cast<int64_t>(out.element_count()) == layout.shard_numel) return Error::Success();
  return InvalidArgument("jodc read_accumulator: output has " + std::to_string(out.element_count()) +
                         " elements, the shard has " + std::to_string(layout.shard_numel));
}

// The token operand of the token ops (after, depend_on): an int32 scalar.
inline Error CheckToken(const char* op, const ffi::Buffer<ffi::S32>& token) {
  if (token.element_count() == 1) return Error::Success();
  return InvalidArgument(std::string("jodc ") + op + ": the token must be an int32 scalar");
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_OPERANDS_H_
