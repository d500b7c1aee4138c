// Every CPU FFI handler symbol, Jodc<Op>Cpu, one per op of ffi/common/ops.h (one op file each); module.cc hands them
// to Python as capsules.
#ifndef JODC_FFI_CPU_HANDLERS_H_
#define JODC_FFI_CPU_HANDLERS_H_

#include "common/ops.h"
#include "xla/ffi/api/ffi.h"

#define JODC_DECLARE_CPU_HANDLER(op, Camel) XLA_FFI_DECLARE_HANDLER_SYMBOL(Jodc##Camel##Cpu);
JODC_ALL_OPS(JODC_DECLARE_CPU_HANDLER)
JODC_GROUP_OPS(JODC_DECLARE_CPU_HANDLER)
#undef JODC_DECLARE_CPU_HANDLER

#endif  // JODC_FFI_CPU_HANDLERS_H_
