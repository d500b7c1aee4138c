// Every CUDA FFI handler symbol, one per op file. They are exported (the library is built with -fvisibility=hidden)
// and looked up by name from Python (jodc/ops/_cuda.py), which registers them for platform "CUDA" under the same
// target names as the CPU handlers.
#ifndef JODC_FFI_CUDA_HANDLERS_CUH_
#define JODC_FFI_CUDA_HANDLERS_CUH_

#include "cuda/heap.cuh"
#include "xla/ffi/api/ffi.h"

JODC_EXPORT XLA_FFI_Error* JodcGatherCuda(XLA_FFI_CallFrame* call_frame);
JODC_EXPORT XLA_FFI_Error* JodcScatterAccumulateCuda(XLA_FFI_CallFrame* call_frame);
JODC_EXPORT XLA_FFI_Error* JodcBarrierCuda(XLA_FFI_CallFrame* call_frame);
JODC_EXPORT XLA_FFI_Error* JodcReadAccumulatorCuda(XLA_FFI_CallFrame* call_frame);
JODC_EXPORT XLA_FFI_Error* JodcZeroAccumulatorCuda(XLA_FFI_CallFrame* call_frame);
JODC_EXPORT XLA_FFI_Error* JodcPublishCuda(XLA_FFI_CallFrame* call_frame);
JODC_EXPORT XLA_FFI_Error* JodcAfterCuda(XLA_FFI_CallFrame* call_frame);
JODC_EXPORT XLA_FFI_Error* JodcDependOnCuda(XLA_FFI_CallFrame* call_frame);

#endif  // JODC_FFI_CUDA_HANDLERS_CUH_
