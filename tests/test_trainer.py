"""The Trainer core on a fake engine and a fake step (no model, no JAX program): checkpoint cadence, resume,
Ctrl-C between and inside steps, non-finite updates (stop or skip and count), evaluation cadence, timelines only
from engines that declare them, step timers and the summary."""
import json
import os

import numpy as np
import pytest

from jodc.balance import get_planner
from jodc.fsdp import NonFiniteStepError
from jodc.fsdp.engine import StepResult
from jodc.train.core import metrics
from jodc.train.core.checkpoint import CheckpointStore
from jodc.train.core.config import load_config
from jodc.train.core.metrics import read_metrics
from jodc.fsdp.timeline_analysis import events_from_plan
from jodc.train.core.timers import Timers, step_times, timing_lines, timing_summary
from jodc.train.core.trainer import CHECKPOINT_DIR, Trainer, run, summary_text
from jodc.train.rl.config import load_rl_config


class Engine:
    """w += the minibatch (a float); a non-finite w is not applied (as the real engines do)."""

    name = "fake"

    def __init__(self, supports_timeline=False):
        self.w, self.steps_done, self.closed, self.timelines = np.zeros(2, np.float32), 0, False, []
        self.supports_timeline = supports_timeline

    def step(self, delta, record_timeline=False, skip_nonfinite=False):
        self.timelines.append(record_timeline)
        new = self.w + np.float32(delta)
        result = StepResult(float(new.sum()), abs(float(delta)), 0.01, [1, 1],
                            [{"device": 0, "start": 0.0, "end": 1.0, "kind": "busy", "label": "mb0"}]
                            if record_timeline else None)
        if not np.isfinite(new).all():
            result.applied = False
            if skip_nonfinite:
                return result
            raise NonFiniteStepError(result, self.steps_done + 1)
        self.w, self.steps_done = new, self.steps_done + 1
        return result

    numels = {"w": 2}

    def sharded_state(self):  # host arrays stand in for the engines' sharded ones (the store saves both alike)
        return {"params": {"w": self.w.copy()}, "opt_state": {"count": np.int32(self.steps_done)}}

    def state_dict(self):
        return {**self.sharded_state(), "step": self.steps_done}

    def state_targets(self):
        return self.sharded_state()

    def drop_state(self):
        self.w = None

    def load_sharded_state(self, state, steps_done):
        self.w, self.steps_done = np.asarray(state["params"]["w"]), steps_done

    def nonfinite_groups(self):
        return [] if np.isfinite(self.w).all() else ["w"]

    def params(self):
        return {"w": self.w}

    def close(self):
        self.closed = True


class Run(Trainer):
    """Step k adds `deltas[k]` (default k + 1) to w; evaluation reports w's sum."""

    def __init__(self, config, deltas=None, supports_timeline=False, **kwargs):
        self.deltas, self.supports_timeline, self.evaluated = deltas or {}, supports_timeline, []
        kwargs.setdefault("engine_factory", lambda config, model, groups: Engine(supports_timeline))
        super().__init__(config, **kwargs)

    def load_data(self):
        return {"examples": 5, "sha256": "0" * 64}

    def build(self):
        self.engine = self.engine_factory(self.config, None, None)  # what build_engine does with a real model
        self.model_config = self.tokenizer = None

    def train_step(self, step):
        with self.timers("host"):
            self.timers.timed("plan", lambda: None)()
        done = step + 1
        plan = get_planner("lb_micro")([10, 5, 3], 2, 64)
        result = self.update(self.deltas.get(step, float(done)), f"step {done}",
                             timeline=(done, plan) if self.timeline_due(done) else None)
        return {"loss": result.loss, "tokens_per_s": 1.0, "step_seconds": result.seconds,
                self.SKIPPED_KEY: self.skipped}

    def evaluate(self, step):
        self.evaluated.append(step)
        return {"eval_w": float(self.engine.w.sum())}

    def summary_fields(self, done, final_eval):
        return {"final_eval": final_eval}


