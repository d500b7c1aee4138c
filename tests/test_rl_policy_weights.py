"""The RL sampler's weights made on the devices (train/rl/policy_weights.py): the device reshard equals the host
path's weights bit for bit for every engine and the sampler dtypes (fp32, bf16), casting before it gathers (the
compiled program all-gathers bf16 only); `generate` samples with a copy already on its device without moving it;
and RL runs (synchronous and asynchronous, fp32 and bf16 samplers, a KL reference, recomputed log-probs, a
critic's values) sample every rollout and compute every forward pass exactly as from host fp32 weights of the same
versions (today's path, recomputed here from the engine's gathered parameters of each version), with no host copy
of the policy made during a step or an evaluation."""
import os

import jax
import numpy as np
import pytest

from jodc.fsdp import Engine
from jodc.fsdp import state as fsdp_state
from jodc.models import SamplingParams, generate
from jodc.train.core.model import make_engine
from jodc.train.rl import loop as rl_loop
from jodc.train.rl.config import load_rl_config
from jodc.train.rl.loop import RLRun, run_rl
from jodc.train.rl.policy_weights import DeviceWeights, PolicyWeights, policy_on_device, sampler_weights_on_devices
from jodc.train.rl.reference import ReferencePolicy
from jodc.train.rl.sampler import RolloutSampler, sampler_weights

from test_rl_async import async_overrides, reward_file  # noqa: F401 (the fixture)


def quiet(_message):
    pass


def leaves_equal(a, b) -> bool:
    xs, ys = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(xs) == len(ys) and all(np.asarray(x).dtype == np.asarray(y).dtype
                                      and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(xs, ys))


# -- the reshard ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engines():
    """(model config, {(engine, replicas): engine}) of the tiny decoder (random init) on 4 devices: every engine
    on a flat mesh, ODC and XLA-SPMD on an HSDP mesh of 2 x 2."""
    import dataclasses

    from jodc.models.tokenizer import load_tokenizer
    from jodc.train.core.model import build_decoder
    from jodc.train.core.staged_decoder import decoder_staged_model

    cfg = load_rl_config(None, ["--preset", "tiny", "--devices", "4"])
    config, groups = build_decoder(cfg.model, load_tokenizer(None), max_length=64, compute_dtype="float32", seed=0)
    model, groups = decoder_staged_model(config, groups, seed=0)
    engines = {}
    for name, replicas in (("odc", 1), ("collective", 1), ("xla_spmd", 1), ("reference", 1), ("odc", 2),
                           ("xla_spmd", 2)):
        engine_section = dataclasses.replace(cfg.engine, name=name, replicas=replicas,
                                             deterministic=name == "odc")
        engines[(name, replicas)] = make_engine(dataclasses.replace(cfg, engine=engine_section), model, groups)
    yield config, engines
    for engine in engines.values():
        engine.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_device_reshard_is_the_host_paths_weights_on_each_device(tiny_engines, dtype):
    config, engines = tiny_engines
    devices = jax.devices("cpu")[:4]
    for key, engine in engines.items():
        host = engine.params()  # today's path: gathered to the host, cast there
        _, expected = sampler_weights(config, host, dtype)
        weights = sampler_weights_on_devices(engine, engine.model.layouts, None, devices, dtype)
        assert isinstance(weights, DeviceWeights) and weights.devices == devices
        for device in devices:
            copy = weights.on(device)
            assert all(leaf.sharding.device_set == {device} for leaf in jax.tree.leaves(copy)), key
            assert leaves_equal(copy, expected), (key, device)
        for device in devices[:2]:  # the trainer's fp32 copy
            fp32 = policy_on_device(engine, device)
            assert all(leaf.sharding.device_set == {device} for leaf in jax.tree.leaves(fp32)), key
            assert leaves_equal(fp32, host), (key, device)


