"""bench/gpu_ops.py: its byte counts and sizes, and a tiny run on the CPU device through every code path (the
ceilings, world 1 through jodc.ops, the simulated world through the handlers, both accumulation modes, the
barrier, the exactness check), the same code the GPU runs."""

import pytest

from bench import device_timing
from bench import gpu_ops


def test_sizes_parse_with_units_and_refuse_what_is_not_fp32_elements():
    assert gpu_ops.parse_size("64KiB") == 65536 and gpu_ops.parse_size("256MiB") == 256 << 20
    assert gpu_ops.parse_size("1GiB") == 1 << 30 and gpu_ops.parse_size(" 4096 ") == 4096
    for bad in ("6", "0", "1 TB", "-4KiB", "abc"):
        with pytest.raises(ValueError):
            gpu_ops.parse_size(bad)


def test_moved_bytes_count_every_byte_read_and_written():
    sizes = dict(numel=1000, shard_numel=256, world=4)
    assert gpu_ops.moved_bytes("copy", landing_slots=False, **sizes) == 8000
    assert gpu_ops.moved_bytes("gather", landing_slots=False, **sizes) == 8000
    assert gpu_ops.moved_bytes("gather", landing_slots=False, out_itemsize=2, **sizes) == 6000
    assert gpu_ops.moved_bytes("scatter_accumulate", landing_slots=True, **sizes) == 12000
    assert gpu_ops.moved_bytes("read_accumulator", landing_slots=False, **sizes) == 2 * 4 * 256
    assert gpu_ops.moved_bytes("read_accumulator", landing_slots=True, **sizes) == (1 + 4 + 1) * 4 * 256
    assert gpu_ops.moved_bytes("zero_accumulator", landing_slots=True, **sizes) == (1 + 4) * 4 * 256
    assert gpu_ops.moved_bytes("publish", landing_slots=True, **sizes) == 8 * 256
    with pytest.raises(ValueError, match="barrier"):
        gpu_ops.moved_bytes("barrier", landing_slots=False, **sizes)


def test_buckets_per_heap_spread_dispatch_within_the_memory_budget():
    budget = gpu_ops.parse_size("2GiB")
    assert [gpu_ops.buckets_per_heap(gpu_ops.parse_size(s), budget) for s in ("64KiB", "256MiB", "1GiB", "4GiB")] == \
        [32, 8, 2, 2]


def test_interleaved_times_refuses_no_repeats():
    with pytest.raises(ValueError, match="repeats"):
        device_timing.interleaved_times({"x": lambda: None}, 0)


def test_a_tiny_cpu_run_measures_every_op_and_reports_the_headline_keys(cpu_devices, capsys):
    args = gpu_ops.parse_args(["--platform", "cpu", "--sizes", "4KiB,64KiB", "--repeats", "2", "--matmul", "64",
                               "--barriers", "4", "--sim-world", "3", "--no-save"])
    r = gpu_ops.main(args)
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("{") and "barrier round trip" in out
    for key in ("gpu_gather_vs_copy", "gpu_scatter_vs_copy", "gpu_barrier_us", "gpu_gather_bf16_vs_copy",
                "gpu_scatter_deterministic_vs_copy", "sim3_gather_vs_copy", "sim3_scatter_vs_copy",
                "copy_ceiling_gbps", "matmul_bf16_tflops"):
        assert r[key] > 0, key
    assert r["headline_size_bytes"] == 65536  # the size nearest 256 MiB
    per_size = {("copy", "fp32", "device")} | {
        (op, variant, "world 1 (jodc.ops)") for op, variant in [
            ("gather", "fp32->fp32"), ("gather", "fp32->bf16"), ("scatter_accumulate", "atomic"),
            ("read_accumulator", "atomic"), ("zero_accumulator", "atomic"), ("publish", "fp32"),
            ("scatter_accumulate", "deterministic"), ("read_accumulator", "deterministic"),
            ("zero_accumulator", "deterministic")]} | {
        (op, variant, "simulated world 3 (handlers, position 0)") for op, variant in [
            ("gather", "fp32->fp32"), ("gather", "fp32->bf16"), ("scatter_accumulate", "atomic"),
            ("scatter_accumulate", "deterministic")]}
    for size in (4096, 65536):
        rows = {(row["op"], row["variant"], row["world"]) for row in r["rows"] if row["size_bytes"] == size}
        assert rows == per_size, size
    assert all(row["gbps"] > 0 and row["us"] > 0 for row in r["rows"])
    assert max(row["vs_copy"] for row in r["rows"] if row["op"] == "copy") == 1.0
    assert len(r["gather_exact"]) == 8 and all(r["gather_exact"].values())  # 2 sizes x 2 worlds x 2 modes


def test_the_ceilings_move_bytes_and_multiply_random_inputs(cpu_devices):
    call, nbytes = device_timing.copy_contender(1000, 2, cpu_devices[0])
    a, b = call()
    assert nbytes == 8000 and a.shape == (1000,) and float(abs(a).sum()) > 0 and not (a == b).all()
    r = device_timing.matmul_tflops(64, 2, 2, cpu_devices[0], warmup=1)
    assert r["n"] == 64 and r["ms"] > 0 and r["tflops"] == pytest.approx(2 * 64**3 / (r["ms"] * 1e-3) / 1e12)
