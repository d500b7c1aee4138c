// publish (MPI): device d overwrites its own master shard in this process's window memory, then MPI_Win_sync makes
// the stores visible to peers' MPI_Get (the next barrier orders them before any peer gathers).
#include "mpi/handler_util.h"
#include "mpi/handlers.h"

namespace jodc::mpi {
namespace {

Error Publish(Scalar device, ffi::AnyBuffer shard, Scalar token, TokenOut token_out, int64_t heap_id,
              int64_t bucket_id) {
  return RunOp("publish", device, token, token_out, heap_id, bucket_id, [&](const OpTarget& t, int32_t d) -> Error {
    const Bucket& b = *t.bucket;
    if (Error e = CheckShard(shard, b.layout, b.master); e.failure()) return e;
    CopyConvert(b.base + b.shard_disp(t.heap->dev_slot[d]), b.master, shard.untyped_data(), b.master,
                b.layout.shard_numel);
    int rc = MPI_Win_sync(b.win);
    if (rc != MPI_SUCCESS) return MpiFailure(*t.heap, "publish", "MPI_Win_sync", rc);
    return Error::Success();
  });
}

}  // namespace
}  // namespace jodc::mpi

JODC_MPI_HANDLER(Publish, jodc::mpi::Publish);
