// accumulator (MPI): device d reads (fp32, atomically against incoming accumulates: MPI_Win_sync then
// MPI_Get_accumulate with MPI_NO_OP) or zeroes (MPI_Accumulate with MPI_REPLACE) its own accumulator shard.
// Deterministic mode reduces the landing slots in source order, exactly as the single-process backend does.
#include "mpi/handler_util.h"
#include "mpi/handlers.h"

namespace jodc::mpi {
namespace {

ffi::Error ReadAcc(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token, ffi::Result<ffi::Buffer<ffi::F32>> out,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadDeviceAndToken("read_accumulator", device_buf, token, &device, &tok, &err)) return InvalidArgument(err);
  OpTarget t;
  if (!ResolveTarget("read_accumulator", heap_id, bucket_id, device, true, &t, &err)) return InvalidArgument(err);
  if (static_cast<int64_t>(out->element_count()) != t.bucket->layout.shard_numel) {
    return InvalidArgument("jodc read_accumulator: output has " + std::to_string(out->element_count()) +
                           " elements, the shard has " + std::to_string(t.bucket->layout.shard_numel));
  }
  int rc = ReadAccumulator(*t.heap, *t.bucket, device, out->typed_data());
  if (rc != MPI_SUCCESS) return MpiFailure(*t.heap, "read_accumulator", "MPI_Get_accumulate", rc);
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

ffi::Error ZeroAcc(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadDeviceAndToken("zero_accumulator", device_buf, token, &device, &tok, &err)) return InvalidArgument(err);
  OpTarget t;
  if (!ResolveTarget("zero_accumulator", heap_id, bucket_id, device, true, &t, &err)) return InvalidArgument(err);
  int rc = ZeroAccumulator(*t.heap, *t.bucket, device);
  if (rc != MPI_SUCCESS) return MpiFailure(*t.heap, "zero_accumulator", "MPI_Accumulate", rc);
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jodc::mpi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcReadAccumulatorMpi, jodc::mpi::ReadAcc,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // the device's accumulated shard
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcZeroAccumulatorMpi, jodc::mpi::ZeroAcc,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));
