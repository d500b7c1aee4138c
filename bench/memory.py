"""Host memory per process of each phase of a training run, as bytes per parameter (issue 40, DESIGN.md section 10).

    python -m bench.memory                       # both layouts, 1 / 3 layers (2 checks the line): memory.json
    python -m bench.memory --quick               # 1 process x 2 devices, 1 and 2 layers, vocabulary 512, no check
    python -m bench.memory --layouts 2x1 --layers 2 4 --check-layers 0 --vocab 32768 --out /tmp/memory.json

FSDP's promise is that no process ever holds the whole training state; this measures whether that holds *around*
the step too. Each (layout, size) runs in fresh process(es): one process driving 2 simulated CPU devices (`1x2`), or
`mpirun -np 2` with one device each (`2x1`, tools/mpirun.py). Each process runs the phases of `PHASES` in order
through the trainers' API (train/core/trainer.py; the calls that may change are isolated in the `api_*` functions):

* `init`: building the SFT trainer (model init + engine);
* `step`: `--steps` SFT steps (the first compiles); after them, the *steady* RSS between steps;
* `save`: checkpointing the last step (`Trainer.save`);
* `export`: the HF export at the end of the run (`Trainer._finish`);
* `restore`: a fresh trainer resuming from that checkpoint (build + restore), after the first one was closed;
* `rl_gather`: an RL trainer's policy made for the sampler and the trainer's passes (`RLRun.policy_version`: resharded on device), after one warm-up RL step;
* `rl_step`: the next whole RL step (the gather again, the rollout, `--rl-updates` updates).

Measured exactly, per process, with the kernel's counters: before a phase, `gc.collect()` and glibc's
`malloc_trim(0)` (what the previous phase freed does not count), VmRSS is read (`rss_start`) and "5" is written to
/proc/self/clear_refs, which resets the high-water mark VmHWM to the current RSS; after the phase VmHWM is its peak
(`peak`, device buffers included: on a CPU host they are host memory), and after another collection VmRSS is what it
left resident (`rss_after`; the step phase's is the steady state between steps). A 2x1 figure is the larger of the
two processes'.

Bytes per parameter are slopes between two model sizes (`--layers A B` of a Qwen2.5-0.5B-shaped decoder: width 896,
14 heads, 2 KV heads, MLP 4864, tied embeddings, `--vocab` rows, ~14.9M parameters per layer), so what does not
grow with the model (the interpreter, libraries, compiled programs) drops out as the intercept:
slope = (peak(B) - peak(A)) / (params(B) - params(A)). Activations grow with the layer count too, per token: the
minibatches are kept small (`--max-length`, `--sequences`) so they stay a small part of a layer's bytes. A third
size (`--check-layers C`, default 2) checks the lines: each phase's `fit err` is how far its peak there is off the
two-size line, relative to the peak.

Reported per layout: each phase's peak slope, its ratio to the steady slope, the GB per process it predicts for a
Qwen2.5-7B-sized model (slope x 7.6e9 / 1e9), the intercept; the steady slope against the process's own share of
the state, share = (12 + 8) / P bytes per parameter for P processes: fp32 parameters and Adam's two moments (12 B)
plus ODC's symmetric heap (8 B: the published parameter shard and the gradient accumulator), each split over the
processes; the slope of what each phase leaves resident (`after`: a phase that leaves more behind than the steady
state, such as jax's host copy cached on an array read with np.asarray, shows there); and the seconds of the save
and the restore (build + restore; init's seconds beside them) at the larger size. The RL runs are DPPO with
`rollout.assembly: sharded` across processes and no KL term (no reference policy). The RL steady slope (RSS between RL steps) is reported on its own line; every ratio is over the SFT steady
slope (the state's cost). Targets, printed as pass/FAIL (never asserted): every phase's peak <= 1.2 x the steady
slope, and with 2 processes the steady slope <= 1.2 x the process's own share. The steady slope compared with the
share is the process's own memory: its RSS less the other processes' part of the shared pages it maps (RssShmem: on
one node the MPI transport's heap windows are shared memory, which the kernel counts in the RSS of every process that
touched them, though they exist once); the RSS figure is reported beside it.

Prints a table per layout and one JSON line at the end (`memory_peak_over_steady_<phase>_<layout>`,
`memory_steady_bytes_per_param_<layout>`, `memory_state_share_bytes_per_param_<layout>`,
`memory_predicted_gb_per_process_7b_<phase>_<layout>`, `save_seconds_<layout>`, `restore_seconds_<layout>`, ...),
written with every process's raw numbers to --out (default bench/results/memory[_quick].json) unless --no-save.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

from bench import harness  # noqa: E402
from tools.mpirun import mpi_env, mpirun_command, stream_session  # noqa: E402

RESULT_PREFIX = "MEMBENCH "
LAYOUTS = {"1x2": (1, 2), "2x1": (2, 1)}  # name: (processes, devices per process)
PRESET = "qwen2.5-0.5b"
PARAMS_7B = 7.6e9  # Qwen2.5-7B's parameter count
TARGET_PEAK_OVER_STEADY = 1.2
TARGET_STEADY_OVER_SHARE = 1.2
STATE_BYTES, HEAP_BYTES = 12, 8  # per parameter: fp32 params + 2 Adam moments; ODC's published shard + accumulator


# ------------------------------------------------------------------------------------------ measuring one process
def proc_status(*fields: str) -> dict[str, int]:
    """The given Vm* fields of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                out[name] = int(value.split()[0]) * 1024  # kB
    return out


