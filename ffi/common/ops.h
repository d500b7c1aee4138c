// The one list of jodc's FFI ops. Every backend's handler declarations, the table of handlers each library hands to
// Python (ffi/module.cc, ffi/mpi/capi.cc, ffi/cuda/management.cu) and the CUDA fault codes are generated from it;
// jodc/ops/transports/target_names.py spells the same names for the Python side, and tests/test_ops_targets.py fails when the two
// (or a built library's table) diverge. Adding an op: one X(...) line here, one op file per backend, one Python file.
//
// X(op, Camel): the FFI target is "jodc_<op>" ("jodc_mpi_<op>" for the MPI transport); the backend's handler symbol
// is Jodc<Camel><Backend>, defined in ffi/<backend>/<file of the op>.
#ifndef JODC_FFI_COMMON_OPS_H_
#define JODC_FFI_COMMON_OPS_H_

// Ops on a heap: they carry the heap (and bucket) attributes and the caller's device index. Every backend has them.
#define JODC_HEAP_OPS(X)                 \
  X(gather, Gather)                      \
  X(scatter_accumulate, ScatterAccumulate) \
  X(barrier, Barrier)                    \
  X(read_accumulator, ReadAccumulator)   \
  X(zero_accumulator, ZeroAccumulator)   \
  X(publish, Publish)

// Ordering ops on tokens alone (no heap): the in-process backends (CPU, CUDA) have them; the MPI transport's heaps run
// on CPU devices and use the CPU ones.
#define JODC_TOKEN_OPS(X) \
  X(after, After)         \
  X(depend_on, DependOn)

#define JODC_ALL_OPS(X) JODC_HEAP_OPS(X) JODC_TOKEN_OPS(X)

// Ops on a group of a heap's devices, the member list a run-time int32 operand (context parallelism: the group is
// chosen per minibatch): one slot (a shard of a bucket) per member. The host backends (CPU, MPI) have them; the CUDA
// and NVSHMEM backends do not yet.
#define JODC_GROUP_OPS(X)                            \
  X(group_gather, GroupGather)                       \
  X(group_scatter_accumulate, GroupScatterAccumulate) \
  X(group_barrier, GroupBarrier)

#include <cstdint>

namespace jodc {

// One entry of a library's handler table: the op's name (without any "jodc_" prefix) and its XLA FFI handler.
struct OpHandler {
  const char* name;
  void* handler;
};

// The C API by which a ctypes-loaded library (MPI, CUDA) hands its table to Python: copies the first `capacity`
// entries into `names` / `handlers` and returns how many the table has.
template <int32_t N>
int32_t CopyOpHandlers(const OpHandler (&table)[N], const char** names, void** handlers, int32_t capacity) {
  for (int32_t i = 0; i < N && i < capacity; ++i) {
    names[i] = table[i].name;
    handlers[i] = table[i].handler;
  }
  return N;
}

}  // namespace jodc

#endif  // JODC_FFI_COMMON_OPS_H_