def test_the_bf16_reshard_casts_the_shards_then_gathers_bf16():
    """The compiled reshard of an fp32 vector sharded over 4 devices into a bf16 replicated copy all-gathers 16-bit
    values only: no fp32 whole vector is ever made on a device."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jodc.fsdp.stages import GroupLayout
    from jodc.train.rl import policy_weights as pw

    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("d",))
    flat = jax.device_put(np.arange(64, dtype=np.float32), NamedSharding(mesh, P("d")))
    layout = GroupLayout.of({"w": np.zeros((6, 10), np.float32)})
    program = pw._gather_program(("g",), (layout,), "bfloat16", (flat.sharding,), (flat.shape,))
    hlo = program.lower((flat,)).compile().as_text()
    gathers = [line.split("=", 1)[1] for line in hlo.splitlines() if " all-gather(" in line]
    assert gathers and all(g.split("all-gather")[0].strip().startswith("u32[32]") for g in gathers), gathers
    # (bf16 pairs moved as 32-bit words: XLA's CPU backend widens a 16-bit all-gather to fp32)


def test_generate_samples_with_the_copy_on_its_device_without_moving_it(tiny_engines):
    config, engines = tiny_engines
    engine = engines[("odc", 1)]
    devices = jax.devices("cpu")[:2]
    weights = sampler_weights_on_devices(engine, engine.model.layouts, None, devices, "float32")
    sampling = SamplingParams(max_new_tokens=3, temperature=1.0, prompt_bucket=8)
    prompts = [[1, 5, 7], [1, 9]]
    # one key per row, on the host: the guard below watches device-to-device moves only
    key = np.asarray(jax.random.split(jax.random.PRNGKey(0), len(prompts)))
    expected = jax.device_get(generate(config, prompts, key=key, sampling=sampling, params=engine.params(),
                                       device=devices[1]))
    with jax.transfer_guard_device_to_device("disallow_explicit"):
        out = jax.device_get(generate(config, prompts, key=key, sampling=sampling, params=weights.on(devices[1]),
                                      device=devices[1]))
        with pytest.raises(Exception, match="[Dd]isallowed"):  # the guard does watch params on another device
            generate(config, prompts, key=key, sampling=sampling, params=weights.on(devices[0]), device=devices[1])
    assert leaves_equal(out, expected)


# -- RL runs against today's host path ------------------------------------------------------------------------------
def run_recording(monkeypatch, args):
    """Runs RL with `args` (CLI overrides), recording the engine's host parameters at the start of every step
    (test-only: today's path), every rollout share the sampler made (and from what), and every step's forward
    passes; returns (the run, {step: host params}, shares, passes)."""
    params_at, shares, passes, runs = {}, [], [], []
    train_step, share, forward_passes = RLRun.train_step, RolloutSampler.share, RLRun.forward_passes

    def recording_step(self, step):
        runs[:1] = [self]
        params_at[step] = self.engine.params()
        return train_step(self, step)

    def recording_share(self, step, params, version):
        out = share(self, step, params, version)
        shares.append((self, step, version, type(params), out))
        return out

    def recording_passes(self, rollout, params, scored, step, *, first, width):
        out = forward_passes(self, rollout, params, scored, step, first=first, width=width)
        passes.append((step, rollout, type(params), scored, first, width, out))
        return out

    monkeypatch.setattr(RLRun, "train_step", recording_step)
    monkeypatch.setattr(RolloutSampler, "share", recording_share)
    monkeypatch.setattr(RLRun, "forward_passes", recording_passes)
    run_rl(load_rl_config(args[1], args[2:]) if args[0] == "--config" else load_rl_config(None, args), log=quiet)
    monkeypatch.undo()
    return runs[0], params_at, shares, passes


def assert_as_from_host(run, params_at, shares, passes, *, initial):
    """Every recorded rollout share equals the host path's from the same version's host weights, and every step's
    passes equal those run with host weights (the reference from the run's `initial` host weights)."""
    assert shares and passes
    for sampler, step, version, kind, got in shares:
        assert kind is PolicyWeights  # the trainer's own sampler sampled from device copies
        again = RolloutSampler.share(sampler, step, params_at[version], version)  # today's host path
        for field in ("response_ids", "logprobs", "topk_ids", "topk_logprobs"):
            a, b = getattr(got.rollout, field), getattr(again.rollout, field)
            assert (a is None) == (b is None), field
            assert a is None or all(np.array_equal(x, y) for x, y in zip(a, b)), (step, field)
        assert (got.trainer_logprobs is None) == (again.trainer_logprobs is None)
        if got.trainer_logprobs is not None:  # the bf16 sampler's mismatch pass (fp32, on the trainer's device)
            assert all(np.array_equal(x, y) for x, y in zip(got.trainer_logprobs, again.trainer_logprobs)), step
        assert got.rewards.tolist() == again.rewards.tolist()
    for step, rollout, kind, scored, first, width, got in passes:
        assert kind is PolicyWeights
        run.step_reference = (ReferencePolicy(run.model_config, initial, temperature=run.config.rollout.temperature,
                                              bucket=run.config.rollout.prompt_bucket)
                              if run.reference is not None else None)
        again = rl_loop.RLRun.forward_passes(run, rollout, params_at[step], scored, step, first=first, width=width)
        for field in ("ref_logprobs", "old_logprobs", "values"):
            a, b = getattr(got, field), getattr(again, field)
            assert (a is None) == (b is None), field
            assert a is None or all(np.array_equal(x, y) for x, y in zip(a, b)), (step, field)


def tiny_args(out, *extra):
    return ["--preset", "tiny", "--attention_block_size", "16", "--token_cap", "48", "--prompt_bucket", "8",
            "--max_new_tokens", "4", "--max_digits", "1", "--max_terms", "2", "--pool_size", "8", "--sft_steps", "0",
            "--prompts_per_step", "4", "--group_size", "4", "--updates_per_step", "2", "--learning_rate", "1e-3",
            "--steps", "3", "--devices", "2", "--deterministic", "--no-progress", "--save_every", "0",
            "--eval_every", "0", "--no-export_hf", "--out_dir", str(out), *extra]


@pytest.mark.parametrize("dtype,extra", [
    ("float32", ("--loss", "ppo", "--kl_coef", "0.05", "--advantage", "gae")),  # reference + values, fp32 sampler
    ("bfloat16", ("--loss", "decoupled_ppo", "--kl_in_reward_coef", "0.05")),  # mismatch, recompute, reference
])
def test_synchronous_rl_samples_and_passes_as_from_host_weights(monkeypatch, tmp_path, dtype, extra):
    args = tiny_args(tmp_path, "--rollout.dtype", dtype, *extra)
    run, params_at, shares, passes = run_recording(monkeypatch, args)
    assert sorted(params_at) == [0, 1, 2] and len(shares) == 3
    assert_as_from_host(run, params_at, shares, passes, initial=params_at[0])


def test_asynchronous_rl_samples_its_stale_versions_as_from_host_weights(monkeypatch, tmp_path, reward_file):  # noqa: F811
    """rollout.max_staleness 2, bf16 sampler thread (configs/rl_async.yaml shrunk): the versions the thread keeps
    are device copies, and each rollout equals the host path's from its version's weights."""
    args = async_overrides(tmp_path, reward_file, "--steps", "5", "--rollout.sampler", "thread")
    run, params_at, shares, passes = run_recording(monkeypatch, args)
    assert {step - version for _, step, version, _, _ in shares} == {0, 1, 2}  # stale versions sampled from
    assert {version for _, _, version, _, _ in shares} <= set(params_at)
    assert_as_from_host(run, params_at, shares, passes, initial=params_at[0])


def test_no_host_copy_of_the_policy_during_a_step_or_an_evaluation(monkeypatch, tmp_path):
    """Every way to the engine's parameters on the host (`params`, `flat_params`, `group_to_host`, `state_dict`,
    `jodc.fsdp.state.host_copy` / `to_host_canonical`) raises inside a step and an evaluation of a bf16-sampler run
    with a KL reference; outside them (the checkpoints) they work as before."""
    inside = []

    def guarded(name, original):
        def call(*args, **kwargs):
            if inside:
                raise AssertionError(f"{name} gathered the policy to the host in an RL step")
            return original(*args, **kwargs)
        return call

    import jodc.fsdp as fsdp

    classes = {Engine, *[c for c in vars(fsdp).values() if isinstance(c, type) and issubclass(c, Engine)]}
    for cls in classes:
        for name in ("params", "flat_params", "group_to_host", "state_dict"):
            if name in vars(cls):
                monkeypatch.setattr(cls, name, guarded(name, vars(cls)[name]))
    for name in ("host_copy", "to_host_canonical"):  # the engines' ways to the host (group_to_host, state_dict)
        monkeypatch.setattr(fsdp_state, name, guarded(name, getattr(fsdp_state, name)))
    for hook in ("train_step", "evaluate"):
        original = getattr(RLRun, hook)

        def wrapped(self, step, original=original):
            inside.append(True)
            try:
                return original(self, step)
            finally:
                inside.pop()
        monkeypatch.setattr(RLRun, hook, wrapped)
    summary = run_rl(load_rl_config(None, tiny_args(tmp_path, "--rollout.dtype", "bfloat16", "--loss",
                                                    "decoupled_ppo", "--kl_coef", "0.05", "--eval_every", "2",
                                                    "--eval_problems", "4", "--save_every", "3")), log=quiet)
    assert summary["final_eval_accuracy"] is not None
    assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "3"))