def collect() -> None:
    """Frees what nothing references any more: Python's garbage, then glibc's free pages (malloc_trim), so that a
    phase's RSS at start is what is live."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS may then hold freed pages
        pass


def reset_peak() -> None:
    """Resets the kernel's high-water mark VmHWM of this process to its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(fn: Callable[[], Any]) -> dict[str, float]:
    """Runs `fn` as a phase: {rss_start, peak, rss_after (bytes), seconds} (see the module docstring)."""
    collect()
    rss_start = proc_status("VmRSS")["VmRSS"]
    reset_peak()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    peak = proc_status("VmHWM")["VmHWM"]
    collect()
    after = proc_status("VmRSS", "RssShmem")
    return {"rss_start": rss_start, "peak": peak, "rss_after": after["VmRSS"], "shmem_after": after.get("RssShmem", 0),
            "seconds": seconds}


# ------------------------------------------- the trainer API the phases call: the one place to adapt when it changes
def quiet(_message: str) -> None:
    pass


def parity_reward(prompt: str, response: str) -> float:
    """An RL reward with signal for an untrained model (the task's exact match is 0 for every response), so that an
    RL update has non-zero advantages; deterministic, as every process of a 2x1 run must compute the same."""
    return float(len(response) % 2)


def api_build(cls, config, **kwargs):
    """A trainer of `config` (it resumes from the latest checkpoint in run.out_dir when there is one), ready to have
    its steps run one by one: the metrics logger `Trainer.train` would open is a silent one."""
    from jodc.train.core.trainer import _SilentLogger

    trainer = cls(config, log=quiet, **kwargs)
    trainer.logger = _SilentLogger()
    return trainer


def api_step(trainer, step: int) -> None:
    """0-based step `step` as `Trainer.train` runs it."""
    trainer._run_step(step)


def api_save(trainer, done: int) -> str:
    """Checkpoints step `done`; returns the checkpoint's directory."""
    trainer.save(done)
    return trainer.store.step_dir(done)


def api_export(trainer, done: int) -> str:
    """The end of a run at step `done` (= run.steps): its HF export; returns the export's directory."""
    return trainer._finish(done, 0.0)["hf_export"]


def api_restored_step(trainer) -> int:
    """The step a resumed trainer continues after."""
    return trainer.start_step


def api_gather_policy(trainer):
    """The policy as an RL step makes it for the sampler and the trainer's passes (resharded on device)."""
    return trainer.policy_version()


def api_close(trainer) -> None:
    trainer.close()


