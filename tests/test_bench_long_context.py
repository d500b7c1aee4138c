"""bench/long_context.py on a tiny configuration: every section runs and reports (memory, agreement, measured and
simulated steps, cluster scale), the CP layouts agree with the reference engine, and the recorded timelines carry
the CP groups of the plans."""
import numpy as np
import pytest

from bench import long_context
from jodc.balance.cp_cost import ContextParallelCost

# jaxlib 0.11 compiles the group ops with Shardy off only (docs/context_parallel.md, "Known issues")
pytestmark = pytest.mark.usefixtures("shardy_off_on_jaxlib_0_11")

TINY = ["--devices", "4", "--token-cap", "32", "--seqs-per-device", "3", "--minibatches", "1", "--rounds", "1",
        "--layers", "1", "--hidden", "32", "--cluster-devices", "16", "--cluster-minibatches", "1", "--processes", "0",
        "--no-save"]


def test_minibatch_lengths_hold_a_long_tail_within_the_worlds_capacity():
    args = long_context.parse_args(["--devices", "8", "--token-cap", "256", "--seqs-per-device", "8"])
    for i in range(3):
        lengths = long_context.minibatch_lengths(args, i)
        assert lengths.size == 64 and lengths.min() >= long_context.SHORTEST
        long = lengths[lengths > 256]
        assert long.size == 1 and 4 * 256 <= long[0] <= 8 * 256  # 1.5% of 64, at least one
    again = long_context.minibatch_lengths(args, 0)
    assert np.array_equal(again, long_context.minibatch_lengths(args, 0))  # seeded


def test_a_tiny_run_reports_every_section(capsys):
    r = long_context.main(long_context.parse_args(TINY))
    line = long_context.summary_line(r)
    for key in ("cp_vs_fixed_cp", "cp_vs_lockstep_cp", "cp_idle_fraction", "cp_memory_vs_cap", "cp_all_gather_memory_vs_cap",
                "measured_cp_vs_fixed_cp", "simulated_cp_vs_lockstep_cp", "max_relative_error"):
        assert key in line and np.isfinite(line[key]), key
    assert line["max_relative_error"] <= 1e-5  # every layout's first step against the reference engine
    memory = r["memory"]
    assert memory["sequence_tokens"] == 4 * 32 - 2
    assert memory["unsplit_memory_vs_cap"] > memory["cp_memory_vs_cap"] > 0
    assert memory["cp_all_gather_memory_vs_cap"] > 0
    calibration = r["calibration"]
    assert calibration["seconds_per_token"] + calibration["seconds_per_pair"] > 0
    for name in long_context.LAYOUTS:
        row = r["measured"][name]
        assert row["step_s"] > 0 and row["cpu_s_per_step"] > 0
        assert r["simulated"][name]["step_s"] > 0
    # the data-aware layout's recorded timeline: the CP rows carry their group and members, as the plan has them
    groups = r["measured"]["data_aware"]["plans"][0]["groups"]
    labelled = [e for e in r["timelines"]["data_aware"] if "group" in e]
    assert groups and labelled
    assert {tuple(e["members"]) for e in labelled} == {tuple(g) for g in groups}
    assert all(e["device"] in e["members"] for e in labelled)
    assert "cp_vs_fixed_cp" in capsys.readouterr().out


def test_a_sequence_8x_the_cap_streamed_over_8_devices_stays_within_the_caps_memory():
    """(a) at the benchmark's model width, a smaller cap: streaming the K/V (the ODC engine's default) keeps the
    split sequence's step within the step of plain rows at the cap; all-gathering them does not."""
    args = long_context.parse_args(["--devices", "8", "--token-cap", "128", "--layers", "1", "--no-save"])
    model, groups, _ = long_context.build_model(args)
    cost = ContextParallelCost(num_layers=1, seconds_per_token=1e-6, seconds_per_pair=1e-9, exchange_bytes_per_token=64.0)
    memory = long_context.memory(args, model, groups, cost)
    print({k: v for k, v in memory.items() if k != "bytes"})
    assert memory["cp_memory_vs_cap"] <= 1.0 < memory["cp_all_gather_memory_vs_cap"]
