// Every CPU FFI handler symbol, one per op file; module.cc exposes them to Python as capsules.
#ifndef JODC_FFI_CPU_HANDLERS_H_
#define JODC_FFI_CPU_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JodcGatherCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JodcScatterAccumulateCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JodcBarrierCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JodcReadAccumulatorCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JodcZeroAccumulatorCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JodcPublishCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JodcAfterCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JodcDependOnCpu);

#endif  // JODC_FFI_CPU_HANDLERS_H_
