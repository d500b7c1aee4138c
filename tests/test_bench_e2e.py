"""bench/e2e.py's measurement pieces (also used across processes by bench/multiprocess.py)."""
import time
import types

import numpy as np

from bench import e2e


def _calibrator(grad):
    cal = object.__new__(e2e.BusyCalibrator)  # no model: `grad` stands in for forward + backward
    cal.params, cal.grad, cal.cache = {}, grad, {}
    return cal


def _microbatch(n=8):
    return {"tokens": np.zeros(n, np.int32), "segment_ids": np.ones(n, np.int32)}


def _burn(seconds):
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        pass


def test_busy_calibrator_counts_cpu_time_not_wall_time():
    """A microbatch's busy time is the CPU it costs, not the wall it took: time spent descheduled (a loaded machine,
    here a sleep) is not compute. Before, wall time was counted, and calibrations taken under heavier load than the
    steps overstated compute (negative bubble rates across processes)."""
    sleeping = _calibrator(lambda params, mb: time.sleep(0.05))
    assert sleeping.seconds(_microbatch()) < 0.025
    burning = _calibrator(lambda params, mb: _burn(0.02))
    assert burning.seconds(_microbatch()) >= 0.019


def test_contender_times_passes_of_this_process_wall_and_cpu():
    """A Contender compiles (steps every minibatch once) when built, then each timed pass records the slowest
    process's per-step walls and adds this process's own wall and CPU (compile pass excluded), from which the
    benchmark splits a process's time into compute, other CPU and time not running."""
    steps = []

    class Engine:
        closed = False

        def __init__(self, *args, **kwargs):
            pass

        def step(self, batch):
            steps.append(batch)
            t0 = time.perf_counter()
            _burn(0.01)
            time.sleep(0.03)
            return types.SimpleNamespace(seconds=time.perf_counter() - t0)

        def close(self):
            Engine.closed = True

    class Sync(e2e.LocalSync):
        def slowest(self, seconds):
            return np.asarray(seconds) * 2  # another process was slower

    contender = e2e.Contender(Engine, None, None, None, ["a", "b"], None, None, Sync())
    assert steps == ["a", "b"]  # the compile pass
    pass_wall = contender.timed_pass()
    assert steps == ["a", "b", "a", "b"]
    own = contender.own
    assert len(contender.walls) == 1 and pass_wall == contender.walls[0].sum()
    assert np.isclose(pass_wall, 2 * own["wall_s"], rtol=0.5)
    assert own["wall_s"] >= 0.08 and 0.019 <= own["cpu_s"] < own["wall_s"] - 0.04
    contender.close()
    assert Engine.closed
    assert e2e.LocalSync().per_process({"x": 1}) == [{"x": 1}]


def test_paired_rounds_rotate_the_order_and_ratios_are_per_round_medians():
    order = []

    class Fake:
        def __init__(self, name, walls):
            self.name, self.walls = name, list(walls)

        def timed_pass(self):
            order.append(self.name)
            return self.walls.pop(0)

    # the machine slows down round by round; each round's ratio is still 2
    passes = e2e.paired_rounds({"odc": Fake("odc", [1.0, 2.0, 4.0]), "collective": Fake("collective", [2, 4, 8]),
                                "xla_spmd": Fake("xla_spmd", [3, 3, 3])}, 3)
    assert order == ["odc", "collective", "xla_spmd", "collective", "xla_spmd", "odc", "xla_spmd", "odc", "collective"]
    assert passes["odc"] == [1.0, 2.0, 4.0]
    assert e2e.paired_speedup(passes, "odc", "collective") == 2.0
    assert e2e.paired_speedup(passes, "odc", "xla_spmd") == 1.5  # median of 3, 1.5, 0.75


def test_hsdp_rows_are_reported_as_ratios_and_json_keys(capsys):
    from bench import multiprocess

    def row(samples, bubble):
        return {"samples_per_s": samples, "bubble_rate": bubble}

    assert e2e.hsdp_ratios({"odc": [1.0]}) == {}
    result = {"config": {"layers": 2, "hidden": 64, "token_cap": 1024, "minibatches": 2}}
    for scenario, (hsdp_odc, hsdp_col, odc) in (("imbalanced", (3.0, 2.0, 4.0)), ("balanced", (2.0, 2.0, 1.0))):
        rows = {"odc": row(odc, 0.2), "collective": row(1.0, 0.5), "hsdp_odc": row(hsdp_odc, 0.1),
                "hsdp_collective": row(hsdp_col, 0.4)}
        passes = {name: [1 / r["samples_per_s"]] * 3 for name, r in rows.items()}  # pass walls of equal rounds
        for name, r in rows.items():
            r["pass_walls_s"] = passes[name]  # as bench/e2e.py's rows carry them
        result[scenario] = {"engines": rows, **e2e.hsdp_ratios(passes)}
    summary = multiprocess.hsdp_table(result, types.SimpleNamespace(hsdp_local_devices=2, quick=True))
    assert summary["mp_hsdp_odc_vs_hsdp_collective_imbalanced"] == 1.5
    assert summary["mp_hsdp_odc_vs_flat_odc_imbalanced"] == 0.75
    assert summary["mp_hsdp_odc_vs_hsdp_collective_balanced"] == 1.0
    assert summary["mp_hsdp_odc_vs_flat_odc_balanced"] == 2.0
    assert summary["hsdp_rounds"] == 3 and summary["mp_hsdp_odc_vs_flat_odc_imbalanced_per_round"] == [0.75] * 3
    assert summary["mp_hsdp_balanced_hsdp_collective_bubble_rate"] == 0.4
    assert "HSDP across 2 processes x 2 CPU devices" in capsys.readouterr().out
