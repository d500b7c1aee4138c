// Every NVSHMEM FFI handler symbol, Jodc<Op>Nvshmem, one per heap op of ffi/common/ops.h (the token ops are the CUDA
// library's). Python gets them from the library's handler table (jodc_nvshmem_handlers, heap.cu) and registers them
// for platform "CUDA" as jodc_nvshmem_<op>.
#ifndef JODC_FFI_NVSHMEM_HANDLERS_CUH_
#define JODC_FFI_NVSHMEM_HANDLERS_CUH_

#include <cuda_runtime.h>

#include "common/bindings.h"
#include "common/ops.h"
#include "xla/ffi/api/ffi.h"

#define JODC_DECLARE_NVSHMEM_HANDLER(op, Camel) XLA_FFI_DECLARE_HANDLER_SYMBOL(Jodc##Camel##Nvshmem);
JODC_HEAP_OPS(JODC_DECLARE_NVSHMEM_HANDLER)
#undef JODC_DECLARE_NVSHMEM_HANDLER

// Defines the NVSHMEM handler symbol Jodc<Camel>Nvshmem of op Camel (binding: ffi/common/bindings.h, after the
// platform stream, as for the CUDA handlers).
#define JODC_NVSHMEM_HANDLER(Camel, impl) \
  JODC_DEFINE_HANDLER(Camel, Nvshmem, impl, ::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>())

#endif  // JODC_FFI_NVSHMEM_HANDLERS_CUH_
