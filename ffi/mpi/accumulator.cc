// accumulator (MPI): device d reads (fp32, atomically against incoming accumulates: MPI_Win_sync then
// MPI_Get_accumulate with MPI_NO_OP) or zeroes (MPI_Accumulate with MPI_REPLACE) its own accumulator shard.
// Deterministic mode reduces the landing slots in source order, exactly as the single-process backend does.
#include "mpi/handler_util.h"
#include "mpi/handlers.h"

namespace jodc::mpi {
namespace {

Error ReadAcc(Scalar device, Scalar token, ffi::Result<ffi::Buffer<ffi::F32>> out, TokenOut token_out,
              int64_t heap_id, int64_t bucket_id) {
  return RunOp("read_accumulator", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) -> Error {
                 if (Error e = CheckAccumulatorOut(*out, t.bucket->layout); e.failure()) return e;
                 int rc = ReadAccumulator(*t.heap, *t.bucket, d, out->typed_data());
                 if (rc != MPI_SUCCESS) return MpiFailure(*t.heap, "read_accumulator", "MPI_Get_accumulate", rc);
                 return Error::Success();
               });
}

Error ZeroAcc(Scalar device, Scalar token, TokenOut token_out, int64_t heap_id, int64_t bucket_id) {
  return RunOp("zero_accumulator", device, token, token_out, heap_id, bucket_id,
               [&](const OpTarget& t, int32_t d) -> Error {
                 int rc = ZeroAccumulator(*t.heap, *t.bucket, d);
                 if (rc != MPI_SUCCESS) return MpiFailure(*t.heap, "zero_accumulator", "MPI_Accumulate", rc);
                 return Error::Success();
               });
}

}  // namespace
}  // namespace jodc::mpi

JODC_MPI_HANDLER(ReadAccumulator, jodc::mpi::ReadAcc);
JODC_MPI_HANDLER(ZeroAccumulator, jodc::mpi::ZeroAcc);
