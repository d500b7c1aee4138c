// The XLA FFI signature of every op of ffi/common/ops.h, written once for all backends: its operands, results and
// attributes, in the order jodc/ops/<op>.py passes them. A backend defines its handler with JODC_DEFINE_HANDLER,
// starting from Ffi::Bind() (CPU, MPI) or from a binding that first takes the platform stream (CUDA).
#ifndef JODC_FFI_COMMON_BINDINGS_H_
#define JODC_FFI_COMMON_BINDINGS_H_

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jodc {

// The int32 scalar operands (the caller's device index on the heap's axis, the ordering token) and the token result.
using Scalar = xla::ffi::Buffer<xla::ffi::S32>;
using TokenOut = xla::ffi::Result<xla::ffi::Buffer<xla::ffi::S32>>;

namespace bindings {

namespace ffi = xla::ffi;

// Each takes the binding built so far as an rvalue (XLA's Binding cannot be copied or moved by us) and returns it
// extended.
template <typename B>
auto HeapAttr(B&& b) {
  return std::move(b).template Attr<int64_t>("heap");
}
template <typename B>
auto BucketAttrs(B&& b) {
  return HeapAttr(std::move(b)).template Attr<int64_t>("bucket");
}
// (device, token) -> (R, token) of a bucket: gather (R = the full bucket, compute dtype), read_accumulator (R = the
// device's fp32 shard).
template <typename R, typename B>
auto PullOp(B&& b) {
  return BucketAttrs(std::move(b).template Arg<Scalar>().template Arg<Scalar>().template Ret<R>().template Ret<Scalar>());
}
// (device, A, token) -> token of a bucket: scatter_accumulate (A = the full gradient), publish (A = the new shard).
template <typename B>
auto PushOp(B&& b) {
  return BucketAttrs(
      std::move(b).template Arg<Scalar>().template Arg<ffi::AnyBuffer>().template Arg<Scalar>().template Ret<Scalar>());
}

template <typename B>
auto Gather(B&& b) {
  return PullOp<ffi::AnyBuffer>(std::move(b));
}
template <typename B>
auto ReadAccumulator(B&& b) {
  return PullOp<ffi::Buffer<ffi::F32>>(std::move(b));
}
template <typename B>
auto ScatterAccumulate(B&& b) {
  return PushOp(std::move(b));
}
template <typename B>
auto Publish(B&& b) {
  return PushOp(std::move(b));
}
// (device, token) -> token of a bucket.
template <typename B>
auto ZeroAccumulator(B&& b) {
  return BucketAttrs(std::move(b).template Arg<Scalar>().template Arg<Scalar>().template Ret<Scalar>());
}
// (device, token) -> token of a heap.
template <typename B>
auto Barrier(B&& b) {
  return HeapAttr(std::move(b).template Arg<Scalar>().template Arg<Scalar>().template Ret<Scalar>());
}
// Group ops (the member list an int32 [k] operand after the device): (device, members, token) -> (R, token) of a
// bucket: group_gather (R = [k, shard] in the compute dtype).
template <typename B>
auto GroupGather(B&& b) {
  return BucketAttrs(std::move(b).template Arg<Scalar>().template Arg<Scalar>().template Arg<Scalar>()
                         .template Ret<ffi::AnyBuffer>().template Ret<Scalar>());
}
// (device, members, slices [k, shard], token) -> token of a bucket.
template <typename B>
auto GroupScatterAccumulate(B&& b) {
  return BucketAttrs(std::move(b).template Arg<Scalar>().template Arg<Scalar>().template Arg<ffi::AnyBuffer>()
                         .template Arg<Scalar>().template Ret<Scalar>());
}
// (device, members, token) -> token of a heap.
template <typename B>
auto GroupBarrier(B&& b) {
  return HeapAttr(std::move(b).template Arg<Scalar>().template Arg<Scalar>().template Arg<Scalar>()
                      .template Ret<Scalar>());
}
// (token, values to wait for...) -> token.
template <typename B>
auto After(B&& b) {
  return std::move(b).template Arg<Scalar>().RemainingArgs().template Ret<Scalar>();
}
// (token, values...) -> the same values.
template <typename B>
auto DependOn(B&& b) {
  return std::move(b).template Arg<Scalar>().RemainingArgs().RemainingRets();
}

}  // namespace bindings
}  // namespace jodc

// Defines handler symbol Jodc<Camel><Backend> (declared in ffi/<backend>/handlers.h) running `impl` with op Camel's
// binding, which `start` (an Ffi::Bind() expression) begins.
#define JODC_DEFINE_HANDLER(Camel, Backend, impl, start) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Jodc##Camel##Backend, impl, ::jodc::bindings::Camel(start))

#endif  // JODC_FFI_COMMON_BINDINGS_H_