# ------------------------------------------------------------------------------------------------ the phases
@dataclasses.dataclass
class Session:
    """What the phases of one process share: the configs, the live trainer, the gathered policy."""

    sft_config: Any
    rl_config: Any
    steps: int
    trainer: Any = None
    gathered: Any = None
    checkpoint: str | None = None
    export: str | None = None

    def close(self) -> None:
        self.gathered = None
        if self.trainer is not None:
            trainer, self.trainer = self.trainer, None
            api_close(trainer)

    def build_sft(self) -> None:
        self.trainer = api_build(_sft_class(), self.sft_config)

    def sft_steps(self) -> None:
        for step in range(self.steps):
            api_step(self.trainer, step)

    def save(self) -> None:
        self.checkpoint = api_save(self.trainer, self.steps)
        if not os.path.isdir(self.checkpoint):
            raise RuntimeError(f"the save phase wrote no checkpoint at {self.checkpoint}")

    def export_hf(self) -> None:
        self.export = api_export(self.trainer, self.steps)
        import jax

        if jax.process_index() == 0 and not (self.export and os.path.isdir(self.export)):
            raise RuntimeError(f"the export phase wrote no HF export ({self.export})")

    def resume_sft(self) -> None:
        self.trainer = api_build(_sft_class(), self.sft_config)
        if api_restored_step(self.trainer) != self.steps:
            raise RuntimeError(f"the fresh trainer resumed at step {api_restored_step(self.trainer)}, not at the "
                               f"checkpoint's {self.steps}")

    def start_rl(self) -> None:
        """Closes the SFT trainer, builds the RL trainer and runs its first step (which compiles)."""
        from jodc.train.rl.loop import RLRun

        self.close()
        self.trainer = api_build(RLRun, self.rl_config, reward_fn=parity_reward)
        api_step(self.trainer, 0)

    def gather(self) -> None:
        self.gathered = api_gather_policy(self.trainer)

    def rl_step(self) -> None:
        api_step(self.trainer, 1)


def _sft_class():
    from jodc.train.sft.loop import SFTRun

    return SFTRun


@dataclasses.dataclass(frozen=True)
class Phase:
    """A measured phase: `body` is measured; `prepare` runs before it, unmeasured (what the phase replaces is
    closed there, so that its memory is freed before the phase starts)."""

    name: str
    what: str
    body: Callable[[Session], None]
    prepare: Callable[[Session], None] | None = None


PHASES = (
    Phase("init", "SFT trainer built: model init + engine", Session.build_sft),
    Phase("step", "SFT steps (the first compiles)", Session.sft_steps),
    Phase("save", "checkpoint save", Session.save),
    Phase("export", "HF export at the end of the run", Session.export_hf),
    Phase("restore", "fresh trainer resuming: build + restore", Session.resume_sft, prepare=Session.close),
    Phase("rl_gather", "RL: policy resharded for the sampler", Session.gather, prepare=Session.start_rl),
    Phase("rl_step", "RL: a whole step (gather, rollout, update)", Session.rl_step,
          prepare=lambda s: setattr(s, "gathered", None)),
)
PHASE_NAMES = tuple(p.name for p in PHASES)
SFT_PHASES = tuple(n for n in PHASE_NAMES if not n.startswith("rl_"))


def sft_overrides(args, out_dir: str, devices: int) -> list[str]:
    return ["--preset", PRESET, "--num_layers", str(args.layers_now), "--vocab_size", str(args.vocab),
            "--max_length", str(args.max_length), "--attention_block_size", str(min(128, args.max_length)),
            "--embedded_examples", str(4 * args.sequences * args.steps), "--sequences_per_minibatch",
            str(args.sequences), "--devices", str(devices), "--steps", str(args.steps), "--save_every", "0",
            "--keep_checkpoints", "1", "--timeline_every", "0", "--no-progress", "--export_hf",
            "--out_dir", out_dir]


