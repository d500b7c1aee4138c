// scatter_accumulate: device d adds each owner's slice of a full-size gradient into that owner's fp32 accumulator.
// Race-free: non-deterministic mode takes the owner's lock (devices start at different owners of the ring, so
// all-to-one contention only arises when pushes are skewed); deterministic mode writes only its own landing slot.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"
#include "cpu/heap.h"

namespace jodc::cpu {
namespace {

ffi::Error ScatterAccumulateImpl(ffi::Buffer<ffi::S32> device_buf, ffi::AnyBuffer grad, ffi::Buffer<ffi::S32> token,
                                 ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id,
                                 int32_t* device_out) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadScalar("scatter_accumulate", "device", device_buf, &device, &err) ||
      !ReadScalar("scatter_accumulate", "token", token, &tok, &err))
    return InvalidArgument(err);
  *device_out = device;
  OpTarget t;
  if (!ResolveTarget("scatter_accumulate", heap_id, bucket_id, device, &t, &err)) return InvalidArgument(err);
  const Bucket& b = *t.bucket;
  Dtype grad_t;
  if (!ToDtype(grad.element_type(), &grad_t))
    return InvalidArgument("jodc scatter_accumulate: gradient must be float32 or bfloat16");
  if (static_cast<int64_t>(grad.element_count()) != b.layout.numel) {
    return InvalidArgument("jodc scatter_accumulate: gradient has " + std::to_string(grad.element_count()) +
                           " elements, bucket " + std::to_string(bucket_id) + " has " +
                           std::to_string(b.layout.numel));
  }
  ScatterAccumulateBucket(b, device, t.heap->deterministic, grad.untyped_data(), grad_t);
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

// Any error aborts the heap, so peers waiting in a barrier for this device fail at once.
ffi::Error ScatterAccumulate(ffi::Buffer<ffi::S32> device_buf, ffi::AnyBuffer grad, ffi::Buffer<ffi::S32> token,
                             ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  int32_t device = -1;
  ffi::Error e = ScatterAccumulateImpl(device_buf, grad, token, token_out, heap_id, bucket_id, &device);
  if (e.failure()) AbortOnHandlerError(heap_id, device, e.message());
  return e;
}

}  // namespace
}  // namespace jodc::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcScatterAccumulateCpu, jodc::cpu::ScatterAccumulate,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::AnyBuffer>()              // full-size gradient (f32 / bf16)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));