def config(tmp_path, *flags, eval_every=0):
    """A real SFT config (RL's when evaluating: only its run section has eval_every); the engine is the fake."""
    flags = ["--out_dir", str(tmp_path), "--steps", "5", "--save_every", "2", "--keep_checkpoints", "10",
             "--devices", "2", "--no-progress", "--no-export_hf", *flags]
    if eval_every:
        return load_rl_config(None, [*flags, "--eval_every", str(eval_every)])
    return load_config(None, flags)


def quiet(_message):
    pass


def saved_w(tmp_path):
    store = CheckpointStore(os.path.join(tmp_path, CHECKPOINT_DIR), keep=10)
    try:
        return {s: store.restore(s, Engine().state_dict())[0]["params"]["w"].tolist() for s in store.steps()}
    finally:
        store.close()


def test_checkpoint_cadence_logging_and_summary(tmp_path):
    lines = []
    summary = run(Run, config(tmp_path, "--log_every", "2"), log=lines.append)
    assert saved_w(tmp_path) == {2: [3.0, 3.0], 4: [10.0, 10.0], 5: [15.0, 15.0]}  # every 2, and the end
    assert [r["step"] for r in read_metrics(summary["metrics"])] == [2, 4, 5]  # log_every=2, and the last
    assert summary["steps_done"] == 5 and summary["checkpoint"].endswith(os.path.join(CHECKPOINT_DIR, "5"))
    assert summary["plan_ms_mean"] >= 0 and summary["step_seconds_mean"] == pytest.approx(0.01)
    record = read_metrics(summary["metrics"])[0]
    assert record["host_seconds"] >= record["plan_ms"] / 1e3 >= 0 and record["step_seconds"] == 0.01
    assert os.path.exists(tmp_path / "config.yaml") and "planning:" in lines[-1]


def test_resume_continues_where_the_checkpoint_is(tmp_path):
    first = run(Run, config(tmp_path / "a"), stop_at_step=3, log=quiet)
    assert first["steps_done"] == 3 and sorted(saved_w(tmp_path / "a")) == [2, 3]
    lines = []
    second = run(Run, config(tmp_path / "a"), log=lines.append)
    assert second["start_step"] == 3 and saved_w(tmp_path / "a")[5] == [15.0, 15.0]
    assert lines[0].startswith("resumed from") and lines[0].endswith("(step 3)")
    assert [r["step"] for r in read_metrics(second["metrics"])] == [1, 2, 3, 4, 5]
    again = run(Run, config(tmp_path / "a"), log=lines.append)
    assert again["start_step"] == again["steps_done"] == 5 and lines[-1].startswith("nothing to do")
    assert summary_text(again, None) == lines[-1]
    with pytest.raises(RuntimeError, match="checkpoint.resume is false"):
        run(Run, config(tmp_path / "a", "--no-resume"), log=quiet)


class CtrlC(Run):
    """Ctrl-C while the progress bar moves past step `between` (the step is done), or inside step `inside`."""

    between = inside = None

    class logger_class(metrics.MetricsLogger):
        advanced = 0

        def advance(self, steps=1):
            super().advance(steps)
            self.advanced += steps
            if self.advanced == CtrlC.between:
                raise KeyboardInterrupt

    def train_step(self, step):
        if step + 1 == CtrlC.inside:
            raise KeyboardInterrupt
        return super().train_step(step)


def test_ctrl_c_between_steps_saves_and_inside_a_step_does_not(tmp_path, monkeypatch):
    monkeypatch.setattr(CtrlC, "between", 3)
    with pytest.raises(KeyboardInterrupt):
        run(CtrlC, config(tmp_path, "--save_every", "0"), log=quiet)
    assert sorted(saved_w(tmp_path)) == [3]
    monkeypatch.setattr(CtrlC, "between", None)
    monkeypatch.setattr(CtrlC, "inside", 5)
    with pytest.raises(KeyboardInterrupt):
        run(CtrlC, config(tmp_path, "--save_every", "0"), log=quiet)
    assert sorted(saved_w(tmp_path)) == [3]  # step 4 finished but was not saved: the interrupt came inside 5
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4]


