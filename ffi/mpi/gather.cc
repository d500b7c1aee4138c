// gather (MPI): device d assembles the full bucket in its compute dtype. Every shard mapped into this process (its
// own process's, and on a shared-memory heap every peer's) is copied directly, with streaming stores for large
// buckets (mpi/copy.h); on a heap spanning nodes, each remote owner's shard is pulled with MPI_Rget (all in flight
// at once, issued before the direct copies so they overlap).
#include <vector>

#include "mpi/copy.h"
#include "mpi/handler_util.h"
#include "mpi/handlers.h"

namespace jodc::mpi {
namespace {

ffi::Error Gather(ffi::Buffer<ffi::S32> device_buf, ffi::Buffer<ffi::S32> token, ffi::Result<ffi::AnyBuffer> out,
                  ffi::Result<ffi::Buffer<ffi::S32>> token_out, int64_t heap_id, int64_t bucket_id) {
  std::string err;
  int32_t device = 0, tok = 0;
  if (!ReadDeviceAndToken("gather", device_buf, token, &device, &tok, &err)) return InvalidArgument(err);
  OpTarget t;
  if (!ResolveTarget("gather", heap_id, bucket_id, device, true, &t, &err)) return InvalidArgument(err);
  Heap& h = *t.heap;
  const Bucket& b = *t.bucket;
  Dtype out_t;
  if (!ToDtype(out->element_type(), &out_t)) return InvalidArgument("jodc gather: output must be float32 or bfloat16");
  if (static_cast<int64_t>(out->element_count()) != b.layout.numel) {
    return InvalidArgument("jodc gather: output has " + std::to_string(out->element_count()) + " elements, bucket " +
                           std::to_string(bucket_id) + " has " + std::to_string(b.layout.numel));
  }
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t world = b.layout.world;
  const int64_t master_bytes = DtypeBytes(b.master);
  const bool stream = b.layout.numel * DtypeBytes(out_t) >= kStreamingCopyBytes;
  // Peers' publishes (stores, then MPI_Win_sync, then their barrier arrival) are visible to our loads after this.
  if (h.shared_memory) {
    int rc = MPI_Win_sync(b.win);
    if (rc != MPI_SUCCESS) return MpiFailure(h, "gather", "MPI_Win_sync", rc);
  }
  std::vector<MPI_Request> reqs;
  // Remote shards whose dtype differs from the output land in a staging buffer and are converted afterwards.
  struct Staged {
    int32_t owner;
    std::vector<char> data;
  };
  std::vector<Staged> staged;
  std::vector<int32_t> mapped;  // owners copied directly, after the MPI_Rgets are in flight
  for (int32_t k = 0; k < world; ++k) {
    const int32_t owner = (device + k) % world;  // ring order: concurrent gathers start at different owners
    const int64_t n = b.layout.valid(owner);
    if (n <= 0) continue;
    if (MappedShard(h, b, owner) != nullptr) {
      mapped.push_back(owner);
      continue;
    }
    const int32_t r = h.dev_rank[owner], slot = h.dev_slot[owner];
    char* land = dst + b.layout.begin(owner) * DtypeBytes(out_t);
    if (out_t != b.master) {
      staged.push_back({owner, std::vector<char>(n * master_bytes)});
      land = staged.back().data.data();
    }
    const int64_t bytes = n * master_bytes;
    for (int64_t off = 0; off < bytes; off += int64_t{1} << 30) {
      const int c = static_cast<int>(std::min<int64_t>(int64_t{1} << 30, bytes - off));
      MPI_Request req;
      int rc = MPI_Rget(land + off, c, MPI_BYTE, r, static_cast<MPI_Aint>(b.shard_disp(slot) + off), c, MPI_BYTE,
                        b.win, &req);
      if (rc != MPI_SUCCESS) {
        if (!reqs.empty()) MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
        return MpiFailure(h, "gather", "MPI_Rget", rc);
      }
      reqs.push_back(req);
    }
  }
  for (const int32_t owner : mapped) {
    CopyShard(dst + b.layout.begin(owner) * DtypeBytes(out_t), out_t, MappedShard(h, b, owner), b.master,
              b.layout.valid(owner), stream);
  }
  if (!reqs.empty()) {
    int rc = MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) return MpiFailure(h, "gather", "MPI_Waitall", rc);
  }
  for (const Staged& s : staged) {
    CopyConvert(dst + b.layout.begin(s.owner) * DtypeBytes(out_t), out_t, s.data.data(), b.master,
                b.layout.valid(s.owner));
  }
  token_out->typed_data()[0] = tok + 1;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jodc::mpi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JodcGatherMpi, jodc::mpi::Gather,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // device index
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Ret<xla::ffi::AnyBuffer>()              // full bucket, compute dtype
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // token
                                  .Attr<int64_t>("heap")
                                  .Attr<int64_t>("bucket"));