def rl_overrides(args, out_dir: str, devices: int) -> list[str]:
    return ["--preset", PRESET, "--num_layers", str(args.layers_now), "--vocab_size", str(args.vocab),
            "--attention_block_size", "16", "--token_cap", "64", "--prompt_bucket", "16", "--max_new_tokens",
            str(args.rl_new_tokens), "--max_digits", "1", "--max_terms", "2", "--sft_steps", "0",
            "--prompts_per_step", str(devices * args.rl_prompts_per_device), "--group_size", "2",
            "--updates_per_step", str(args.rl_updates), "--steps", "2", "--devices", str(devices),
            "--save_every", "0", "--eval_every", "0", "--eval_problems", "1", "--no-export_hf", "--no-progress",
            "--out_dir", out_dir]


def param_count(config) -> int:
    """Parameters of the decoder `config` (shapes only: nothing is allocated)."""
    import jax
    import numpy as np

    from jodc.models import init_params

    shapes = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)))


def worker(args) -> None:
    """One process of one (layout, size): every phase, then one RESULT_PREFIX line with its numbers."""
    processes, local = LAYOUTS[args.layout]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local}"
    import jax

    if processes > 1:
        from jodc.train.core import distributed

        distributed.initialize()
    from jodc.train import load_config
    from jodc.train.rl.config import load_rl_config

    devices = processes * local
    rank = jax.process_index()
    root = args.run_dir
    session = Session(load_config(None, sft_overrides(args, os.path.join(root, "sft"), devices)),
                      load_rl_config(None, rl_overrides(args, os.path.join(root, "rl"), devices)), args.steps)
    phases, params = {}, None
    try:
        for phase in PHASES:
            if phase.prepare is not None:
                phase.prepare(session)
            phases[phase.name] = measure(lambda: phase.body(session))
            if params is None:
                params = param_count(session.trainer.model_config)
            if rank == 0:
                p = phases[phase.name]
                print(f"# {args.layout}, {args.layers_now} layer(s): {phase.name} peak {p['peak'] / 2**20:.0f} MiB "
                      f"(start {p['rss_start'] / 2**20:.0f}, after {p['rss_after'] / 2**20:.0f}), "
                      f"{p['seconds']:.1f} s", file=sys.stderr, flush=True)
    finally:
        session.close()
    print(RESULT_PREFIX + json.dumps({"layout": args.layout, "process": rank, "processes": processes,
                                      "local_devices": local, "layers": args.layers_now, "vocab": args.vocab,
                                      "params": params, "phases": phases}), flush=True)


# ----------------------------------------------------------------------------------------------- the driver
def launch(args, layout: str, layers: int) -> list[dict]:
    """Runs one (layout, size) in fresh process(es); returns each process's numbers, by process index."""
    processes, _ = LAYOUTS[layout]
    run_dir = tempfile.mkdtemp(prefix=f"membench_{layout}_{layers}_")
    worker_args = ["--worker", "--layout", layout, "--layers-now", str(layers), "--run-dir", run_dir,
                   *forwarded(args)]
    if processes > 1:
        cmd = mpirun_command(processes, sys.executable, "-m", "mpi4py", "-m", "bench.memory", *worker_args)
        env = harness.child_env(mpi_env())
    else:
        cmd, env = harness.module_command("memory", *worker_args), harness.child_env(PYTHONUNBUFFERED="1")
    def echo(line: str) -> None:
        if line.startswith("# "):
            print(line, file=sys.stderr, flush=True)

    try:
        returncode, lines, timed_out = stream_session(cmd, env, args.timeout, echo, cwd=REPO)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    results = sorted((json.loads(x[len(RESULT_PREFIX):]) for x in lines if x.startswith(RESULT_PREFIX)),
                     key=lambda r: r["process"])
    if returncode != 0 or len(results) != processes:
        why = f"did not finish within --timeout {args.timeout:g} s" if timed_out else f"failed (exit {returncode})"
        raise RuntimeError(f"{layout} with {layers} layer(s) {why}:\n" + "\n".join(lines)[-4000:])
    return results


def forwarded(args) -> list[str]:
    """The options a worker needs, as given to the driver."""
    return ["--vocab", str(args.vocab), "--steps", str(args.steps), "--max-length", str(args.max_length),
            "--sequences", str(args.sequences), "--rl-updates", str(args.rl_updates), "--rl-prompts-per-device",
            str(args.rl_prompts_per_device), "--rl-new-tokens", str(args.rl_new_tokens)]


