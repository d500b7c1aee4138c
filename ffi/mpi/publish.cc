// publish (MPI): device d overwrites its own master shard in this process's window memory, then MPI_Win_sync makes
// the stores visible to peers' MPI_Get (the next barrier orders them before any peer gathers).
#include "mpi/handler_util.h"
#include "mpi/handlers.h"

namespace jodc::mpi {
namespace {

ffi::Error Publish(ffi::Buffer<ffi::S32> device_buf, ffi::AnyBuffer shard, ffi::Buffer<ffi::S32> token,
                   ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadDeviceAndToken("publish", device_buf, token, &device, &tok, &err)) return InvalidArgument(err);
  OpTarget t;
  if (!ResolveTarget("publish", heap_id, bucket_id, device, true, &t, &err)) return InvalidArgument(err);
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
  CopyConvert(b.base + b.shard_disp(t.heap->dev_slot[device]), b.master, shard.untyped_data(), in_t,
              b.layout.shard_numel);
  int rc = MPI_Win_sync(b.win);
  if (rc != MPI_SUCCESS) return MpiFailure(*t.heap, "publish", "MPI_Win_sync", rc);
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jodc::mpi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcPublishMpi, jodc::mpi::Publish,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::AnyBuffer>()              // new local shard, master dtype
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));
