// Every CUDA FFI handler symbol, Jodc<Op>Cuda, one per op of ffi/common/ops.h (one op file each). Python gets them
// from the library's handler table (jodc_cuda_handlers, management.cu) and registers them for platform "CUDA" under
// the same target names as the CPU handlers.
#ifndef JODC_FFI_CUDA_HANDLERS_CUH_
#define JODC_FFI_CUDA_HANDLERS_CUH_

#include "common/ops.h"
#include "cuda/heap.cuh"
#include "xla/ffi/api/ffi.h"

#define JODC_DECLARE_CUDA_HANDLER(op, Camel) XLA_FFI_DECLARE_HANDLER_SYMBOL(Jodc##Camel##Cuda);
JODC_ALL_OPS(JODC_DECLARE_CUDA_HANDLER)
#undef JODC_DECLARE_CUDA_HANDLER

#endif  // JODC_FFI_CUDA_HANDLERS_CUH_
