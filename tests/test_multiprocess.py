"""Multi-process ODC: launches the workers of tests/multiprocess/ under `mpirun` (as mpi4jax's CI does), each run
bounded by a timeout whose expiry kills the whole process group and fails with the output so far.

Needs the `jodc[mpi]` extra (mpirun next to this Python, jodc/_ffi_mpi.so built); `make test` installs it.
"""
import os
import subprocess
import sys
import time

import pytest

from mpirun import MPIRUN, kill_session, mpi_env, mpirun_command  # tools/ (conftest puts it on the path)
from jodc.ops.transports import mpi_library

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "multiprocess")
#: What the workers import besides jodc: their helpers (_mp, beside them) and the tests' shared models (fsdp_toy,
#: rl_sampling_setup).
WORKER_PATH = os.pathsep.join([WORKERS, HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

needs_mpi = pytest.mark.skipif(not (os.access(MPIRUN, os.X_OK) and mpi_library.available()),
                               reason="needs the jodc[mpi] extra (mpirun in the venv) and jodc/_ffi_mpi.so")


def run_session(cmd: list[str], timeout: float, env: dict, **kw) -> tuple[int, str]:
    """Runs `cmd` in a session of its own; on timeout kills the whole session and fails the test with the output so
    far. Returns (exit status, stdout + stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, **kw)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException as e:  # the timeout, or Ctrl-C: leave no workers behind
        kill_session(proc.pid)
        out, _ = proc.communicate()
        if isinstance(e, subprocess.TimeoutExpired):
            pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s; output:\n{out[-6000:]}")
        raise
    return proc.returncode, out


def run_mpi(nprocs: int, script: str, *args: str, timeout: float = 240, mpirun_args=()) -> tuple[int, str, float]:
    """Runs `mpirun -np nprocs python -m mpi4py script args`; returns (exit status, output, seconds)."""
    cmd = mpirun_command(nprocs, *mpirun_args, sys.executable, "-m", "mpi4py", os.path.join(WORKERS, script), *args)
    t0 = time.monotonic()
    rc, out = run_session(cmd, timeout, mpi_env(PYTHONPATH=WORKER_PATH))
    return rc, out, time.monotonic() - t0


def check_cases(out: str, rc: int, script_cases: list[str]):
    assert rc == 0, out[-6000:]
    for name in script_cases:
        assert f"PASS {name}" in out, f"case {name} did not pass:\n{out[-6000:]}"


OPS_CASES = ["transport_is_mpi", "gather_is_exact", "gather_bf16_master_keeps_shape",
             "scatter_accumulate_matches_numpy_sum", "publish_then_gather_sees_new_shards", "zero_accumulator",
             "deterministic_is_bitwise_source_ordered", "registration_mismatch_names_bucket_and_processes",
             "barrier_timeout_names_missing_process", "progress_thread_and_collective_bucket_free",
             "native_handlers_return_errors"]


@needs_mpi
@pytest.mark.parametrize("nprocs,local", [(2, "1"), (2, "2"), (3, "2,1,1")])
def test_ops_across_processes(nprocs, local):
    """The op cases on 2 x 1, 2 x 2 and 3 processes holding 2, 1 and 1 devices (uneven hosts: device g's process is
    no longer g // L). Gather and publish run on both paths: shared-memory windows (one node) and MPI_Get."""
    rc, out, _ = run_mpi(nprocs, "ops_cases.py", local, *OPS_CASES)
    check_cases(out, rc, OPS_CASES)



CP_GROUP_CASES = ["transport_is_mpi", "exchange_gives_the_one_device_loss_and_gradients",
                  "streamed_exchange_gives_the_one_device_loss_and_gradients", "group_barrier_timeout_names_missing_member"]


@needs_mpi
def test_context_parallel_group_exchange_across_processes():
    """OdcGroupExchange on 2 processes of 2 devices, two groups at once, each spanning both processes
    (tests/multiprocess/cp_group_cases.py): the one-device loss and gradients (K/V all-gathered and streamed), the
    groups changing between calls of one program; a group barrier whose member in the other process never comes fails naming it and its process."""
    rc, out, _ = run_mpi(2, "cp_group_cases.py", "2", *CP_GROUP_CASES, timeout=120)
    check_cases(out, rc, CP_GROUP_CASES)


@needs_mpi
def test_group_ops_on_the_mpi_transport():
    """tests/test_ops_group.py again, every heap on the MPI transport (one process: all ops through MPI windows)."""
    env = mpi_env()
    env["JODC_TEST_TRANSPORT"] = "mpi"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.join(HERE, "test_ops_group.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout

def _session_processes(sid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[3]) == sid:
                    out.append(int(entry))
        except (OSError, ValueError):
            pass
    return out


def test_the_ucx_one_sided_probe_is_left_out_only_without_rdma_devices(tmp_path):
    env = {}
    assert mpi_library.quiet_one_sided_components(env, str(tmp_path / "absent")) and env == {"OMPI_MCA_osc": "^ucx"}
    env = {}
    assert mpi_library.quiet_one_sided_components(env, str(tmp_path)) and env["OMPI_MCA_osc"] == "^ucx"  # empty folder
    (tmp_path / "mlx5_0").mkdir()
    env = {}
    assert not mpi_library.quiet_one_sided_components(env, str(tmp_path)) and env == {}  # an RDMA device: UCX's place
    env = {"OMPI_MCA_osc": "ucx"}
    assert not mpi_library.quiet_one_sided_components(env, str(tmp_path / "absent")) and env == {"OMPI_MCA_osc": "ucx"}


QUIET_WINDOW = """
import os
from jodc.ops.transports import mpi_library
comm = mpi_library.mpi4py_comm_world()  # as jodc starts MPI (jodc-train under mpirun: train/core/distributed.py)
from mpi4py import MPI
window = MPI.Win.Allocate(64, comm=comm)  # what the MPI transport's heap creates
window.Free()
print("WINDOW", comm.rank, os.environ.get("OMPI_MCA_osc"), flush=True)
"""


@needs_mpi
def test_a_healthy_mpirun_prints_no_error_lines_from_open_mpi(tmp_path):
    """`mpirun -np 2 jodc-train ...` on a host without RDMA devices: Open MPI's UCX one-sided component used to fail
    its query in every process and print an "Error" line before the shared-memory component was chosen anyway."""
    import os as _os

    env = {k: v for k, v in mpi_env().items() if k != "OMPI_MCA_osc"}  # as a user's shell has it
    rc, out = run_session(mpirun_command(2, sys.executable, "-c", QUIET_WINDOW), 120, env)
    assert rc == 0 and out.count("WINDOW") == 2, out[-3000:]
    if not (_os.path.isdir(mpi_library.RDMA_DEVICES) and _os.listdir(mpi_library.RDMA_DEVICES)):
        assert "Error" not in out and "osc_ucx" not in out, out[-3000:]


def test_kill_session_without_mpi_and_the_job_command_line():
    """kill_session ends a session's leader and a child in a process group of its own (as mpirun's workers are);
    mpirun_command / mpi_env give the CPU job's command line and environment."""
    child = "import subprocess, time; subprocess.Popen(['sleep', '60'], process_group=0); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(_session_processes(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_session_processes(proc.pid)) == 2, "the child never started"
    finally:
        kill_session(proc.pid)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _session_processes(proc.pid)
    assert mpirun_command(3, "x")[:3] == [MPIRUN, "-np", "3"] and mpirun_command(3, "x")[-1] == "x"
    env = mpi_env({"XLA_FLAGS": "--a", "KEEP": "1"}, EXTRA="2")
    assert "XLA_FLAGS" not in env and env["KEEP"] == "1" and env["EXTRA"] == "2" and env["JAX_PLATFORMS"] == "cpu"


@needs_mpi
def test_timeout_kills_mpirun_and_its_workers():
    """mpirun puts every worker in a process group of its own: killing mpirun's group (what run_mpi did) left the
    workers running after a timeout. kill_session ends all of them."""
    cmd = mpirun_command(2, sys.executable, "-c", "import time; time.sleep(120)")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=mpi_env(),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_session_processes(proc.pid)) < 3 and time.monotonic() < deadline:  # mpirun + 2 workers
            time.sleep(0.2)
        assert len(_session_processes(proc.pid)) >= 3, "the workers never started"
        workers = [p for p in _session_processes(proc.pid) if p != proc.pid]
        assert all(os.getpgid(p) != proc.pid for p in workers)  # why killpg(mpirun) is not enough
    finally:
        kill_session(proc.pid)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILLed children are reaped by init
    assert not _session_processes(proc.pid)


@needs_mpi
def test_killed_process_fails_survivors_within_timeout():
    """A process SIGKILLed between two steps. With `--enable-recovery` the launcher lets the survivor run on: its
    barrier fails within the timeout (+5 s) naming the dead process's device and the survivor exits non-zero. With
    mpirun's default the launcher itself ends the whole job at once, non-zero."""
    timeout_s = 3.0
    _, out, _ = run_mpi(2, "kill_case.py", "1", str(timeout_s), timeout=180, mpirun_args=("--enable-recovery",))
    assert "killing myself mid-step" in out, out[-6000:]
    assert "unexpectedly succeeded" not in out, out[-6000:]
    lines = [x for x in out.splitlines() if x.startswith("[rank 0] step failed after")]
    assert lines, out[-6000:]
    assert "device(s) [1] never arrived (held by process(es) [1]" in lines[0], lines[0]
    assert float(lines[0].split("after ")[1].split(" s")[0]) <= timeout_s + 5, lines[0]
    rc, out, _ = run_mpi(2, "kill_case.py", "1", str(timeout_s), timeout=180)
    assert rc != 0, out[-6000:]
    assert "unexpectedly succeeded" not in out, out[-6000:]


@needs_mpi
def test_ops_suite_on_forced_mpi_transport_in_one_process():
    """tests/test_ops.py again, every heap on the MPI transport (one process: all ops through MPI windows). Two
    tests inspect the in-process library itself and are left out."""
    env = mpi_env()
    env["JODC_TEST_TRANSPORT"] = "mpi"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.join(HERE, "test_ops.py"),
           "--deselect", "tests/test_ops.py::test_heaps_are_released",
           "--deselect", "tests/test_ops.py::test_native_handlers_return_errors_instead_of_crashing"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_mpi_heap_without_backend_says_how_to_get_it(monkeypatch):
    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("d",))
    monkeypatch.setattr(mpi_library, "default_path", lambda: "/nonexistent/_ffi_mpi.so")
    monkeypatch.setenv("JODC_MPICXX", "/nonexistent/mpicxx")  # nor can it be built on first use
    from jodc import ops

    with pytest.raises(ImportError, match=r"no MPI C\+\+ compiler.*pip install 'jodc\[mpi\]'"):
        ops.SymmetricHeap(mesh, transport="mpi")
    with pytest.raises(ValueError, match="transport must be one of"):
        ops.SymmetricHeap(mesh, transport="rdma")
    with ops.SymmetricHeap(mesh) as heap:  # one process: the in-process transport, MPI never touched
        assert heap.transport == "local"


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("nprocs,local", [(2, 1), (2, 2)])
def test_odc_engine_across_processes(tmp_path, nprocs, local):
    """ODC engine over nprocs x local devices (uneven microbatch counts per device and process) equals the reference
    engine (1e-5) and, in deterministic mode, bit for bit the deterministic ODC engine of one process driving all
    nprocs x local devices."""
    rc, out, _ = run_mpi(nprocs, "engine_cases.py", str(local), str(tmp_path), timeout=480)
    assert rc == 0 and f"PASS engine world={nprocs * local}" in out, out[-6000:]
    from conftest import cpu_mesh

    assert_bits_of_one_process(tmp_path / "mp.npz", "engine_cases", cpu_mesh(nprocs * local))


def assert_bits_of_one_process(saved, cases_module: str, mesh) -> None:
    """The arrays a multi-process run saved (`saved`, .npz) equal, bit for bit, `cases_module`'s
    `single_process_run(mesh)` run here (no third interpreter start)."""
    import importlib

    import numpy as np

    cases = importlib.import_module(cases_module)  # tests/multiprocess (pyproject's pytest pythonpath)
    single = cases.single_process_run(mesh)
    mp = np.load(saved)
    assert sorted(mp.files) == sorted(single)
    for k in mp.files:
        assert mp[k].tobytes() == single[k].tobytes(), (k, float(np.abs(mp[k] - single[k]).max()))


@needs_mpi
@pytest.mark.slow
def test_hsdp_across_processes(tmp_path):
    """HSDP on 2 processes x 2 devices, both ways round: ODC with a replica group per process (in-process heaps, the
    cross-replica reduce over gloo) and with every group spread over both processes (MPI heaps), and collective FSDP
    with a group per process, each equal to the reference engine (1e-5); the deterministic ODC run equals, bit for
    bit, one process driving the same 2x2 mesh (the cross-replica sum is added in replica order). A device of one
    replica that fails before the minibatch barrier fails every process's step at once, with its cause."""
    cases = ["odc_replicas_across", "odc_shards_across", "collective_replicas_across", "odc_replica_fails"]
    rc, out, _ = run_mpi(2, "hsdp_cases.py", "2", str(tmp_path), *cases, timeout=480)
    check_cases(out, rc, cases)
    for rank in (0, 1):
        failed = [x for x in out.splitlines() if x.startswith(f"[rank {rank}] step failed after")]
        assert failed and "boom on the last process" in failed[0], out[-6000:]
    import jax

    from jodc.fsdp import sharding

    assert_bits_of_one_process(tmp_path / "hsdp_det.npz", "hsdp_cases", sharding.hsdp_mesh(jax.devices("cpu")[:4], 2))


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("nprocs,local", [(2, 1)])
def test_lockstep_engines_across_processes(nprocs, local):
    """The collective engine (and XLA-SPMD) over nprocs x local devices, XLA's collectives over gloo, with uneven
    per-device microbatch counts and length buckets: equal to the reference engine (1e-5); their state dict, gathered
    across processes, loads back into a fresh engine and gives the same next step."""
    cases = ["collective", "xla_spmd"]
    rc, out, _ = run_mpi(nprocs, "collective_cases.py", str(local), *cases, timeout=480)
    check_cases(out, rc, cases)


def test_mpi_build_is_skipped_without_a_compiler(monkeypatch):
    import build_mpi  # ffi/ (pyproject's pytest pythonpath)
    monkeypatch.setenv("JODC_MPICXX", "/nonexistent/mpicxx")
    assert build_mpi.find_mpicxx() is None
    with pytest.raises(RuntimeError, match=r"pip install 'jodc\[mpi\]'"):
        build_mpi.build("/tmp/never.so", "/nonexistent/include", mpicxx=None)
    cmd = build_mpi.mpicxx_command("mpicxx", "out.so", "/inc")
    assert all(s in cmd for s in build_mpi.sources()) and "-shared" in cmd and "-fPIC" in cmd


def test_importing_jodc_never_loads_libmpi():
    """The CPU extension does not link libmpi, and using single-process heaps does not load it."""
    code = ("import jax, numpy as np\n"
            "from jodc import ops\n"
            "mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('d',))\n"
            "with ops.SymmetricHeap(mesh) as h:\n"
            "    assert h.transport == 'local'\n"
            "maps = open('/proc/self/maps').read()\n"
            "assert 'libmpi' not in maps, [l for l in maps.splitlines() if 'libmpi' in l][:3]\n")
    env = {k: v for k, v in os.environ.items()}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _sft_args(out_dir, steps):
    return ["sft", "--preset", "tiny", "--max_length", "128", "--embedded_examples", "256", "--devices", "2",
            "--sequences_per_minibatch", "8", "--steps", str(steps), "--total_steps", "4", "--learning_rate", "1e-2",
            "--deterministic", "--no-progress", "--save_every", "2", "--timeline_every", "2", "--export_hf", "true",
            "--out_dir", str(out_dir)]


def _rank_pid(session: int, rank: int) -> int | None:
    """The PID of MPI rank `rank` in the mpirun job of session `session` (None until it has started)."""
    for pid in _session_processes(session):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return pid
    return None


def sigterm_rank_after_first_step(cmd: list[str], env: dict, run_dir, rank: int, timeout: float = 420
                                  ) -> tuple[int, str]:
    """Runs the mpirun training job `cmd` in a session of its own and sends SIGTERM to rank `rank` alone (as a
    scheduler's notice may reach one host first) once step 1's metrics are written; returns (exit status, output).
    The whole session is killed at `timeout` (the test then fails with the output so far)."""
    import signal
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline and not (
                metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.1)
        pid = _rank_pid(proc.pid, rank)
        assert proc.poll() is None and pid is not None, "".join(lines)[-6000:]
        os.kill(pid, signal.SIGTERM)
        proc.wait(max(1.0, deadline - time.monotonic()))
    except BaseException:
        kill_session(proc.pid)
        reader.join(10)
        pytest.fail(f"the job did not stop within {timeout} s of its start; output:\n{''.join(lines)[-6000:]}")
    reader.join(10)
    return proc.returncode, "".join(lines)


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_mpirun_sft_stopped_by_sigterm_to_one_rank_resumes_as_one_process(tmp_path, rank):
    """`mpirun -np 2 jodc-train sft` (2 processes x 1 device, ODC over the MPI transport) with no checkpoint due
    for 100 steps: a SIGTERM to one rank (either) after step 1 stops both at the same step, which both checkpoint
    (a collective save) before exiting with status 143. Resumed for one more step (rank 0's case), its exported
    parameters and losses equal bit for bit those of one process driving both devices uninterrupted (this one, as in the RL test:
    no third interpreter start); only process 0 prints and writes the run's files."""
    import re

    from jodc.train.core.checkpoint import CheckpointStore

    env = mpi_env()
    mp_dir = tmp_path / "mp"
    args = [*_sft_args(mp_dir, 40), "--save_every", "100", "--log_every", "1"]
    cmd = mpirun_command(2, sys.executable, "-m", "mpi4py", "-m", "jodc.train", *args)
    rc, out = sigterm_rank_after_first_step(cmd, env, mp_dir, rank)
    stops = re.findall(r"jodc-train: stopped by SIGTERM after step (\d+)", out)
    assert rc == 143 and len(stops) == 2 and len(set(stops)) == 1, out[-6000:]  # each process says it
    stopped_at = int(stops[0])
    assert 1 <= stopped_at < 40 and "done: " not in out, out[-6000:]  # the notice may land before step 1's vote
    store = CheckpointStore(str(mp_dir / "checkpoints"), keep=2)
    try:
        assert store.steps() == [stopped_at]
    finally:
        store.close()
    if rank == 1:  # the resume does not depend on which rank got the signal: rank 0's case compares it (CI time)
        return
    steps = stopped_at + 1
    cmd = mpirun_command(2, sys.executable, "-m", "mpi4py", "-m", "jodc.train", *_sft_args(mp_dir, steps))
    rc, out = run_session(cmd, 420, env)
    assert rc == 0 and f"(step {stopped_at})" in out and out.count("done: ") == 1, out[-6000:]
    from jodc.train.cli import main as train_main

    single_dir = tmp_path / "single"
    assert train_main(_sft_args(single_dir, steps)) == 0  # this process, 2 of its CPU devices
    assert_same_export(mp_dir, single_dir)
    assert run_losses(mp_dir) == run_losses(single_dir) and len(run_losses(mp_dir)) == steps


def assert_same_export(a, b):
    """The HF exports of run directories `a` and `b` hold the same safetensors files, byte for byte."""
    files = sorted(p.name for p in (a / "hf").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (b / "hf").glob("*.safetensors"))
    for name in files:
        assert (a / "hf" / name).read_bytes() == (b / "hf" / name).read_bytes(), name


def run_losses(run_dir) -> list[float]:
    """The logged losses of run directory `run_dir`, in step order."""
    import json

    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@needs_mpi
@pytest.mark.slow
def test_mpirun_resumes_a_checkpoint_of_another_layout(tmp_path):
    """A checkpoint written by one process on 4 devices as HSDP (2 replica groups x 2 shards) resumes under `mpirun
    -np 2` on 2 devices (flat, one per process; each process reads only its own byte ranges) exactly as it resumes in
    one process on 2 devices: the same losses and the same exported bytes. The run under mpirun saves its own
    checkpoint too (each process writing its shards), which one process then resumes on 4 devices."""
    import shutil

    from jodc.train.cli import main as train_main

    env = mpi_env()
    single, mp = tmp_path / "single", tmp_path / "mp"
    assert train_main([*_sft_args(single, 2)[:-2], "--devices", "4", "--replicas", "2", "--out_dir",
                       str(single)]) == 0
    shutil.copytree(single, mp)
    assert train_main(_sft_args(single, 4)) == 0
    cmd = mpirun_command(2, sys.executable, "-m", "mpi4py", "-m", "jodc.train", *_sft_args(mp, 4))
    rc, out = run_session(cmd, 420, env)
    assert rc == 0 and "resumed from" in out and "(step 2)" in out, out[-6000:]
    assert_same_export(mp, single)
    assert run_losses(mp) == run_losses(single) and len(run_losses(mp)) == 4
    # the checkpoint the two processes wrote at step 4 resumes in one process on 4 devices
    assert train_main([*_sft_args(mp, 5)[:-2], "--devices", "4", "--total_steps", "5", "--out_dir", str(mp)]) == 0
    assert len(run_losses(mp)) == 5


def test_launch_detection_and_device_split():
    from jodc.train.core import distributed

    assert distributed.launched_processes({}) == 1
    assert distributed.launched_processes({"OMPI_COMM_WORLD_SIZE": "4"}) == 4
    assert distributed.launched_processes({"PMI_SIZE": "2"}) == 2
    assert distributed.local_device_count(4, 2) == 2
    with pytest.raises(ValueError, match="does not split over 3 processes"):
        distributed.local_device_count(4, 3)


def test_cli_refuses_uneven_device_split(monkeypatch, capsys):
    from jodc.train import cli

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    assert cli.main(["sft", "--preset", "tiny", "--devices", "4", "--steps", "1"]) == 2
    assert "does not split over 3 processes" in capsys.readouterr().err


def test_rl_refuses_an_uneven_device_split(monkeypatch, capsys):
    from jodc.train import cli

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    assert cli.main(["rl", "--preset", "tiny", "--devices", "2", "--steps", "1"]) == 2
    assert "does not split over 3 processes" in capsys.readouterr().err


def _rl_args(out_dir, steps, reward="varied", max_staleness=0, eval_every=0):
    """A tiny RL run: random-init tiny model (no warm start), 4 prompts x 4 responses, 2 updates per step, a KL
    penalty (reference policy), deterministic ODC on 2 devices, a checkpoint after every step; no evaluation unless
    `eval_every` (4 held-out problems: its samplers are much of a run's compile time on this machine).
    The reward (tests/multiprocess/rl_reward.py) varies within groups, so the advantages are not all zero."""
    return ["rl", "--preset", "tiny", "--attention_block_size", "16", "--token_cap", "64", "--prompt_bucket", "8",
            "--max_new_tokens", "4", "--max_digits", "1", "--max_terms", "2", "--pool_size", "8",
            "--prompts_per_step", "4", "--group_size", "4", "--updates_per_step", "2", "--learning_rate", "1e-2",
            "--kl_coef", "0.1", "--steps", str(steps), "--total_steps", "4", "--devices", "2", "--deterministic",
            "--no-progress", "--save_every", "1", "--eval_every", str(eval_every), "--eval_problems", "4",
            "--export_hf", "true",
            "--reward_fn", os.path.join(WORKERS, f"rl_reward.py:{reward}"), "--out_dir", str(out_dir),
            "--max_staleness", str(max_staleness)]


def _mpirun_train(args, timeout=300, **env):
    cmd = [MPIRUN, "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "mpi4py", "-m",
           "jodc.train", *args]
    return run_session(cmd, timeout, mpi_env(**env))


@needs_mpi
@pytest.mark.slow
def test_mpirun_rl_with_context_parallel_groups_across_processes_equals_single_process(tmp_path):
    """`mpirun -np 2 jodc-train rl` with `engine.context_parallel` and a token cap (8) below a prompt + response
    (up to 16 tokens), one device per process: every long response is split over a group of both devices, so each
    group spans both processes (its K/V streamed through the group ops over MPI, the response sent to both
    processes by the assembly). Two steps' metrics (losses, gradient norms, rewards, split sequences) and the
    exported parameters equal bit for bit those of one process driving both devices (deterministic ODC)."""
    import json

    from jodc.train.cli import main as train_main

    def args(out_dir):
        return ["rl", "--preset", "tiny", "--attention_block_size", "8", "--token_cap", "8", "--prompt_bucket", "8",
                "--max_new_tokens", "8", "--max_digits", "1", "--max_terms", "2", "--pool_size", "8",
                "--prompts_per_step", "4", "--group_size", "2", "--updates_per_step", "1", "--learning_rate", "3e-4",
                "--entropy_coeff", "0.1", "--steps", "2", "--devices", "2", "--deterministic", "--no-progress",
                "--eval_every", "0", "--export_hf", "true", "--context_parallel", "true",
                "--reward_fn", os.path.join(WORKERS, "rl_reward.py:varied"), "--out_dir", str(out_dir)]

    mp_dir, single_dir = tmp_path / "mp", tmp_path / "single"
    rc, out = _mpirun_train(args(mp_dir))
    assert rc == 0 and out.count("done: ") == 1, out[-6000:]
    assert train_main(args(single_dir)) == 0

    def records(d):
        return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]

    mp, single = records(mp_dir), records(single_dir)
    assert [r["step"] for r in mp] == [r["step"] for r in single] == [1, 2]
    assert all(r["cp_sequences"] > 0 for r in mp), [r.get("cp_sequences") for r in mp]  # responses were split
    for key in ("reward_mean", "reward_std", "loss", "grad_norm", "tokens", "microbatches", "cp_sequences"):
        assert [r.get(key) for r in mp] == [r.get(key) for r in single], key
    mp_files = sorted(p.name for p in (mp_dir / "hf").glob("*.safetensors"))
    assert mp_files and mp_files == sorted(p.name for p in (single_dir / "hf").glob("*.safetensors"))
    for name in mp_files:
        assert (mp_dir / "hf" / name).read_bytes() == (single_dir / "hf" / name).read_bytes(), name


@needs_mpi
@pytest.mark.slow
def test_mpirun_rl_stop_resume_equals_single_process(tmp_path):
    """`mpirun -np 2 jodc-train rl` (2 processes x 1 device, ODC over the MPI transport, deterministic) with
    asynchronous rollouts (`rollout.max_staleness: 1`, each process's sampler thread sampling its share of the next
    step's rollout while the trainer trains; in the first launch through a sampler child process, after the resume
    itself): stopped by a SIGTERM to rank 1 after step 1 (both ranks finish and checkpoint the same step, with the
    rollout sampled ahead, and exit 143) and resumed for one more step, its metrics (rewards, losses, KL, staleness,
    the held-out evaluation before each step) and exported parameters equal bit for bit those of one process driving
    both devices uninterrupted. The evaluation is split as the rollouts are: each process samples and scores its
    half of the problems and the rewards are exchanged. Each process samples and scores its half of each rollout on
    its device (the single process samples the same halves on its two devices: the same keys and batch shapes) and
    the halves are exchanged; the reward function is called once per response over both processes; deterministic
    ODC reduces gradients in source order, so no tolerance is needed. Only process 0 prints and writes the run's
    files. (The synchronous loop runs the same sampler and exchange on the trainer's thread:
    test_rl_rollout_shares_across_processes.)"""
    import json
    import re

    from jodc.train.cli import main as train_main
    from jodc.train.rl.loop import EVAL_SAMPLES

    max_staleness = 1

    mp_dir, calls = tmp_path / "mp", tmp_path / "calls"
    calls.mkdir()
    # the first launch runs until a SIGTERM to rank 1 after step 1 (both ranks checkpoint the agreed step and exit
    # 143); the sampler computes in a child process there and on the sampler thread after the resume
    env = mpi_env(JODC_TEST_REWARD_CALLS=str(calls))
    first = [*_rl_args(mp_dir, 40, reward="counted", max_staleness=max_staleness, eval_every=1),
             "--rollout.sampler", "process", "--log_every", "1"]
    cmd = [MPIRUN, "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "mpi4py", "-m",
           "jodc.train", *first]
    rc, out = sigterm_rank_after_first_step(cmd, env, mp_dir, rank=1)
    stops = re.findall(r"jodc-train rl: stopped by SIGTERM after step (\d+)", out)
    assert rc == 143 and len(stops) == 2 and len(set(stops)) == 1 and "done: " not in out, out[-6000:]
    steps = int(stops[0]) + 1
    rc, out = _mpirun_train([*_rl_args(mp_dir, steps, reward="counted", max_staleness=max_staleness, eval_every=1),
                             "--rollout.sampler", "thread"], JODC_TEST_REWARD_CALLS=str(calls))
    assert rc == 0, out[-6000:]
    assert out.count("done: ") == 1, out[-3000:]  # one process prints
    assert "resumed from" in out and f"(step {steps - 1})" in out, out[-3000:]
    # each process sampled and scored its half (8) of each rollout's 4 x 4 responses, each response once: steps 1
    # to `steps`, and asynchronously the rollout sampled ahead for the final checkpoint; and its half (2) of the 4
    # evaluation problems, greedy once and sampled EVAL_SAMPLES times, in each evaluation (before every step and at
    # the end: a run stopped by SIGTERM skips its final evaluation)
    sampled = [len((calls / f"calls-{rank}.txt").read_text().splitlines()) for rank in (0, 1)]
    assert sampled == [8 * (steps + max_staleness) + (steps + 1) * 2 * (1 + EVAL_SAMPLES)] * 2, sampled
    single_dir = tmp_path / "single"
    assert train_main(_rl_args(single_dir, steps, max_staleness=max_staleness, eval_every=1)) == 0  # 2 CPU devices

    def records(d):
        return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]

    exact = ("reward_mean", "reward_std", "accuracy", "response_length", "loss", "grad_norm", "policy_kl", "tokens",
             "microbatches", "staleness", "policy_version", "eval_accuracy", "eval_sampled_reward")
    mp, single = records(mp_dir), records(single_dir)
    assert all("eval_sampled_reward" in r for r in mp), mp
    assert [r["step"] for r in mp] == [r["step"] for r in single] == list(range(1, steps + 1))
    assert len({r["reward_mean"] for r in single}) > 1 or single[0]["reward_std"] > 0  # the rewards vary
    for key in exact:
        assert [r.get(key) for r in mp] == [r.get(key) for r in single], key
    mp_files = sorted(p.name for p in (mp_dir / "hf").glob("*.safetensors"))
    assert mp_files and mp_files == sorted(p.name for p in (single_dir / "hf").glob("*.safetensors"))
    for name in mp_files:
        assert (mp_dir / "hf" / name).read_bytes() == (single_dir / "hf" / name).read_bytes(), name


