// accumulator: device d reads (as fp32) or zeroes the gradient accumulated into its own shard of a bucket.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"
#include "cpu/heap.h"

namespace jodc::cpu {
namespace {

ffi::Error ReadAccImpl(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token,
                       ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::S32>> token_out,
                       int64_t heap_id, int64_t bucket_id, int32_t* device_out) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadScalar("read_accumulator", "device", device_buf, &device, &err) ||
      !ReadScalar("read_accumulator", "token", token, &tok, &err))
    return InvalidArgument(err);
  *device_out = device;
  OpTarget t;
  if (!ResolveTarget("read_accumulator", heap_id, bucket_id, device, &t, &err)) return InvalidArgument(err);
  if (static_cast<int64_t>(out->element_count()) != t.bucket->layout.shard_numel) {
    return InvalidArgument("jodc read_accumulator: output has " + std::to_string(out->element_count()) +
                           " elements, the shard has " + std::to_string(t.bucket->layout.shard_numel));
  }
  ReadAccumulator(*t.bucket, device, t.heap->deterministic, out->typed_data());
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

// Any error aborts the heap, so peers waiting in a barrier for this device fail at once.
ffi::Error ReadAcc(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token,
                   ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::S32>> token_out,
                   int64_t heap_id, int64_t bucket_id) {
  int32_t device = -1;
  ffi::Error e = ReadAccImpl(device_buf, token, out, token_out, heap_id, bucket_id, &device);
  if (e.failure()) AbortOnHandlerError(heap_id, device, e.message());
  return e;
}

ffi::Error ZeroAccImpl(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token,
                       ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id,
                       int32_t* device_out) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadScalar("zero_accumulator", "device", device_buf, &device, &err) ||
      !ReadScalar("zero_accumulator", "token", token, &tok, &err))
    return InvalidArgument(err);
  *device_out = device;
  OpTarget t;
  if (!ResolveTarget("zero_accumulator", heap_id, bucket_id, device, &t, &err)) return InvalidArgument(err);
  ZeroAccumulator(*t.bucket, device, t.heap->deterministic);
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

// Any error aborts the heap, so peers waiting in a barrier for this device fail at once.
ffi::Error ZeroAcc(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  int32_t device = -1;
  ffi::Error e = ZeroAccImpl(device_buf, token, token_out, heap_id, bucket_id, &device);
  if (e.failure()) AbortOnHandlerError(heap_id, device, e.message());
  return e;
}

}  // namespace
}  // namespace jodc::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcReadAccumulatorCpu, jodc::cpu::ReadAcc,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // the device's accumulated shard
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcZeroAccumulatorCpu, jodc::cpu::ZeroAcc,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));
