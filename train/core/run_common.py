"""The resume checks both trainers make before anything is built (called by `train.core.trainer.Trainer`): the
learning-rate schedule keeps the original run's length, and a checkpoint trained on other data is refused."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


def pin_schedule_length(config, saved: dict[str, Any], log: Callable[[str], None]):
    """`config` with the learning-rate schedule's length of the run it resumes (`saved`: the checkpoint's trainer
    state). Raising `run.steps` to train longer must not move the schedule under the steps already taken (a
    cosine decay would jump back up): unless `optimizer.total_steps` is set, the schedule keeps the original
    run's length (and stays at its final value past it). Setting `optimizer.total_steps` changes it, said aloud."""
    original = saved.get("schedule_steps")
    if original is None:
        return config
    now = config.total_steps
    if config.optimizer.total_steps is not None:
        if now != original:
            log(f"note: the learning-rate schedule's length changes from {original} to {now} optimizer updates "
                "(optimizer.total_steps)")
        return config
    if now != original:
        log(f"note: the learning-rate schedule keeps the original run's length of {original} optimizer updates "
            f"(the new run.steps would make it {now}); set optimizer.total_steps to change it")
    return dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, total_steps=original))


def check_data_fingerprint(saved: dict | None, now: dict, *, accept: bool, where: str,
                           log: Callable[[str], None]) -> None:
    """Refuses to resume on data other than the checkpoint's (`saved`, from `data.fingerprint_examples`), or only
    says so with `accept` (checkpoint.accept_changed_data). Checkpoints without a fingerprint are accepted."""
    if saved is None or now is None or saved == now:  # None: an older checkpoint, or a generated RL task
        return
    change = (f"the data differ from those checkpoint {where} was trained on ({saved.get('examples')} examples, "
              f"sha256 {str(saved.get('sha256'))[:16]}... then; {now['examples']} examples, sha256 "
              f"{now['sha256'][:16]}... now)")
    if accept:
        log(f"warning: {change}; resuming anyway (checkpoint.accept_changed_data)")
        return
    raise RuntimeError(f"{change}: resuming would silently continue on other data. Restore the data, use another "
                       "run.out_dir for a new run, or set checkpoint.accept_changed_data=true to resume anyway")