@needs_mpi
def test_rl_rollout_shares_across_processes(tmp_path):
    """2 processes x 2 devices sample step 3's rollout in shares (tests/multiprocess/rl_sampling_case.py): each
    process keeps its share and gets every response's metadata; the whole rollout gathered from the shares equals
    (prompts, groups, tokens, behaviour top-k, rewards) one process sampling it over 1 and 4 devices here; each
    response is scored once, by the process that sampled it. The step's minibatches assembled without replication
    equal the replicated assembly's on every process's own devices' rows, bit for bit, with the reference and
    recompute passes run over the process's own share only (rows counted) and only the sequences the plans put on
    its devices received. A reward that raises
    in process 1 fails both processes naming process 1 and its cause; the agreement check the trainer runs before
    each step's first update fails in both processes on a value process 1 computed otherwise; a process 1 that hangs
    is named by process 0 within the exchange timeout (3 s), which ends the job. (A reward that differs between
    processes no longer makes them disagree: each response is scored once and its reward exchanged.)"""
    import json

    import numpy as np

    from rl_sampling_setup import GROUP, PROMPTS, CountingReward, make_params, make_sampler

    rc, out, _ = run_mpi(2, "rl_sampling_case.py", "2", str(tmp_path), timeout=240)
    world, placed = 4, []
    for rank in (0, 1):
        assert f"PASS sampled process={rank} world={world} responses={PROMPTS * GROUP} own={PROMPTS * GROUP // 2}" \
            in out, out[-6000:]
        # the reference and recompute passes ran over the process's own 6 responses only; it received exactly the
        # sequences the plans put on its devices that the other process sampled (`assemble` checks the sets)
        assembled = [line for line in out.splitlines() if line.startswith(f"PASS assembled process={rank} ")]
        assert assembled and assembled[0].endswith(f"forward_rows={PROMPTS * GROUP // 2}+{PROMPTS * GROUP // 2}"), \
            out[-6000:]
        placed.append(dict(f.split("=") for f in assembled[0].split()[2:]))
    # every response is trained on exactly one process; a process receives at most what it trains
    assert sum(int(f["placed"]) for f in placed) == PROMPTS * GROUP, placed
    assert all(int(f["received"]) <= int(f["placed"]) for f in placed), placed
    for rank in (0, 1):
        assert f"RAISED {rank}: step 5's rollout failed in process(es) [1]" in out, out[-6000:]
    assert "process 1: RewardError: the reward function raised KeyError on step 5" in out, out[-6000:]
    for rank in (0, 1):
        assert f"DISAGREE {rank}: the processes disagree on a value that differs: process(es) [1]" in out, out[-6000:]
    timed_out = [line for line in out.splitlines() if line.startswith("TIMED OUT 0 after")]
    assert timed_out and "step 6's rollout: process(es) [1] sent nothing within 3 s" in timed_out[0], out[-6000:]
    assert float(timed_out[0].split()[4]) < 30 and rc != 0  # not the hanging reward's 120 s; the job aborted
    mp = json.loads((tmp_path / "mp.json").read_text())
    calls = [json.loads((tmp_path / f"calls-{rank}.json").read_text()) for rank in (0, 1)]
    assert [len(c) for c in calls] == [PROMPTS * GROUP // 2] * 2  # each process scored its half, once each
    params = make_params()
    for devices in (1, 4):
        reward = CountingReward()
        here = make_sampler(devices, reward).share(3, params, 3)  # one process: the whole rollout
        r = here.rollout
        assert mp["prompts"] == r.prompts and mp["response_ids"] == [x.tolist() for x in r.response_ids], devices
        assert mp["topk_ids"] == [x.tolist() for x in r.topk_ids] and mp["rewards"] == here.rewards.tolist()
        for a, b in zip(mp["logprobs"], r.logprobs):
            np.testing.assert_allclose(a, b, atol=1e-5)
        assert sorted(map(tuple, calls[0] + calls[1])) == sorted(reward.calls)  # the same (prompt, response) pairs


def test_spmd_step_gathers_parameters_and_keeps_rows_per_device():
    """The XLA-SPMD engine's compiled step on 2 devices (one process: the partitioning does not depend on how the
    devices are spread over processes). Its only collectives are the all-gathers of whole parameter vectors (1-D)
    and the all-reduces of gradients, loss and metrics. Before, the partitioner sliced the sharded flat vectors in
    place (collective-permutes) and all-gathered rows and activations inside blockwise attention's loop over
    (row, block) pairs: hundreds of collectives per step, each a gloo round trip across processes (35 s per step of
    bench/multiprocess.py --quick)."""
    import re

    import jax
    import numpy as np

    from conftest import cpu_mesh
    from jodc.balance import get_planner
    from jodc.fsdp import OptimizerConfig, XlaSpmdEngine, sharding
    from jodc.fsdp.batch import minibatch_from_plan
    from jodc.train.core.staged_decoder import decoder_staged_model
    from jodc.models import DecoderConfig

    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                           num_kv_heads=1, attention_block_size=16, max_position_embeddings=64)
    model, groups = decoder_staged_model(config, seed=0)
    mesh = cpu_mesh(2)
    engine = XlaSpmdEngine(model, groups, mesh, optimizer=OptimizerConfig(learning_rate=1e-3), length_buckets=(32,))
    rng = np.random.default_rng(0)
    lengths = np.array([60, 20, 40, 12])
    seqs = [rng.integers(0, 64, int(n) + 1) for n in lengths]
    batch = minibatch_from_plan(get_planner("lb_micro")(lengths, 2, 64), [s[:-1] for s in seqs],
                                [s[1:] for s in seqs], [np.ones(int(n), np.float32) for n in lengths])
    engine.step(batch)  # compiles and caches the step for these lengths
    (step,) = engine._compiled.values()  # the jitted step of these lengths
    m = int(batch.counts.max())
    arrays = jax.device_put({k: np.ascontiguousarray(np.swapaxes(np.asarray(v)[:, :m], 0, 1))
                             for k, v in batch.as_dict().items()}, engine.batch_sharding)
    rounds = engine.bucket_indices(batch)[:, :m].max(axis=0)
    text = step.lower(engine.flats, engine.opt_state, arrays, sharding.put_replicated(mesh, rounds),
                      sharding.put_replicated(mesh, np.float32(batch.normalizer))).compile().as_text()
    kinds = re.findall(r" (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", text)
    assert "collective-permute" not in kinds and "all-to-all" not in kinds, sorted(set(kinds))
    gathered = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
    assert gathered and all(re.fullmatch(r"f32\[\d+\]\{0\}", s) for s in gathered), gathered


