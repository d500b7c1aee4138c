// publish: device d overwrites its own master shard of a bucket (after its optimizer step) so peers gather it.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"
#include "cpu/heap.h"

namespace jodc::cpu {
namespace {

ffi::Error PublishImpl(ffi::Buffer<ffi::S32> device_buf, ffi::AnyBuffer shard, ffi::Buffer<ffi::S32> token,
                       ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id,
                       int32_t* device_out) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadScalar("publish", "device", device_buf, &device, &err) || !ReadScalar("publish", "token", token, &tok, &err))
    return InvalidArgument(err);
  *device_out = device;
  OpTarget t;
  if (!ResolveTarget("publish", heap_id, bucket_id, device, &t, &err)) return InvalidArgument(err);
  const Bucket& b = *t.bucket;
  Dtype in_t;
  if (!ToDtype(shard.element_type(), &in_t) || in_t != b.master) {
    return InvalidArgument(std::string("jodc publish: shard must have the bucket's master dtype ") +
                           DtypeName(b.master));
  }
  if (static_cast<int64_t>(shard.element_count()) != b.layout.shard_numel) {
    return InvalidArgument("jodc publish: shard has " + std::to_string(shard.element_count()) +
                           " elements, the bucket's shards have " + std::to_string(b.layout.shard_numel));
  }
  CopyConvert(b.shard(device), b.master, shard.untyped_data(), in_t, b.layout.shard_numel);
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

// Any error aborts the heap, so peers waiting in a barrier for this device fail at once.
ffi::Error Publish(ffi::Buffer<ffi::S32> device_buf, ffi::AnyBuffer shard, ffi::Buffer<ffi::S32> token,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  int32_t device = -1;
  ffi::Error e = PublishImpl(device_buf, shard, token, token_out, heap_id, bucket_id, &device);
  if (e.failure()) AbortOnHandlerError(heap_id, device, e.message());
  return e;
}

}  // namespace
}  // namespace jodc::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcPublishCpu, jodc::cpu::Publish,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::AnyBuffer>()              // new local shard, master dtype
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));
