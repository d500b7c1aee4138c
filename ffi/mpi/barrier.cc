// barrier (MPI): device d publishes its new generation into every process's control window (atomic replace), then
// waits until every device of the heap, in any process, has published at least that generation. The local devices
// meet in-process (they sleep on the heap's condition variable) while one of them at a time polls the window, so
// one thread per process talks to MPI for the wait. No MPI_Barrier: the wait times out naming the devices (and
// their processes) that never arrived, and notices a peer's abort word. A failure poisons the heap and sets the
// abort word in every peer's window, so their barriers fail at once with this process's message.
#include <sstream>
#include <vector>

#include "common/index_list.h"
#include "mpi/handler_util.h"
#include "mpi/handlers.h"

namespace jodc::mpi {
namespace {

// Publishes device d's new generation and waits until every device of the heap has reached it.
Error Wait(Heap& h, int32_t device, int64_t heap_id) {
  const double timeout_s = h.barrier_timeout_s.load();
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(h.mu);
    generation = ++h.arrivals[device];
  }
  // This device's pushes were flushed by their ops, so they are complete at their owners before peers see this.
  if (Error e = PublishControlWord(h, h.arrivals_disp(device), static_cast<int64_t>(generation)); e.failure())
    return Error::Internal(Poison(h, e.message()));
  std::unique_lock<std::mutex> lock(h.mu);
  auto all_arrived = [&] {
    for (int32_t d = 0; d < h.world; ++d)
      if (static_cast<uint64_t>(h.seen[1 + d]) < generation) return false;
    return true;
  };
  Error mpi_err;
  const int rc = WaitControl(h, lock, timeout_s, all_arrived, &mpi_err);
  if (rc == 0) return Error::Success();
  if (rc == 1) return Error(ffi::ErrorCode::kAborted, "jodc barrier: " + h.poisoned);
  if (rc == 3) {
    lock.unlock();
    return Error::Internal(Poison(h, mpi_err.message()));
  }
  auto missing = [&](int32_t d) { return static_cast<uint64_t>(h.seen[1 + d]) < generation; };
  std::ostringstream msg;
  msg << "jodc barrier timed out after " << timeout_s << " s in generation " << generation << " of MPI heap "
      << heap_id << ": device(s) " << IndexList(h.world, missing) << " never arrived (held by process(es) "
      << IndexList(h.nprocs, [&](int32_t r) {
           for (int32_t d = 0; d < h.world; ++d)
             if (missing(d) && h.dev_rank[d] == r) return true;
           return false;
         });
  msg << "; device " << device << " of process " << h.rank
      << " waited); the heap is now unusable: free and re-create it";
  lock.unlock();
  return Error(ffi::ErrorCode::kDeadlineExceeded, Poison(h, msg.str()));
}

Error Barrier(Scalar device, Scalar token, TokenOut token_out, int64_t heap_id) {
  return RunOp("barrier", device, token, token_out, heap_id, /*bucket_id=*/-1,
               [&](const OpTarget& t, int32_t d) { return Wait(*t.heap, d, heap_id); });
}

}  // namespace
}  // namespace jodc::mpi

JODC_MPI_HANDLER(Barrier, jodc::mpi::Barrier);
