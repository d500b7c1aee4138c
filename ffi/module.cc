// The Python extension jodc._ffi: FFI handler capsules for the CPU platform, and host-side management of the
// symmetric heap (create / register / free, reading and writing shards for initialisation and checkpoints).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/handlers.h"
#include "cpu/heap.h"
#include "balance/descent.h"
#include "balance/fill.h"
#include "balance/refine.h"
#include "balance/resplit.h"
#include "balance/search.h"
#include "balance/small.h"
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

// The item -> part assignment a balance op takes: one entry per cost, every part in [0, k).
void CheckAssignment(const char* op, const std::vector<double>& cost, const std::vector<int64_t>& assign, int64_t k) {
  if (k < 1) Raise(std::string(op) + ": k must be >= 1, got " + std::to_string(k));
  if (assign.size() != cost.size())
    Raise(std::string(op) + ": assign has " + std::to_string(assign.size()) + " entries for " +
          std::to_string(cost.size()) + " costs");
  for (int64_t a : assign)
    if (a < 0 || a >= k) Raise(std::string(op) + ": part " + std::to_string(a) + " outside [0, " + std::to_string(k) + ")");
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
        JODC_GROUP_OPS(JODC_ADD_CPU_HANDLER)
#undef JODC_ADD_CPU_HANDLER
        return d;
      },
      "FFI target name (jodc_<op>) -> capsule of its CPU handler, for every op of ffi/common/ops.h (group ops included).");

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

  // The planners' compiled loops (jodc/balance/_native.py binds them; jodc/balance/refine.py and search.py are the
  // reference implementations they must match exactly).
  m.def(
      "balance_search",
      [](const std::vector<double>& ordered_cost, const std::vector<double>& ordered_size,
         const std::vector<double>& remaining_after, int64_t k, double best_max, double tolerance,
         double lower_bound, int64_t node_budget, bool free_search, bool equal_sizes, int64_t count_cap,
         int64_t count_floor, double cap) -> py::object {
        const size_t n = ordered_cost.size();
        if (k < 1) Raise("balance_search: k must be >= 1, got " + std::to_string(k));
        if (remaining_after.size() != n + 1 || (!free_search && ordered_size.size() != n))
          Raise("balance_search: ordered_size needs n and remaining_after n + 1 entries for n = " +
                std::to_string(n) + " items");
        std::vector<int64_t> assignment;
        bool found;
        {
          py::gil_scoped_release release;
          found = balance::SearchPartition(ordered_cost, ordered_size, remaining_after, k, best_max, tolerance,
                                           lower_bound, node_budget, free_search, equal_sizes, count_cap,
                                           count_floor, cap, &assignment);
        }
        if (!found) return py::none();
        return py::cast(assignment);
      },
      py::arg("ordered_cost"), py::arg("ordered_size"), py::arg("remaining_after"), py::arg("k"),
      py::arg("best_max"), py::arg("tolerance"), py::arg("lower_bound"), py::arg("node_budget"),
      py::arg("free_search"), py::arg("equal_sizes"), py::arg("count_cap"), py::arg("count_floor"), py::arg("cap"),
      "jodc.balance.search's item-wise search loop: the assignment (position -> part) found, or None.");
  m.def(
      "balance_refine",
      [](const std::vector<double>& cost, const std::vector<double>& size, bool has_capacity, double capacity,
         std::vector<std::vector<int64_t>> parts, bool allow_moves, int64_t max_group, int64_t max_rounds,
         int64_t max_pair_table, double lower_bound_tolerance) {
        const int64_t n = static_cast<int64_t>(cost.size());
        if (has_capacity && static_cast<int64_t>(size.size()) != n)
          Raise("balance_refine: sizes has " + std::to_string(size.size()) + " entries for " + std::to_string(n) +
                " costs");
        if (max_group != 1 && max_group != 2) Raise("balance_refine: max_group must be 1 or 2");
        for (const auto& part : parts)
          for (int64_t i : part)
            if (i < 0 || i >= n) Raise("balance_refine: item " + std::to_string(i) + " outside [0, " +
                                       std::to_string(n) + ")");
        {
          py::gil_scoped_release release;
          balance::RefineBySwaps(cost, size, has_capacity, capacity, allow_moves, max_group, max_rounds,
                                 max_pair_table, lower_bound_tolerance, &parts);
        }
        return parts;
      },
      py::arg("cost"), py::arg("size"), py::arg("has_capacity"), py::arg("capacity"), py::arg("parts"),
      py::arg("allow_moves"), py::arg("max_group"), py::arg("max_rounds"), py::arg("max_pair_table"),
      py::arg("lower_bound_tolerance"),
      "jodc.balance.refine's pairwise refinement after its argument checks: the refined parts, indices ascending.");
  m.def(
      "balance_descend",
      [](const std::vector<double>& cost, std::vector<int64_t> assign, int64_t k, int64_t max_rounds, double bound,
         double tol, bool small, bool equal_counts, double bound_tolerance, int64_t partner_parts) {
        if (assign.size() != cost.size())
          Raise("balance_descend: assign has " + std::to_string(assign.size()) + " entries for " +
                std::to_string(cost.size()) + " costs");
        for (int64_t a : assign)
          if (a < 0 || a >= k) Raise("balance_descend: part " + std::to_string(a) + " outside [0, " +
                                     std::to_string(k) + ")");
        if (partner_parts < 1) Raise("balance_descend: partner_parts must be >= 1");
        {
          py::gil_scoped_release release;
          balance::Descend(cost, k, max_rounds, bound, tol, small, equal_counts, bound_tolerance, partner_parts,
                           &assign);
        }
        return assign;
      },
      py::arg("cost"), py::arg("assign"), py::arg("k"), py::arg("max_rounds"), py::arg("bound"), py::arg("tol"),
      py::arg("small"), py::arg("equal_counts"), py::arg("bound_tolerance"), py::arg("partner_parts"),
      "jodc.balance.descent's descend loop after its argument preparation: the new assignment (item -> part).");
  m.def(
      "balance_resplit",
      [](const std::vector<double>& cost, std::vector<int64_t> assign, int64_t k, int64_t max_rounds, double bound,
         double tol, bool equal_counts, double bound_tolerance, int64_t resplit_items) {
        CheckAssignment("balance_resplit", cost, assign, k);
        if (resplit_items < 0 || resplit_items > 24) Raise("balance_resplit: resplit_items must be in [0, 24] (2^items subset sums are held in memory)");
        {
          py::gil_scoped_release release;
          balance::ResplitHeaviest(cost, k, max_rounds, bound, tol, equal_counts, bound_tolerance, resplit_items,
                                   &assign);
        }
        return assign;
      },
      py::arg("cost"), py::arg("assign"), py::arg("k"), py::arg("max_rounds"), py::arg("bound"), py::arg("tol"),
      py::arg("equal_counts"), py::arg("bound_tolerance"), py::arg("resplit_items"),
      "jodc.balance.descent's resplit_heaviest after its argument preparation: the new assignment (item -> part).");
  m.def(
      "balance_fill",
      [](const std::vector<double>& cost, int64_t k, double target, int64_t max_others, int64_t max_subsets) {
        if (k < 1) Raise("balance_fill: k must be >= 1, got " + std::to_string(k));
        if (max_others < 0 || max_subsets < 1) Raise("balance_fill: max_others must be >= 0 and max_subsets >= 1");
        py::gil_scoped_release release;
        return balance::FillParts(cost, k, target, max_others, max_subsets);
      },
      py::arg("cost"), py::arg("k"), py::arg("target"), py::arg("max_others"), py::arg("max_subsets"),
      "jodc.balance.fill's fill_parts: the assignment (item -> part) of a fill toward target.");
  m.def(
      "balance_small_stage",
      [](const std::vector<double>& cost, std::vector<int64_t> assign, int64_t k,
         const std::vector<double>& fill_targets, double bound, double target, double tol, int64_t rounds,
         bool small, double bound_tolerance, int64_t partner_parts, int64_t resplit_rounds, int64_t resplit_items,
         int64_t fill_others, int64_t max_subsets) {
        CheckAssignment("balance_small_stage", cost, assign, k);
        if (partner_parts < 1) Raise("balance_small_stage: partner_parts must be >= 1");
        if (resplit_items < 0 || resplit_items > 24) Raise("balance_small_stage: resplit_items must be in [0, 24] (2^items subset sums are held in memory)");
        if (fill_others < 0 || max_subsets < 1)
          Raise("balance_small_stage: fill_others must be >= 0 and max_subsets >= 1");
        const balance::SmallStageOptions options{bound,           target,        tol,
                                                 rounds,          small,         bound_tolerance,
                                                 partner_parts,   resplit_rounds, resplit_items,
                                                 fill_others,     max_subsets};
        bool reached;
        {
          py::gil_scoped_release release;
          reached = balance::SmallStage(cost, k, fill_targets, options, &assign);
        }
        return py::make_tuple(assign, reached);
      },
      py::arg("cost"), py::arg("assign"), py::arg("k"), py::arg("fill_targets"), py::arg("bound"),
      py::arg("target"), py::arg("tol"), py::arg("rounds"), py::arg("small"), py::arg("bound_tolerance"),
      py::arg("partner_parts"), py::arg("resplit_rounds"), py::arg("resplit_items"), py::arg("fill_others"),
      py::arg("max_subsets"),
      "Step 2 of jodc.balance.partition's _free_partition (re-splits, fills, descents): (assignment, reached).");
}
