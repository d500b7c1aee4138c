// accumulator: device d reads (as fp32) or zeroes the gradient accumulated into its own shard of a bucket.
#include "cpu/handler_util.h"
#include "cpu/handlers.h"
#include "cpu/heap.h"

namespace jodc::cpu {
namespace {

ffi::Error ReadAcc(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token, ffi::Result<ffi::Buffer<ffi::F32>> out,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadScalar("read_accumulator", "device", device_buf, &device, &err) ||
      !ReadScalar("read_accumulator", "token", token, &tok, &err))
    return InvalidArgument(err);
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

ffi::Error ZeroAcc(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadScalar("zero_accumulator", "device", device_buf, &device, &err) ||
      !ReadScalar("zero_accumulator", "token", token, &tok, &err))
    return InvalidArgument(err);
  OpTarget t;
  if (!ResolveTarget("zero_accumulator", heap_id, bucket_id, device, &t, &err)) return InvalidArgument(err);
  ZeroAccumulator(*t.bucket, device, t.heap->deterministic);
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
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
