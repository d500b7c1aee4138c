// gather: device d pulls every owner's shard of a bucket into one full vector in the requested compute dtype.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"
#include "cpu/heap.h"

namespace jodc::cpu {
namespace {

ffi::Error GatherImpl(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id,
                      int32_t* device_out) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadScalar("gather", "device", device_buf, &device, &err) || !ReadScalar("gather", "token", token, &tok, &err))
    return InvalidArgument(err);
  *device_out = device;
  OpTarget t;
  if (!ResolveTarget("gather", heap_id, bucket_id, device, &t, &err)) return InvalidArgument(err);
  const Bucket& b = *t.bucket;
  Dtype out_t;
  if (!ToDtype(out->element_type(), &out_t)) return InvalidArgument("jodc gather: output must be float32 or bfloat16");
  if (static_cast<int64_t>(out->element_count()) != b.layout.numel) {
    return InvalidArgument("jodc gather: output has " + std::to_string(out->element_count()) +
                           " elements, bucket " + std::to_string(bucket_id) + " has " +
                           std::to_string(b.layout.numel));
  }
  GatherBucket(b, device, out->untyped_data(), out_t);
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

// Any error aborts the heap, so peers waiting in a barrier for this device fail at once.
ffi::Error Gather(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token, ffi::Result<ffi::AnyBuffer> out,
                  ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  int32_t device = -1;
  ffi::Error e = GatherImpl(device_buf, token, out, token_out, heap_id, bucket_id, &device);
  if (e.failure()) AbortOnHandlerError(heap_id, device, e.message());
  return e;
}

}  // namespace
}  // namespace jodc::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcGatherCpu, jodc::cpu::Gather,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::AnyBuffer>()              // full bucket, compute dtype
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));
