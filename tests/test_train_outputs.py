"""Trainer outputs: timelines (bubble rate, plan estimates, PNG), metrics (JSONL, TensorBoard, resume truncation),
checkpoints (keep-N, atomic saves, refusing another model) and the HF export."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jodc.balance import get_planner
from jodc.train.core import metrics as M
from jodc.fsdp import timeline_analysis as TL
from jodc.train.core.checkpoint import CheckpointStore
from jodc.train.core.timers import Timers

# -- timeline ------------------------------------------------------------------------------------------------------


def ev(device, start, end, kind="busy", label="mb0"):
    return {"device": device, "start": start, "end": end, "kind": kind, "label": label}


def test_bubble_rate_is_idle_fraction_of_device_time():
    events = [ev(0, 0, 4), ev(1, 0, 2), ev(1, 2, 4, "wait", "barrier")]
    assert TL.bubble_rate(events) == pytest.approx(0.25)       # 6 busy of 2 x 4
    assert TL.bubble_rate(events, num_devices=4) == pytest.approx(1 - 6 / 16)  # silent devices idle
    assert TL.bubble_rate([]) == 0.0 and TL.bubble_rate([ev(0, 1, 1)]) == 0.0
    with pytest.raises(ValueError, match="kind 'idle'"):
        TL.bubble_rate([ev(0, 0, 1, "idle")])
    with pytest.raises(ValueError, match="ends before it starts"):
        TL.bubble_rate([ev(0, 2, 1)])
    with pytest.raises(ValueError, match="outside 0..1"):
        TL.bubble_rate([ev(2, 0, 1)], num_devices=2)
    with pytest.raises(ValueError, match="lacks \\['kind'\\]"):
        TL.bubble_rate([{"device": 0, "start": 0, "end": 1}])


def test_plan_estimates_follow_the_schedule():
    lengths = [100, 90, 10, 10, 10, 5]
    plan = get_planner("lb_micro")(lengths, 2, 128)
    costs = [[mb.cost for mb in device] for device in plan.devices]
    odc = TL.events_from_plan(plan, 2.0, lockstep=False)
    col = TL.events_from_plan(plan, 2.0, lockstep=True)
    for events in (odc, col):
        assert max(e["end"] for e in events) == pytest.approx(2.0)
        for d in range(2):
            lane = sorted((e for e in events if e["device"] == d), key=lambda e: e["start"])
            assert all(a["end"] == pytest.approx(b["start"]) for a, b in zip(lane, lane[1:]))  # no gaps
    # busy time is the same (same work); lock-step waits per round, so its wall holds more bubble
    busy_share = [sum(c) for c in costs]
    odc_busy = [sum(e["end"] - e["start"] for e in odc if e["device"] == d and e["kind"] == "busy") for d in range(2)]
    assert np.allclose(np.array(odc_busy) / 2.0, np.array(busy_share) / max(busy_share))
    assert TL.bubble_rate(col) >= TL.bubble_rate(odc) - 1e-12
    with pytest.raises(ValueError, match="seconds must be > 0"):
        TL.events_from_plan(plan, 0.0, lockstep=False)


def test_plot_writes_a_png_with_the_rate(tmp_path):
    events = [ev(0, 0, 1, label="mb0 layer_0 fwd"), ev(0, 1, 3, label="mb0 layer_0 bwd"), ev(1, 0, 2),
              ev(1, 2, 3, "wait", "barrier")]
    path = str(tmp_path / "sub" / "t.png")
    rate = TL.plot_timeline(events, path, num_devices=2, title="x")
    assert rate == pytest.approx(1 - 5 / 6)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    TL.save_events(events, str(tmp_path / "t.json"))
    assert json.load(open(tmp_path / "t.json")) == events


# -- metrics -------------------------------------------------------------------------------------------------------


def record(step, loss=1.0):
    return M.step_metrics(step=step, loss=loss, grad_norm=0.5, seconds=2.0, tokens=100, loss_tokens=40,
                          sequences=4, microbatches=[1, 2], learning_rate=1e-3)


def test_step_metrics_rates():
    r = record(3)
    assert r["tokens_per_s"] == 50.0 and r["samples_per_s"] == 2.0 and r["microbatches"] == [1, 2]


def test_a_timed_planner_returns_the_plan_and_counts_only_planning_time():
    timers = Timers()
    planner = timers.timed("plan", get_planner("lb_mini"))
    lengths = [5, 9, 3, 7, 2, 8]
    assert planner(lengths, 2, 64).devices == get_planner("lb_mini")(lengths, 2, 64).devices
    planner(lengths, 2, 64)
    first = timers.take()["plan"]
    assert np.isfinite(first) and first > 0.0 and timers["plan"] == 0.0  # reset by take
    with pytest.raises(ValueError):  # a failing plan still counts, and the error passes through
        planner([100], 2, 64)
    assert timers.take()["plan"] > 0.0


def test_logger_writes_jsonl_and_tensorboard_and_truncates_on_resume(tmp_path):
    out = str(tmp_path)
    logger = M.MetricsLogger(out, total_steps=4, progress=False)
    for s in range(1, 5):
        logger.log(record(s, loss=float(s)))
        logger.advance()
    logger.close()
    assert [r["loss"] for r in M.read_metrics(logger.path)] == [1.0, 2.0, 3.0, 4.0]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(out, M.TENSORBOARD_DIR)))
    resumed = M.MetricsLogger(out, total_steps=4, start_step=2, progress=False)  # checkpoint was at step 2
    assert resumed.dropped_on_resume == 2
    resumed.log(record(3, loss=30.0))
    resumed.close()
    assert [(r["step"], r["loss"]) for r in M.read_metrics(logger.path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert M.truncate_metrics(str(tmp_path / "absent.jsonl"), 0) == 0


def test_a_torn_last_metrics_line_is_dropped_on_resume_and_other_corruption_names_the_file(tmp_path):
    out = str(tmp_path)
    logger = M.MetricsLogger(out, total_steps=4, progress=False)
    for s in (1, 2):
        logger.log(record(s, loss=float(s)))
    logger.close()
    with open(logger.path, "a") as f:  # a crash in the middle of writing step 3
        f.write(json.dumps(record(3))[:25])
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3: dropping a torn last line"):
        assert [r["step"] for r in M.read_metrics(logger.path)] == [1, 2]
    with pytest.warns(UserWarning, match="torn"):
        resumed = M.MetricsLogger(out, total_steps=4, start_step=2, progress=False)
    resumed.log(record(3, loss=3.0))
    resumed.close()
    assert [(r["step"], r["loss"]) for r in M.read_metrics(logger.path)] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    lines = open(logger.path).read().splitlines()
    lines[1] = lines[1][:10]  # damage in the middle of the file is not a torn write: refuse, naming the line
    with open(logger.path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record"):
        M.read_metrics(logger.path)
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        M.MetricsLogger(out, total_steps=4, start_step=3, progress=False)


# -- checkpoints ---------------------------------------------------------------------------------------------------


def engine_like_state(seed=0):
    """The shape of an Engine.state_dict(): flat params, an optax-like tree with a numpy scalar, the step."""
    rng = np.random.default_rng(seed)
    params = {"embed": rng.standard_normal(10).astype(np.float32), "head": rng.standard_normal(3).astype(np.float32)}
    import optax

    opt_state = optax.adamw(1e-3).init(params)
    opt_state = jax.tree.map(lambda x: np.asarray(x) + 0.5 if np.ndim(x) else np.int32(7), opt_state)
    return {"params": params, "opt_state": opt_state, "step": 7}


def test_checkpoints_keep_the_latest_n_and_restore_exactly(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"), keep=2)
    states = {s: engine_like_state(s) for s in (1, 2, 3)}
    for s, st in states.items():
        store.save(s, st, {"sampler": {"next_minibatch": s}})
    assert store.steps() == [2, 3] and store.latest_step() == 3
    assert sorted(os.listdir(tmp_path / "ck")) == ["2", "3"]
    engine_state, trainer_state = store.restore(2, engine_like_state(0))
    assert trainer_state == {"sampler": {"next_minibatch": 2}, "step": 2} and engine_state["step"] == 2
    want = states[2]
    assert jax.tree.structure(engine_state) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(engine_state)[:-1], jax.tree.leaves(want)[:-1]):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert store.read_trainer_state(3)["sampler"] == {"next_minibatch": 3}
    with pytest.raises(ValueError, match="step 3 already exists"):
        store.save(3, states[3], {})
    store.close()


CRASH_WHILE_SAVING = """
import os
from orbax.checkpoint._src.handlers import json_checkpoint_handler
from test_train_outputs import engine_like_state
from jodc.train.core.checkpoint import CheckpointStore

