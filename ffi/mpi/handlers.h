// Every MPI FFI handler symbol, one per op file. Exported (the library is built with -fvisibility=hidden) and looked
// up by name from Python (jodc/ops/_mpi.py), which registers them for the CPU platform as jodc_mpi_<op>.
#ifndef JODC_FFI_MPI_HANDLERS_H_
#define JODC_FFI_MPI_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

#define JODC_MPI_EXPORT __attribute__((visibility("default")))

extern "C" {
JODC_MPI_EXPORT XLA_FFI_Error* JodcGatherMpi(XLA_FFI_CallFrame* call_frame);
JODC_MPI_EXPORT XLA_FFI_Error* JodcScatterAccumulateMpi(XLA_FFI_CallFrame* call_frame);
JODC_MPI_EXPORT XLA_FFI_Error* JodcBarrierMpi(XLA_FFI_CallFrame* call_frame);
JODC_MPI_EXPORT XLA_FFI_Error* JodcReadAccumulatorMpi(XLA_FFI_CallFrame* call_frame);
JODC_MPI_EXPORT XLA_FFI_Error* JodcZeroAccumulatorMpi(XLA_FFI_CallFrame* call_frame);
JODC_MPI_EXPORT XLA_FFI_Error* JodcPublishMpi(XLA_FFI_CallFrame* call_frame);
}

#endif  // JODC_FFI_MPI_HANDLERS_H_
