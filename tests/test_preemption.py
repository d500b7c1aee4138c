"""The SIGTERM watch (train/core/preemption.py): the handler is installed by the outermost watch only and restored
after it, a request is seen by `reached`, forgotten when the outermost watch ends, and a SIGTERM that arrives while
a run is still being built stops it after its first step (checkpointed). Runs stopped mid-step and resumed exactly:
tests/test_train_sft.py, test_rl.py, test_rl_async.py (one process, the CLI's status 143) and test_multiprocess.py
(mpirun, SIGTERM to rank 0 or 1)."""
import os
import signal

import pytest

from jodc.train import load_config, run_sft
from jodc.train.core import distributed
from jodc.train.core.checkpoint import CheckpointStore
from jodc.train.core.preemption import EXIT_STATUS, Preempted, PreemptionWatch
from jodc.train.sft.loop import CHECKPOINT_DIR

from test_train_sft import overrides, quiet


def test_the_outermost_watch_holds_the_handler_and_forgets_the_request_when_it_ends():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatch() as outer:
        installed = signal.getsignal(signal.SIGTERM)
        assert installed is not before and not outer.reached(1)
        with PreemptionWatch() as inner:
            assert signal.getsignal(signal.SIGTERM) is installed
            os.kill(os.getpid(), signal.SIGTERM)
            assert inner.reached(2)
        assert signal.getsignal(signal.SIGTERM) is installed and outer.reached(3)  # the inner one kept both
    assert signal.getsignal(signal.SIGTERM) is before
    with PreemptionWatch() as again:
        assert not again.reached(1)
    assert EXIT_STATUS == 143
    assert str(Preempted(7, "/r/checkpoints/7")) == ("stopped by SIGTERM after step 7 (checkpoint /r/checkpoints/7); "
                                                     "run the same command again to resume")


def test_any_process_in_one_process_is_the_flag():
    assert distributed.any_process(True) and not distributed.any_process(False)


def test_a_sigterm_while_the_run_is_built_stops_it_after_its_first_step(tmp_path):
    """As under the CLI, which holds a watch around the whole command: a SIGTERM before the loop (model build,
    restore, an RL warm start) no longer ends the process; the run does its first step, checkpoints it and stops."""
    config = load_config(None, overrides(tmp_path, "--engine", "reference", "--timeline_every", "0",
                                         "--no-export_hf"))
    with PreemptionWatch():
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(Preempted, match="after step 1 "):
            run_sft(config, log=quiet)
    store = CheckpointStore(os.path.join(tmp_path, CHECKPOINT_DIR), keep=2)
    try:
        assert store.steps() == [1]
    finally:
        store.close()