store = CheckpointStore({directory!r}, keep=3)
store.save(1, engine_like_state(1), {{"n": 1}})

async def die(*args, **kwargs):  # the process dies in the middle of writing checkpoint 2
    os._exit(17)

json_checkpoint_handler.JsonCheckpointHandler.async_save = die
store.save(2, engine_like_state(2), {{"n": 2}})
"""


def test_a_crash_while_saving_leaves_earlier_checkpoints_intact(tmp_path):
    directory = str(tmp_path / "ck")
    code = CRASH_WHILE_SAVING.format(directory=directory)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "XLA_FLAGS": "", "PYTHONPATH": os.path.dirname(__file__)})
    assert proc.returncode == 17, proc.stderr[-2000:]
    assert any(name.startswith("2.") for name in os.listdir(directory))  # the half-written step is there ...
    store = CheckpointStore(directory, keep=3)
    assert store.steps() == [1]  # ... but is not a checkpoint
    state, trainer = store.restore(1, engine_like_state(0))
    assert trainer["n"] == 1 and state["params"]["embed"].tobytes() == engine_like_state(1)["params"]["embed"].tobytes()
    store.save(2, engine_like_state(2), {"n": 2})  # and the run can go on saving
    assert store.steps() == [1, 2] and store.read_trainer_state(2)["n"] == 2
    store.close()


def test_restoring_into_another_model_is_refused(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"), keep=1)
    store.save(1, engine_like_state(), {})
    other = engine_like_state()
    other["params"]["embed"] = np.zeros(11, np.float32)
    with pytest.raises(ValueError, match="does not match this model|shape"):
        store.restore(1, {"params": other["params"], "opt_state": other["opt_state"], "step": 0})
    store.close()
