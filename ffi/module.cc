// The Python extension jodc._ffi: FFI handler capsules for the CPU platform, and host-side management of the
// symmetric heap (create / register / free, reading and writing shards for initialisation and checkpoints).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu/handlers.h"
#include "cpu/heap.h"
#include "cpu/memcpy_bench.h"

namespace py = pybind11;
using namespace jodc;
using namespace jodc::cpu;

namespace {

template <typename T>
py::capsule Capsule(T* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

[[noreturn]] void Raise(const std::string& err) { throw std::invalid_argument(err); }

// Raises Python's MemoryError with `err` (pybind11 would turn std::bad_alloc into one without our message).
[[noreturn]] void FailOutOfMemory(const std::string& err) {
  PyErr_SetString(PyExc_MemoryError, err.c_str());
  throw py::error_already_set();
}

// A failed native call as a Python exception: MemoryError for an allocation that cannot be had, else ValueError.
void Check(const Error& e) {
  if (e.success()) return;
  if (IsOutOfMemory(e)) FailOutOfMemory(e.message());
  Raise(e.message());
}

template <typename T>
T Check(ErrorOr<T> result) {
  if (!result.has_value()) Check(result.error());
  return std::move(*result);
}

std::shared_ptr<Bucket> Lookup(int64_t heap_id, int64_t bucket_id, std::shared_ptr<Heap>* heap_out = nullptr) {
  auto heap = Check(FindHeap(heap_id));
  if (heap_out) *heap_out = heap;
  return Check(FindBucket(heap, bucket_id));
}

void CheckDevice(const Bucket& b, int32_t device) {
  if (device < 0 || device >= b.layout.world)
    Raise("device " + std::to_string(device) + " outside [0, " + std::to_string(b.layout.world) + ")");
}

}  // namespace

PYBIND11_MODULE(_ffi, m) {
  m.doc() = "jodc native ODC ops: XLA FFI handlers (CPU) and symmetric-heap management";

  m.def(
      "handlers",
      [] {
        py::dict d;
#define JODC_ADD_CPU_HANDLER(op, Camel) d["jodc_" #op] = Capsule(Jodc##Camel##Cpu);
        JODC_ALL_OPS(JODC_ADD_CPU_HANDLER)
#undef JODC_ADD_CPU_HANDLER
        return d;
      },
      "FFI target name (jodc_<op>) -> capsule of its CPU handler, for every op of ffi/common/ops.h.");

  m.def("shard_numel", &ShardNumel, py::arg("numel"), py::arg("world"), py::arg("master_bytes"),
        "Padded elements per shard (the layout the native ops use); -1 for invalid arguments or on overflow.");
  m.def(
      "bucket_bytes",
      [](int64_t numel, int32_t world, int32_t master_bytes, bool landing_slots) -> py::object {
        BucketBytes b;
        if (!CheckedBucketBytes(MakeLayout(numel, world, master_bytes), landing_slots, &b)) return py::none();
        py::dict d;
        d["shard"] = b.shard;
        d["accumulator"] = b.accumulator;
        d["landing"] = b.landing;
        d["per_device"] = b.per_device;
        d["total"] = b.total;
        return d;
      },
      py::arg("numel"), py::arg("world"), py::arg("master_bytes"), py::arg("landing_slots"),
      "Bytes of a bucket's memory (common/layout.h CheckedBucketBytes); None when they overflow int64.");
  m.def("timeout_nanos", &TimeoutNanos, py::arg("seconds"),
        "A barrier timeout in ns as the barrier uses it: INT64_MAX waits forever, -1 is invalid.");
  m.def("available_host_bytes", &AvailableHostBytes, "Host memory a new bucket may still take (bytes).");

  m.def(
      "heap_create",
      [](int32_t world, bool deterministic, double timeout_s) {
        return Check(CreateHeap(world, deterministic, timeout_s));
      },
      py::arg("world"), py::arg("deterministic"), py::arg("barrier_timeout_s"));
  m.def("heap_free", [](int64_t heap_id) { Check(FreeHeap(heap_id)); });
  m.def("heap_set_barrier_timeout", [](int64_t heap_id, double timeout_s) {
    auto heap = Check(FindHeap(heap_id));
    Check(CheckBarrierTimeout(timeout_s));
    heap->barrier_timeout_s = timeout_s;
  });
  m.def("heap_generations", [](int64_t heap_id) {
    auto heap = Check(FindHeap(heap_id));
    std::lock_guard<std::mutex> lock(heap->mu);
    return std::vector<uint64_t>(heap->arrivals);
  });
  m.def("heap_poisoned", [](int64_t heap_id) {
    auto heap = Check(FindHeap(heap_id));
    std::lock_guard<std::mutex> lock(heap->mu);
    return heap->poisoned;
  });
  m.def(
      "heap_abort",
      [](int64_t heap_id, const std::string& reason) {
        Check(FindHeap(heap_id));
        return AbortHeap(heap_id, reason);
      },
      py::arg("heap_id"), py::arg("reason"),
      "Poisons the heap with 'aborted: <reason>' (a first cause already recorded stays) and wakes its barriers; "
      "returns the poison message now recorded.");
  m.def("live_heaps", &LiveHeapCount);
  m.def("live_bytes", &LiveHeapBytes, "Bytes currently held by all heaps (shards, accumulators, landing slots).");

  m.def("bucket_register", [](int64_t heap_id, int64_t numel, const std::string& dtype) {
    Dtype d;
    if (!ParseDtype(dtype, &d)) Raise("master dtype must be float32 or bfloat16, got " + dtype);
    return Check(RegisterBucket(heap_id, numel, d));
  });
  m.def("bucket_free", [](int64_t heap_id, int64_t bucket_id) { Check(FreeBucket(heap_id, bucket_id)); });
  m.def("bucket_shard_numel", [](int64_t heap_id, int64_t bucket_id) {
    return Lookup(heap_id, bucket_id)->layout.shard_numel;
  });

  // Raw bytes of device d's master shard (padded); Python views them with the right dtype.
  m.def("bucket_get_shard", [](int64_t heap_id, int64_t bucket_id, int32_t device) {
    auto b = Lookup(heap_id, bucket_id);
    CheckDevice(*b, device);
    return py::bytes(static_cast<const char*>(b->shard(device)), b->layout.shard_numel * DtypeBytes(b->master));
  });
  m.def("bucket_set_shard", [](int64_t heap_id, int64_t bucket_id, int32_t device, py::buffer data) {
    auto b = Lookup(heap_id, bucket_id);
    CheckDevice(*b, device);
    py::buffer_info info = data.request();
    const int64_t want = b->layout.shard_numel * DtypeBytes(b->master);
    if (info.size * info.itemsize != want)
      Raise("shard needs " + std::to_string(want) + " bytes, got " + std::to_string(info.size * info.itemsize));
    std::memcpy(b->shard(device), info.ptr, want);
  });
  m.def("bucket_get_accumulator", [](int64_t heap_id, int64_t bucket_id, int32_t device) {
    std::shared_ptr<Heap> heap;
    auto b = Lookup(heap_id, bucket_id, &heap);
    CheckDevice(*b, device);
    std::string out(b->layout.shard_numel * sizeof(float), '\0');
    ReadAccumulator(*b, device, heap->deterministic, reinterpret_cast<float*>(out.data()));
    return py::bytes(out);
  });
  m.def("bucket_zero_accumulator", [](int64_t heap_id, int64_t bucket_id, int32_t device) {
    std::shared_ptr<Heap> heap;
    auto b = Lookup(heap_id, bucket_id, &heap);
    CheckDevice(*b, device);
    ZeroAccumulator(*b, device, heap->deterministic);
  });

  m.def(
      "memcpy_bandwidth",
      [](int64_t bytes, int32_t threads, int32_t iters) {
        if (bytes < 1 || threads < 1 || iters < 1) Raise("bytes, threads and iters must be >= 1");
        int64_t needed = 0;  // a source and a destination buffer per thread
        if (!CheckedMul(bytes, 2 * static_cast<int64_t>(threads), &needed) || needed > AvailableHostBytes())
          FailOutOfMemory("memcpy_bandwidth: " + std::to_string(threads) + " threads x 2 buffers of " +
                          std::to_string(bytes) + " bytes exceed the host memory available");
        py::gil_scoped_release release;
        return MemcpyBandwidth(bytes, threads, iters);
      },
      py::arg("bytes"), py::arg("threads"), py::arg("iters"));
}
