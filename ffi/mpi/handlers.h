// Every MPI FFI handler symbol, Jodc<Op>Mpi, one per heap op of ffi/common/ops.h (one op file each). Python gets them
// from the library's handler table (jodc_mpi_handlers, capi.cc) and registers them for the CPU platform as
// jodc_mpi_<op>.
#ifndef JODC_FFI_MPI_HANDLERS_H_
#define JODC_FFI_MPI_HANDLERS_H_

#include "common/ops.h"
#include "xla/ffi/api/ffi.h"

// The library is built with -fvisibility=hidden: what Python calls through ctypes is marked with this.
#define JODC_MPI_EXPORT __attribute__((visibility("default")))

#define JODC_DECLARE_MPI_HANDLER(op, Camel) XLA_FFI_DECLARE_HANDLER_SYMBOL(Jodc##Camel##Mpi);
JODC_HEAP_OPS(JODC_DECLARE_MPI_HANDLER)
JODC_GROUP_OPS(JODC_DECLARE_MPI_HANDLER)
#undef JODC_DECLARE_MPI_HANDLER

#endif  // JODC_FFI_MPI_HANDLERS_H_
