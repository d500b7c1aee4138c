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

Error GatherBody(const OpTarget& t, int32_t device, ffi::AnyBuffer& out_buf, int64_t bucket_id) {
  Heap& h = *t.heap;
  const Bucket& b = *t.bucket;
  ErrorOr<Dtype> out_dtype = CheckFullBucket("gather", "output", out_buf, b.layout, bucket_id);
  if (!out_dtype.has_value()) return out_dtype.error();
  const Dtype out_t = *out_dtype;
  char* dst = static_cast<char*>(out_buf.untyped_data());
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
  return Error::Success();
}

Error Gather(Scalar device, Scalar token, ffi::Result<ffi::AnyBuffer> out, TokenOut token_out, int64_t heap_id,
             int64_t bucket_id) {
  return RunOp("gather", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) { return GatherBody(t, d, *out, bucket_id); });
}

}  // namespace
}  // namespace jodc::mpi

JODC_MPI_HANDLER(Gather, jodc::mpi::Gather);