def test_ctrl_c_during_a_scheduled_save_completes_it_and_names_it_the_latest(tmp_path, monkeypatch, capfd,
                                                                             python_sigint_handler):
    """The signal arrives inside step 4's save (Ctrl-C is held back there: interrupts.py); the run stops with that
    checkpoint complete and says so, not with a torn save or an error from orbax's threads (seen on CI)."""
    import signal

    real = CheckpointStore._fit_write_buffer

    def ctrl_c_inside_step_4s_save(self, state):
        if int(np.asarray(state["opt_state"]["count"])) == 4:
            signal.raise_signal(signal.SIGINT)
        return real(self, state)

    monkeypatch.setattr(CheckpointStore, "_fit_write_buffer", ctrl_c_inside_step_4s_save)
    with pytest.raises(KeyboardInterrupt):
        run(Run, config(tmp_path, "--steps", "8"), log=quiet)
    assert saved_w(tmp_path) == {2: [3.0, 3.0], 4: [10.0, 10.0]}
    out = capfd.readouterr()
    assert out.out.splitlines()[-1] == ("interrupted; the latest checkpoint is "
                                        f"{os.path.join(tmp_path, CHECKPOINT_DIR, '4')}")
    assert "Ctrl-C: finishing the checkpoint of step 4 first" in out.err


def test_ctrl_c_again_during_the_save_of_an_interrupted_run_still_reports_it(tmp_path, monkeypatch, capfd,
                                                                           python_sigint_handler):
    """Ctrl-C between steps 3 and 4 saves step 3; a second Ctrl-C during that save lets it finish, and the run stops
    as interrupted, naming it (not with the second KeyboardInterrupt out of the first one's handler)."""
    import signal

    real = CheckpointStore._fit_write_buffer

    def ctrl_c_inside_the_save(self, state):
        signal.raise_signal(signal.SIGINT)
        return real(self, state)

    monkeypatch.setattr(CtrlC, "between", 3)
    monkeypatch.setattr(CheckpointStore, "_fit_write_buffer", ctrl_c_inside_the_save)
    with pytest.raises(KeyboardInterrupt):
        run(CtrlC, config(tmp_path, "--save_every", "0"), log=quiet)
    assert saved_w(tmp_path) == {3: [6.0, 6.0]}
    assert capfd.readouterr().out.splitlines()[-1] == ("interrupted; the latest checkpoint is "
                                                       f"{os.path.join(tmp_path, CHECKPOINT_DIR, '3')}")


def test_a_non_finite_update_stops_the_run_without_saving_it(tmp_path):
    with pytest.raises(FloatingPointError, match=r"step 3: non-finite loss \(loss nan, global grad norm nan\); the "
                       r"update was not applied; stopping without saving \(latest checkpoint: step 2"):
        run(Run, config(tmp_path), deltas={2: float("nan")}, log=quiet)
    assert sorted(saved_w(tmp_path)) == [2]
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]


def test_a_skipped_non_finite_update_is_counted_and_survives_resume(tmp_path):
    cfg = config(tmp_path, "--skip_nonfinite_steps")
    run(Run, cfg, deltas={2: float("nan")}, stop_at_step=3, log=quiet)
    resumed = Run(cfg, log=quiet)
    try:
        assert resumed.skipped == 1 and resumed.engine.steps_done == 2  # 3 steps, 1 not applied
        resumed.train()
    finally:
        resumed.close()
    assert resumed.engine is None  # closed
    w = saved_w(tmp_path)
    assert w[2] == w[3] == [3.0, 3.0] and w[5] == [12.0, 12.0]
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["skipped_updates"] for r in records] == [0, 0, 1, 1, 1]


def test_evaluation_before_due_steps_and_at_the_end(tmp_path):
    trainer = Run(config(tmp_path, eval_every=2), log=quiet)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    assert trainer.evaluated == [1, 3, 5, 5]  # before steps 1, 3, 5 (0-based 0, 2, 4), then the final one
    records = read_metrics(summary["metrics"])
    assert [r["step"] for r in records if "eval_w" in r] == [1, 3, 5] and records[0]["eval_w"] == 0.0
    assert all(r["eval_seconds"] >= 0 for r in records if "eval_w" in r)
    assert summary["final_eval"] == {"eval_w": 30.0}