def test_spmd_step_compiles_once_per_shape():
    """The XLA-SPMD engine compiles one executable per minibatch shape, also after a state dict is loaded. Before,
    the state the first step returned had other shardings than the initial one, so every shape compiled a second time
    on its next step (in bench/multiprocess.py, inside the timed pass)."""
    import numpy as np

    from conftest import cpu_mesh
    from jodc.balance import get_planner
    from jodc.fsdp import OptimizerConfig, XlaSpmdEngine
    from jodc.fsdp.batch import minibatch_from_plan
    from jodc.train.core.staged_decoder import decoder_staged_model
    from jodc.models import DecoderConfig

    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                           num_kv_heads=1, attention_block_size=16, max_position_embeddings=64)
    model, groups = decoder_staged_model(config, seed=0)
    engine = XlaSpmdEngine(model, groups, cpu_mesh(2), optimizer=OptimizerConfig(learning_rate=1e-3),
                        length_buckets=(32,))
    rng = np.random.default_rng(0)

    def batch(lengths):
        seqs = [rng.integers(0, 64, int(n) + 1) for n in lengths]
        return minibatch_from_plan(get_planner("lb_micro")(np.array(lengths), 2, 64), [s[:-1] for s in seqs],
                                   [s[1:] for s in seqs], [np.ones(int(n), np.float32) for n in lengths])

    batches = [batch([60, 20]), batch([60, 20, 40, 12, 30, 50])]
    assert len({b.counts.max() for b in batches}) == 2  # two shapes
    for _ in range(2):
        for b in batches:
            engine.step(b)
    (step,) = engine._compiled.values()
    assert step._cache_size() == 2
    engine.load_state_dict(engine.state_dict())
    for b in batches:
        engine.step(b)
    assert step._cache_size() == 2


def test_digest_and_agreement_in_one_process():
    """`distributed.digest` tells arrays apart by bytes, dtype and shape; `check_agreement` and `barrier` are no-ops
    in one process (the multi-process paths: test_mpirun_rl_*)."""
    import numpy as np

    from jodc.train.core import distributed

    a = np.arange(6, dtype=np.int32)
    d = distributed.digest([a])
    assert d.dtype == np.uint32 and d.shape == (4,)
    assert np.array_equal(d, distributed.digest([a.copy()]))
    for other in ([a.reshape(2, 3)], [a.astype(np.int64)], [a[::-1]], [a[:3], a[3:]]):
        assert not np.array_equal(d, distributed.digest(other))
    distributed.check_agreement("nothing", lambda: d)
    distributed.barrier("nothing")