def slope(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(slope, intercept) of the line through two (parameters, bytes) points: bytes per parameter and the bytes that
    do not grow with the model."""
    (n1, b1), (n2, b2) = small, large
    if n2 == n1:
        raise ValueError(f"two sizes with the same parameter count ({n1}) give no slope")
    k = (b2 - b1) / (n2 - n1)
    return k, b1 - k * n1


def worst(processes: list[dict], phase: str, key: str) -> float:
    """The largest of the processes' `key` of `phase` (a 2x1 figure is the larger process's)."""
    return max(p["phases"][phase][key] for p in processes)


def fit_error(line: tuple[float, float], params: float, measured: float) -> float:
    """(measured - the line's prediction at `params`) / measured: how far a third size is off the two-size line."""
    k, b = line
    return (measured - (k * params + b)) / measured


def analyse(layout: str, small: list[dict], large: list[dict], check: list[dict] | None = None) -> dict:
    """Slopes, ratios, predictions and the targets' verdicts of one layout from its two sizes' processes; with the
    processes of a third size (`check`), each line's relative error there (`fit_error`)."""
    n1, n2 = small[0]["params"], large[0]["params"]
    processes = small[0]["processes"]

    def fit(phase: str, key: str = "peak") -> tuple[float, float]:
        return slope((n1, worst(small, phase, key)), (n2, worst(large, phase, key)))

    def error(phase: str, key: str = "peak") -> float | None:
        return None if check is None else fit_error(fit(phase, key), check[0]["params"], worst(check, phase, key))

    steady, steady_intercept = fit("step", "rss_after")
    # shared memory in it: pages of shared-memory windows (the MPI transport on one node maps every process's heap
    # into every other that reads or writes it) count in the RSS of each process that touched them, but exist once
    steady_shared = fit("step", "shmem_after")[0] if all("shmem_after" in r["phases"]["step"] for r in small + large) else 0.0
    rl_steady, _ = fit("rl_step", "rss_after")
    share = (STATE_BYTES + HEAP_BYTES) / processes
    phases = {}
    for name in PHASE_NAMES:
        k, b = fit(name)
        phases[name] = {"peak_bytes_per_param": k, "intercept_bytes": b, "peak_over_steady": k / steady,
                        "after_bytes_per_param": fit(name, "rss_after")[0],
                        "predicted_gb_per_process_7b": k * PARAMS_7B / 1e9,
                        "seconds": worst(large, name, "seconds"), "fit_error": error(name),
                        "passes": k / steady <= TARGET_PEAK_OVER_STEADY}
    return {"layout": layout, "processes": processes, "params": [n1, n2],
            "layers": [small[0]["layers"], large[0]["layers"]], "vocab": small[0]["vocab"],
            "check_layers": None if check is None else check[0]["layers"],
            "check_params": None if check is None else check[0]["params"],
            "steady_bytes_per_param": steady, "steady_intercept_bytes": steady_intercept,
            "steady_shared_bytes_per_param": steady_shared,
            "steady_fit_error": error("step", "rss_after"),
            "rl_steady_bytes_per_param": rl_steady, "state_share_bytes_per_param": share,
            # what the process holds on its own: its RSS less the shared pages' part held by the other processes of
            # the node (all of them here), which RSS counts in every process that mapped them
            "steady_own_bytes_per_param": steady - steady_shared * (1 - 1 / processes),
            "steady_over_share": (steady - steady_shared * (1 - 1 / processes)) / share,
            "steady_rss_over_share": steady / share,
            "steady_passes": ((steady - steady_shared * (1 - 1 / processes)) / share <= TARGET_STEADY_OVER_SHARE
                              if processes > 1 else None),
            "phases": phases}


def summary_keys(a: dict) -> dict:
    """The JSON keys of one layout's analysis."""
    lay, out = a["layout"], {}
    for name, p in a["phases"].items():
        out[f"memory_peak_over_steady_{name}_{lay}"] = round(p["peak_over_steady"], 3)
        out[f"memory_peak_bytes_per_param_{name}_{lay}"] = round(p["peak_bytes_per_param"], 2)
        out[f"memory_predicted_gb_per_process_7b_{name}_{lay}"] = round(p["predicted_gb_per_process_7b"], 1)
        out[f"memory_after_bytes_per_param_{name}_{lay}"] = round(p["after_bytes_per_param"], 2)
    out.update({f"memory_steady_bytes_per_param_{lay}": round(a["steady_bytes_per_param"], 2),
                f"memory_steady_shared_bytes_per_param_{lay}": round(a.get("steady_shared_bytes_per_param", 0.0), 2),
                f"memory_steady_own_bytes_per_param_{lay}": round(a["steady_own_bytes_per_param"], 2),
                f"memory_steady_rss_over_share_{lay}": round(a["steady_rss_over_share"], 3),
                f"memory_rl_steady_bytes_per_param_{lay}": round(a["rl_steady_bytes_per_param"], 2),
                f"memory_state_share_bytes_per_param_{lay}": round(a["state_share_bytes_per_param"], 2),
                f"memory_steady_over_share_{lay}": round(a["steady_over_share"], 3),
                f"memory_phases_within_target_{lay}": all(p["passes"] for p in a["phases"].values()),
                f"init_seconds_{lay}": round(a["phases"]["init"]["seconds"], 2),
                f"save_seconds_{lay}": round(a["phases"]["save"]["seconds"], 2),
                f"restore_seconds_{lay}": round(a["phases"]["restore"]["seconds"], 2),
                f"memory_params_{lay}": a["params"]})
    if a["steady_passes"] is not None:
        out[f"memory_steady_within_share_target_{lay}"] = a["steady_passes"]
    if a["check_layers"] is not None:
        errors = {name: p["fit_error"] for name, p in a["phases"].items()}
        errors["steady"] = a["steady_fit_error"]
        out.update({f"memory_fit_error_{name}_{lay}": round(e, 4) for name, e in errors.items()})
        out[f"memory_fit_max_abs_error_{lay}"] = round(max(abs(e) for e in errors.values()), 4)
    return out


def print_table(a: dict) -> None:
    procs, (n1, n2) = a["processes"], a["params"]
    name = f"{procs} process{'es' if procs > 1 else ''} x {2 // procs} device{'s' if procs == 1 else ''}"
    print(f"\n{name} ({a['layout']}): {PRESET}-shaped decoder, {a['layers'][0]} / {a['layers'][1]} layers, vocabulary "
          f"{a['vocab']} ({n1 / 1e6:.1f}M / {n2 / 1e6:.1f}M parameters); per process"
          + (", the larger of the processes" if procs > 1 else ""))
    check = a["check_layers"] is not None
    print(f"{'phase':<10} {'what':<44} {'B/param':>8} {'/steady':>8} {'7B GB':>7} {'fixed MiB':>9} {'after':>6} "
          f"{'s':>7}" + (f" {'fit err':>7}" if check else "") + f"  target <= {TARGET_PEAK_OVER_STEADY}x")
    what = {p.name: p.what for p in PHASES}
    for phase, p in a["phases"].items():
        print(f"{phase:<10} {what[phase]:<44} {p['peak_bytes_per_param']:>8.1f} {p['peak_over_steady']:>8.2f} "
              f"{p['predicted_gb_per_process_7b']:>7.0f} {p['intercept_bytes'] / 2**20:>9.0f} "
              f"{p['after_bytes_per_param']:>6.1f} {p['seconds']:>7.1f}"
              + (f" {p['fit_error']:>7.1%}" if check else "") + f"  {'pass' if p['passes'] else 'FAIL'}")
    verdict = ("" if a["steady_passes"] is None else
               f"  target <= {TARGET_STEADY_OVER_SHARE}x: {'pass' if a['steady_passes'] else 'FAIL'}")
    print(f"steady (between SFT steps): {a['steady_bytes_per_param']:.1f} B/param RSS (fixed "
          f"{a['steady_intercept_bytes'] / 2**20:.0f} MiB), of which {a['steady_shared_bytes_per_param']:.1f} shared "
          f"memory (RssShmem: heap windows every process of the node maps); the process's own "
          f"{a['steady_own_bytes_per_param']:.1f} B/param (RSS less the other processes' part of the shared pages) "
          f"against its share of the state (12 + 8) / {a['processes']} = {a['state_share_bytes_per_param']:.1f} "
          f"B/param: {a['steady_over_share']:.2f}x{verdict}")
    print(f"steady between RL steps: {a['rl_steady_bytes_per_param']:.1f} B/param")
    if check:
        print(f"fit err: (measured - the line's prediction) / measured at {a['check_layers']} layers "
              f"({a['check_params'] / 1e6:.1f}M parameters); steady: {a['steady_fit_error']:.1%}")


def print_tables(analyses: list[dict]) -> None:
    for a in analyses:
        print_table(a)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=None,
                   help="default: 1x2 2x1 (--quick: 1x2)")
    p.add_argument("--layers", type=int, nargs=2, default=None, metavar=("A", "B"),
                   help="the two model sizes, in layers (default 1 3; --quick: 1 2)")
    p.add_argument("--check-layers", type=int, default=None, metavar="C",
                   help="a third size that checks the lines (default 2; --quick: none; 0: none)")
    p.add_argument("--vocab", type=int, default=None, help="embedding rows (default 4096; --quick: 512; the real "
                                                           "Qwen2.5 vocabulary is 151936)")
    p.add_argument("--steps", type=int, default=None, help="SFT steps of the step phase (default 3; --quick: 2)")
    p.add_argument("--max-length", type=int, default=64, help="SFT sequence length (tokens)")
    p.add_argument("--sequences", type=int, default=4, help="SFT sequences per minibatch")
    p.add_argument("--rl-updates", type=int, default=1, help="optimizer updates per RL step")
    p.add_argument("--rl-prompts-per-device", type=int, default=2, help="RL prompts per device (2 responses each)")
    p.add_argument("--rl-new-tokens", type=int, default=4, help="tokens sampled per RL response")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per (layout, size) run; then it is killed")
    p.add_argument("--quick", action="store_true", help="1x2 only, 1 and 2 layers, vocabulary 512, 2 SFT steps")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/memory[_quick].json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="1x2", help=argparse.SUPPRESS)
    p.add_argument("--layers-now", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = dict(layouts=["1x2"], layers=[1, 2], vocab=512, steps=2, check_layers=0) if args.quick else \
        dict(layouts=["1x2", "2x1"], layers=[1, 3], vocab=4096, steps=3, check_layers=2)
    harness.fill_unset(args, defaults)
    if args.layers[0] >= args.layers[1]:
        p.error(f"--layers needs two sizes, smaller first, got {args.layers}")
    if args.check_layers in args.layers:
        p.error(f"--check-layers {args.check_layers} is one of the fitted sizes {args.layers}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    started, runs, analyses = time.monotonic(), {}, []
    for layout in args.layouts:
        sizes = [launch(args, layout, layers) for layers in args.layers + ([args.check_layers] if args.check_layers
                                                                           else [])]
        runs[layout] = sizes
        analyses.append(analyse(layout, *sizes))
        print(f"# {layout}: {time.monotonic() - started:.0f} s so far", file=sys.stderr, flush=True)
    summary = {"bench": "memory", "quick": bool(args.quick), "preset": PRESET, "layers": args.layers,
               "check_layers": args.check_layers or None,
               "vocab": args.vocab, "sft_steps": args.steps, "seconds": round(time.monotonic() - started, 1)}
    for a in analyses:
        summary.update(summary_keys(a))
    return harness.report(summary, harness.output(args, f"memory{'_quick' if args.quick else ''}.json"),
                          lambda: print_tables(analyses),
                          saved={"summary": summary, "layouts": analyses, "runs": runs})


if __name__ == "__main__":
    main()
