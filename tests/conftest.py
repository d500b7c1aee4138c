"""Test setup: eight simulated host devices, forced before JAX is imported anywhere. (tools/, ffi/ and the repository
root are on the import path by pyproject.toml's [tool.pytest.ini_options] pythonpath.)"""
import contextlib
import os
import signal

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (CI must not pass or fail by luck); the examples still
# come from hypothesis' search, and a failure found once stays in its database for local runs.
settings.register_profile("jodc", derandomize=True)
settings.load_profile("jodc")

jax.config.update("jax_enable_x64", False)

# One persistent XLA compilation cache for this test session (a fresh directory, removed at exit): a program
# compiled once (an engine's step built again by the next test, a resumed or repeated run's step) is loaded, not
# compiled again. It holds only what this session compiled, so a run never reuses programs of another checkout or
# version. The environment hands it to every subprocess the tests start (trainer CLIs, mpirun workers, sampler
# processes), so a resumed launch loads what the first one compiled; under pytest-xdist (`make test`'s two workers)
# the controller makes it and both workers inherit it the same way, sharing it. Two processes may write one entry at
# once (the workers of one mpirun compile the same programs): a reader that meets a half-written entry gets a
# decompression error, which JAX turns into a warning and a compilation. Compile-counting tests count its hits as
# compilations too. JODC_TEST_COMPILATION_CACHE=0 turns it off.
if os.environ.get("JODC_TEST_COMPILATION_CACHE", "1") != "0" and not jax.config.jax_compilation_cache_dir:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="jodc-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


# The heaviest test files, heaviest first (summed test durations of a whole suite on 2 cores, 2026-11: from
# test_fsdp_engines ~510 s and test_multiprocess ~420 s down to ~45 s; the other files take less). `make test` runs
# the files on two pytest-xdist workers, whole files at a time, in collection order as the workers free up
# (`--dist loadfile --no-loadscope-reorder`: xdist's own reordering sorts files by their number of tests, which put
# files of a few long tests, such as test_rl_async's, last and left one worker idle while the other finished them).
# Longest first leaves the short files to even out the end. A file missing here only runs later; keep the list
# roughly in order when a file grows.
HEAVIEST_FIRST = (
    "test_fsdp_engines.py", "test_multiprocess.py", "test_train_sft.py", "test_rl_async.py", "test_rl_dp_sampling.py",
    "test_train_reliability.py", "test_rl.py", "test_fsdp_decoder.py", "test_bench_memory.py", "test_stream.py",
    "test_rl_policy_weights.py", "test_fsdp_hsdp.py", "test_gpu_check.py", "test_checkpoint_layouts.py",
    "test_models.py", "test_rl_sampler_process.py", "test_train_sft_context_parallel.py", "test_bench_long_context.py",
    "test_fsdp_context_parallel.py", "test_fsdp_flax.py", "test_losses_offpolicy.py", "test_bench_real_size_run.py",
    "test_models_flash_attention.py", "test_generate.py", "test_models_attention.py", "test_rl_objective_terms.py",
    "test_fsdp_nonfinite.py", "test_rl_rollout.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Puts the HEAVIEST_FIRST files first, in that order (a stable sort: every file's tests keep their order, the
    other files theirs)."""
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _sigint_handler_is_left_as_found():
    """Fails (at teardown) a test after which Python's SIGINT handler differs from before it, and puts the old one
    back: a test or a library it loads that takes Ctrl-C over would silently change what later tests see (Ctrl-C
    tests then pass alone and fail in the suite)."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)
        pytest.fail(f"the test left Python's SIGINT handler changed: {before!r} -> {after!r}; restore it (the "
                    "previous handler is what signal.signal returns)", pytrace=False)


@pytest.fixture
def python_sigint_handler():
    """Python's own Ctrl-C handler (KeyboardInterrupt) for the test, even when pytest started with SIGINT ignored
    (`nohup make test &`: Python then installs none), put back after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def shardy_off_on_jaxlib_0_11():
    """On jaxlib 0.11 the module's programs with the group ops compile with Shardy off (that jaxlib segfaults on them
    otherwise: `jodc.ops.group.members.check_compiler`, docs/context_parallel.md); the setting is put back after."""
    import jax

    if jax.__version_info__[:2] != (0, 11):
        yield
        return
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)


@pytest.fixture(scope="session")
def hf_reference():
    """torch and transformers (the `hf-reference` extra), as `.torch` and `.transformers`: the reference that the HF
    parity tests compare against. The tests that take this fixture skip where they are not installed: the Python 3.12
    suite (`make test-py312`) has no torch, whose PyPI build for 3.12 is a multi-GB CUDA one."""
    import types

    why = "needs torch and transformers (pip install -e '.[hf-reference]')"
    torch = pytest.importorskip("torch", reason=why)
    transformers = pytest.importorskip("transformers", reason=why)
    return types.SimpleNamespace(torch=torch, transformers=transformers)


@pytest.fixture(scope="session")
def cpu_devices():
    """The eight simulated CPU devices (on GPU runners the CPU backend still has them)."""
    devices = jax.devices("cpu")
    assert len(devices) == 8, f"expected 8 simulated CPU devices, got {len(devices)}"
    return devices


@contextlib.contextmanager
def compilations():
    """Yields a list that collects, while the block runs, every XLA backend compilation and every program loaded
    from the suite's persistent compilation cache (either is a compilation a warm call should not need)."""
    seen: list[str] = []

    def compiled(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    def cache_hit(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(compiled)
    jax.monitoring.register_event_listener(cache_hit)
    try:
        yield seen
    finally:  # the listeners would otherwise run on every later compilation of the suite
        jax.monitoring.unregister_event_duration_listener(compiled)
        jax.monitoring.unregister_event_listener(cache_hit)


def cpu_mesh(n: int, axis: str = "d"):
    """A 1-D mesh over the first n simulated CPU devices."""
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:n]), (axis,))


def spmd(mesh, fn, *per_device_args):
    """Runs fn(device_args...) under jit + shard_map over axis 'd'; each arg/result has a leading device axis (the
    ops tests' harness, CPU and GPU alike)."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n = mesh.shape["d"]

    def body(*args):
        out = fn(*[a[0] for a in args])
        return jax.tree.map(lambda o: o[None], out)

    args = per_device_args or (jnp.zeros((n,)),)
    if not per_device_args:
        inner = fn
        fn = lambda _: inner()  # noqa: E731
    sm = jax.shard_map(body, mesh=mesh, in_specs=tuple(P("d") for _ in args), out_specs=P("d"))
    return jax.block_until_ready(jax.jit(sm)(*args))


# JODC_TEST_TRANSPORT=mpi reruns a test module with every heap forced onto the MPI transport (one process: all ops
# go through MPI windows); tests/test_multiprocess.py does this for tests/test_ops.py in a subprocess.
if os.environ.get("JODC_TEST_TRANSPORT"):
    import functools

    from jodc.ops import heap as _heap_module

    _orig_init = _heap_module.SymmetricHeap.__init__

    @functools.wraps(_orig_init)
    def _init_with_transport(self, *args, **kwargs):
        kwargs.setdefault("transport", os.environ["JODC_TEST_TRANSPORT"])
        _orig_init(self, *args, **kwargs)

    _heap_module.SymmetricHeap.__init__ = _init_with_transport
