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

[[noreturn]] void Fail(const std::string& err) { throw std::invalid_argument(err); }

// Raises Python's MemoryError with `err` (pybind11 would turn std::bad_alloc into one without our message).
[[noreturn]] void FailOutOfMemory(const std::string& err) {
  PyErr_SetString(PyExc_MemoryError, err.c_str());
  throw py::error_already_set();
}

std::shared_ptr<Bucket> Lookup(int64_t heap_id, int64_t bucket_id, std::shared_ptr<Heap>* heap_out = nullptr) {
  std::string err;
  auto heap = FindHeap(heap_id, &err);
  if (!heap) Fail(err);
  auto bucket = FindBucket(heap, bucket_id, &err);
  if (!bucket) Fail(err);
  if (heap_out) *heap_out = heap;
  return bucket;
}

void CheckDevice(const Bucket& b, int32_t device) {
  if (device < 0 || device >= b.layout.world)
    Fail("device " + std::to_string(device) + " outside [0, " + std::to_string(b.layout.world) + ")");
}

}  // namespace

PYBIND11_MODULE(_ffi, m) {
  m.doc() = "jodc native ODC ops: XLA FFI handlers (CPU) and symmetric-heap management";

  m.def("handlers", [] {
    py::dict d;
    d["jodc_gather"] = Capsule(JodcGatherCpu);
    d["jodc_scatter_accumulate"] = Capsule(JodcScatterAccumulateCpu);
    d["jodc_barrier"] = Capsule(JodcBarrierCpu);
    d["jodc_read_accumulator"] = Capsule(JodcReadAccumulatorCpu);
    d["jodc_zero_accumulator"] = Capsule(JodcZeroAccumulatorCpu);
    d["jodc_publish"] = Capsule(JodcPublishCpu);
    d["jodc_after"] = Capsule(JodcAfterCpu);
    d["jodc_depend_on"] = Capsule(JodcDependOnCpu);
    return d;
  });

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
        std::string err;
        int64_t id = CreateHeap(world, deterministic, timeout_s, &err);
        if (id < 0) Fail(err);
        return id;
      },
      py::arg("world"), py::arg("deterministic"), py::arg("barrier_timeout_s"));
  m.def("heap_free", [](int64_t heap_id) {
    std::string err;
    if (!FreeHeap(heap_id, &err)) Fail(err);
  });
  m.def("heap_set_barrier_timeout", [](int64_t heap_id, double timeout_s) {
    std::string err;
    auto heap = FindHeap(heap_id, &err);
    if (!heap) Fail(err);
    if (!CheckBarrierTimeout(timeout_s, &err)) Fail(err);
    heap->barrier_timeout_s = timeout_s;
  });
  m.def("heap_generations", [](int64_t heap_id) {
    std::string err;
    auto heap = FindHeap(heap_id, &err);
    if (!heap) Fail(err);
    std::lock_guard<std::mutex> lock(heap->mu);
    return std::vector<uint64_t>(heap->arrivals);
  });
  m.def("heap_poisoned", [](int64_t heap_id) {
    std::string err;
    auto heap = FindHeap(heap_id, &err);
    if (!heap) Fail(err);
    std::lock_guard<std::mutex> lock(heap->mu);
    return heap->poisoned;
  });
  m.def(
      "heap_abort",
      [](int64_t heap_id, const std::string& reason) {
        std::string err;
        if (!FindHeap(heap_id, &err)) Fail(err);
        return AbortHeap(heap_id, reason);
      },
      py::arg("heap_id"), py::arg("reason"),
      "Poisons the heap with 'aborted: <reason>' (a first cause already recorded stays) and wakes its barriers; "
      "returns the poison message now recorded.");
  m.def("live_heaps", &LiveHeapCount);
  m.def("live_bytes", &LiveHeapBytes, "Bytes currently held by all heaps (shards, accumulators, landing slots).");

  m.def("bucket_register", [](int64_t heap_id, int64_t numel, const std::string& dtype) {
    Dtype d;
    if (!ParseDtype(dtype, &d)) Fail("master dtype must be float32 or bfloat16, got " + dtype);
    std::string err;
    bool out_of_memory = false;
    int64_t id = RegisterBucket(heap_id, numel, d, &err, &out_of_memory);
    if (id < 0) {
      if (out_of_memory) FailOutOfMemory(err);
      Fail(err);
    }
    return id;
  });
  m.def("bucket_free", [](int64_t heap_id, int64_t bucket_id) {
    std::string err;
    if (!FreeBucket(heap_id, bucket_id, &err)) Fail(err);
  });
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
      Fail("shard needs " + std::to_string(want) + " bytes, got " + std::to_string(info.size * info.itemsize));
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
        if (bytes < 1 || threads < 1 || iters < 1) Fail("bytes, threads and iters must be >= 1");
        int64_t needed = 0;  // a source and a destination buffer per thread
        if (!CheckedMul(bytes, 2 * static_cast<int64_t>(threads), &needed) || needed > AvailableHostBytes())
          FailOutOfMemory("memcpy_bandwidth: " + std::to_string(threads) + " threads x 2 buffers of " +
                          std::to_string(bytes) + " bytes exceed the host memory available");
        py::gil_scoped_release release;
        return MemcpyBandwidth(bytes, threads, iters);
      },
      py::arg("bytes"), py::arg("threads"), py::arg("iters"));
}
