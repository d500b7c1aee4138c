"""Ctrl-C held back across work that must not be torn (train/core/interrupts.py): the block finishes, then
KeyboardInterrupt; a second Ctrl-C raises at once; other threads and programs that handle SIGINT themselves are left
alone; a checkpoint save (also under SIGINTs at random moments of real saves) and an export's swap into place are such
blocks."""
import os
import signal
import threading

import numpy as np
import pytest

from jodc.train.core.checkpoint import CheckpointStore
from jodc.train.core.interrupts import interrupts_held


def test_a_ctrl_c_inside_waits_for_the_block_then_raises(python_sigint_handler, capfd):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held("the test's work"):
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "Ctrl-C: finishing the test's work first (press Ctrl-C again to abandon it)" in capfd.readouterr().err


def test_a_second_ctrl_c_raises_at_once(python_sigint_handler):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held("the test's work"):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            done.append("never")
    assert done == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_no_ctrl_c_and_errors_pass_through_unchanged(python_sigint_handler):
    with interrupts_held("nothing"):
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # held inside
    with pytest.raises(ValueError, match="the block's own error"):
        with interrupts_held("failing work"):
            raise ValueError("the block's own error")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_blocks_leave_the_outermost_in_charge(python_sigint_handler):
    order = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held("outer"):
            with interrupts_held("inner"):
                signal.raise_signal(signal.SIGINT)
                order.append("inner done")
            order.append("outer done")
    assert order == ["inner done", "outer done"]


def test_a_program_handling_or_ignoring_sigint_keeps_its_choice():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with interrupts_held("work"):
            signal.raise_signal(signal.SIGINT)
        assert calls == [signal.SIGINT]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupts_held("work"):
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_other_threads_run_the_block_as_is(python_sigint_handler):
    seen = []

    def work():
        with interrupts_held("work in a thread"):  # signal.signal would raise ValueError outside the main thread
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


def test_a_ctrl_c_during_a_checkpoint_save_raises_after_it_is_complete(python_sigint_handler, tmp_path, monkeypatch):
    """The CI failure this fixes: Ctrl-C inside orbax's thread-pool code turned into "RuntimeError: release unlocked
    lock". Here the signal arrives inside the save (as the write buffer is sized); the checkpoint is complete and
    restorable, and only then does KeyboardInterrupt come."""
    store = CheckpointStore(str(tmp_path / "checkpoints"), keep=3)
    real = CheckpointStore._fit_write_buffer

    def fit_then_ctrl_c(self, state):
        signal.raise_signal(signal.SIGINT)
        return real(self, state)

    monkeypatch.setattr(CheckpointStore, "_fit_write_buffer", fit_then_ctrl_c)
    state = {"params": {"w": np.arange(4, dtype=np.float32)}}
    try:
        with pytest.raises(KeyboardInterrupt):
            store.save(7, state, {"note": "saved under Ctrl-C"})
        assert store.steps() == [7] and store.read_trainer_state(7)["note"] == "saved under Ctrl-C"
        restored, _ = store.restore(7, state)
        np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])
    finally:
        store.close()


def test_ctrl_c_at_random_moments_of_real_saves_always_leaves_the_checkpoint_complete(python_sigint_handler,
                                                                                      tmp_path, monkeypatch):
    """SIGINT sent from another thread at a random moment of each of 60 real saves (or just after one): every save
    ends with KeyboardInterrupt and its checkpoint complete. The timer starts inside the save's held block (as the
    write buffer is sized), so the outcome does not depend on timing. Without the hold most saves were torn (measured
    by hand: 477 of 600 not saved, with orbax's event loops left half-closed)."""
    import random
    import time

    store = CheckpointStore(str(tmp_path / "checkpoints"), keep=2)
    state = {"params": {f"w{i}": np.arange(1000, dtype=np.float32) for i in range(8)}}
    main = threading.main_thread().ident
    rng = random.Random(0)
    real = CheckpointStore._fit_write_buffer
    timers = []

    def fit_and_start_the_timer(self, state):
        timers.append(threading.Timer(rng.uniform(0, one_save), signal.pthread_kill, (main, signal.SIGINT)))
        timers[-1].start()
        return real(self, state)

    try:
        started = time.perf_counter()
        store.save(1, state, {})
        one_save = time.perf_counter() - started
        monkeypatch.setattr(CheckpointStore, "_fit_write_buffer", fit_and_start_the_timer)
        outcomes = []
        for step in range(2, 62):
            try:
                store.save(step, state, {})
                time.sleep(2 * one_save)  # a signal that came after the save lands here
                outcomes.append("no interrupt")
            except KeyboardInterrupt:
                outcomes.append("saved" if step in store.steps() else "torn")
            finally:
                for timer in timers:
                    timer.join()
        assert outcomes == ["saved"] * 60
    finally:
        store.close()


def test_a_ctrl_c_between_the_exports_renames_keeps_an_export_in_place(python_sigint_handler, tmp_path,
                                                                       monkeypatch):
    from jodc.train.core import export

    target, staging = tmp_path / "hf", tmp_path / "hf.tmp"
    target.mkdir()
    (target / "old").write_text("old")
    staging.mkdir()
    (staging / "new").write_text("new")
    renames = []
    real_rename = os.rename

    def rename_then_ctrl_c(src, dst):
        real_rename(src, dst)
        renames.append(dst)
        if len(renames) == 1:  # the earlier export is under .old, the new one not yet in place
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(export.os, "rename", rename_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        export._swap_into_place(str(staging), str(target))
    assert sorted(os.listdir(tmp_path)) == ["hf"] and os.listdir(target) == ["new"]