@pytest.mark.parametrize("supports", [False, True])
def test_timelines_are_asked_only_of_engines_that_declare_them(tmp_path, supports):
    trainer = Run(config(tmp_path, "--timeline_every", "2"), supports_timeline=supports, log=quiet)
    trainer.engine.lockstep = True  # an estimate waits for the slowest device after every microbatch
    try:
        trainer.train()
        asked = trainer.engine.timelines
    finally:
        trainer.close()
    assert asked == [False, supports, False, supports, supports]  # due at 2, 4 and the last step
    assert trainer.timeline["step"] == 5 and os.path.exists(trainer.timeline["path"])
    assert trainer.timeline["source"] == ("engine" if supports else "planner-cost estimate")
    events = json.load(open(trainer.timeline["path"][:-4] + ".json"))
    plan = get_planner("lb_micro")([10, 5, 3], 2, 64)
    assert events == (Engine(True).step(0.0, record_timeline=True).timeline if supports
                      else events_from_plan(plan, 0.01, lockstep=True))


def test_a_failing_build_closes_what_was_opened(tmp_path):
    class Broken(Run):
        def build(self):
            super().build()
            raise ValueError("no model")

    with pytest.raises(ValueError, match="no model"):
        Broken(config(tmp_path), log=quiet)


def test_timers():
    timers = Timers()
    with timers("a"):
        pass
    with pytest.raises(ZeroDivisionError):  # a block that raises still counts
        with timers("a"):
            1 / 0
    planner = timers.timed("plan", lambda x: x + 1)
    assert planner(1) == 2 and timers["plan"] > 0 and timers["missing"] == 0.0
    taken = timers.take()
    assert set(taken) == {"a", "plan"} and timers.take() == {}
    assert step_times({"plan": 0.002, "host": 0.5}) == {"host_seconds": 0.5, "plan_ms": 2.0}
    summary = timing_summary([{"plan_ms": 1.0, "step_seconds": 0.5}, {"plan_ms": 3.0, "step_seconds": 0.7}])
    assert summary == {"plan_ms_mean": 2.0, "plan_ms_max": 3.0, "step_seconds_mean": pytest.approx(0.6)}
    assert timing_lines(summary) == ["planning:   2.00 ms mean, 3.00 ms max per step (mean step 600.0 ms)"]
    assert timing_lines(timing_summary([])) == []


def test_the_skipped_update_count_loads_under_its_old_sft_name():
    assert Trainer.skipped_in({"skipped_updates": 3}) == 3
    assert Trainer.skipped_in({"skipped_steps": 2}) == 2  # SFT checkpoints written before the names were one
    assert Trainer.skipped_in({}) == 0


def test_callbacks_see_every_step_and_update_and_an_engine_factory_keeps_its_engine(tmp_path):
    from jodc.train.core.callbacks import Callback

    class Recorder(Callback):
        def __init__(self):
            self.calls = []

        def on_step_start(self, trainer, step):
            self.calls.append(("step_start", step))

        def on_step_end(self, trainer, step, record):
            self.calls.append(("step_end", step, record["loss"]))

        def on_update_start(self, trainer):
            self.calls.append(("update_start",))

        def on_update_end(self, trainer, result):
            self.calls.append(("update_end", result.loss))

    class Pool:
        """An engine factory that keeps its engine open across runs (`release` instead of `close`)."""

        def __init__(self):
            self.engine, self.released = Engine(), 0

        def __call__(self, config, model, groups):
            return self.engine

        def release(self, engine):
            self.released += 1

    recorder, pool = Recorder(), Pool()
    run(Run, config(tmp_path, "--steps", "2"), log=quiet, callbacks=[recorder], engine_factory=pool)
    assert recorder.calls == [("step_start", 0), ("update_start",), ("update_end", 2.0), ("step_end", 0, 2.0),
                              ("step_start", 1), ("update_start",), ("update_end", 6.0), ("step_end", 1, 6.0)]
    assert pool.released == 1 and not pool.engine.closed  # the run released it; the pool decides when to close
