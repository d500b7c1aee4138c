"""train/rl/assembly.py in one process: the pieces of a step assembled without replicating the rollout across
processes (the exchanges run over a fake communicator; tests/multiprocess/rl_sampling_case.py runs them under
mpirun). A synthetic scored rollout of 4 prompts x 3 responses split over 2 "processes"."""
import pickle

import numpy as np
import pytest

from jodc.balance import LinearCost, get_planner
from jodc.fsdp.batch import minibatch_from_plan
from jodc.train.rl.assembly import StepInputs, sequence_destinations
from jodc.train.rl.batch import (extra_specs, local_sequences, pack_local_minibatch, pack_minibatch, plan_minibatch,
                                 split_minibatches, step_digest, training_sequences)
from jodc.train.rl.rollout import Rollout
from jodc.train.rl.rollout_exchange import RolloutShareError, bytes_received, exchange
from jodc.train.rl.scored import ScoredRollout, ShareMeta, StepRollout
from test_rl_dp_sampling import FakeComm

N, G, K, T = 12, 3, 2, 32


def whole_rollout(with_trainer: bool = True) -> ScoredRollout:
    rng = np.random.default_rng(0)
    prompt_ids = [rng.integers(1, 50, rng.integers(2, 6)).astype(np.int32) for _ in range(N)]
    response_ids = [rng.integers(1, 50, rng.integers(1, 8)).astype(np.int32) for _ in range(N)]
    logprobs = [-rng.random(len(r)).astype(np.float32) for r in response_ids]
    rollout = Rollout(prompts=[f"p{i // G}" for i in range(N)], prompt_ids=prompt_ids, response_ids=response_ids,
                      logprobs=logprobs, topk_ids=[rng.integers(1, 50, (len(r), K)).astype(np.int32)
                                                   for r in response_ids],
                      topk_logprobs=[-rng.random((len(r), K)).astype(np.float32) for r in response_ids],
                      responses=[f"r{i}" for i in range(N)], finished=rng.random(N) > 0.5, group_size=G, seconds=0.5)
    trainer = [lp - 0.01 for lp in logprobs] if with_trainer else None
    return ScoredRollout(step=2, rollout=rollout, rewards=rng.random(N), versions=np.full(N, 2, np.int64),
                         trainer_logprobs=trainer, reward_seconds=0.25, mismatch_seconds=0.125)


SHARES = [range(0, 6), range(6, 12)]


def test_sharded_views_of_one_rollout_agree_with_it():
    """`from_metas` (what the processes exchange) and `from_whole` (a checkpoint's rollout) give every process the
    whole rollout's metadata, its own share, and the mismatch of the whole (to float rounding)."""
    whole = whole_rollout()
    views = [StepRollout.from_whole(whole, SHARES[p]) for p in (0, 1)]
    metas = [ShareMeta.of(v.own) for v in views]
    for p, view in enumerate(views):
        exchanged = StepRollout.from_metas(view.own, metas, p)
        for got in (view, exchanged):
            assert len(got) == N and got.held == SHARES[p] and got.step == 2 and not got.holds_all
            assert got.own.rollout.response_ids == whole.rollout.response_ids[SHARES[p].start:SHARES[p].stop]
            np.testing.assert_array_equal(got.rewards, whole.rewards)
            np.testing.assert_array_equal(got.response_lengths, whole.response_lengths)
            np.testing.assert_array_equal(got.finished, whole.finished)
            np.testing.assert_array_equal(got.sequence_lengths, [len(a) + len(b) - 1 for a, b in
                                                                 zip(whole.rollout.prompt_ids,
                                                                     whole.rollout.response_ids)])
            assert got.mismatch.keys() == whole.mismatch.keys()
            for key, value in whole.mismatch.items():
                assert got.mismatch[key] == pytest.approx(value, rel=1e-12)
    assert views[0].width(8) == -(-max(len(a) + len(b) for a, b in zip(whole.rollout.prompt_ids,
                                                                     whole.rollout.response_ids)) // 8) * 8
    with pytest.raises(ValueError, match="shares of steps"):
        StepRollout.from_metas(views[0].own, [metas[0], ShareMeta.of(whole_rollout_at(3))], 0)
    one = StepRollout.from_metas(whole, [ShareMeta.of(whole)], 0)  # one process: the whole rollout, one share
    assert one.holds_all and one.held == range(N) and one.mismatch == whole.mismatch  # bit for bit


def whole_rollout_at(step):
    scored = whole_rollout()
    scored.step = step
    return scored


def test_exchange_sends_each_process_its_own_value_and_names_failures():
    """`exchange`: value p of `produce()` goes to process p (this process's own stays here, nothing sent to itself
    counted); a process that failed is named in every process."""
    before = bytes_received()
    sent = pickle.dumps(("ok", {"for": 0}))
    got = exchange(lambda: [{"for": 0, "own": True}, {"for": 1}], what="step 3's training sequences", timeout_s=5,
                   comm=FakeComm(0, 2, {1: sent}))
    assert got == [{"for": 0, "own": True}, {"for": 0}]
    assert bytes_received() - before == len(sent) + 8  # the size header and the payload from process 1
    failed = pickle.dumps(("error", "ValueError: no reference here"))
    with pytest.raises(RolloutShareError, match=r"(?s)training sequences failed in process\(es\) \[1\]"):
        exchange(lambda: [1, 2], what="step 3's training sequences", timeout_s=5, comm=FakeComm(0, 2, {1: failed}))
    with pytest.raises(RolloutShareError, match=r"produced 1 values for 2 processes"):
        exchange(lambda: [1], what="x", timeout_s=5, comm=FakeComm(0, 2, {1: sent}))


@pytest.mark.parametrize("planner_name", ["lb_mini", "lb_micro"])
def test_local_rows_equal_the_replicated_packing(planner_name):
    """Each process packs only its devices' rows, from the sequences the plans send it (`sequence_destinations`,
    `local_sequences`): equal bit for bit to the replicated packing of the whole rollout there, zero placeholders
    elsewhere; the counts, normaliser and every device's microbatch tokens equal the replicated ones everywhere."""
    whole = whole_rollout()
    planner, devices, device_processes = get_planner(planner_name), 4, [0, 0, 1, 1]
    advantages = np.linspace(-1, 1, N).astype(np.float32)
    ref = [lp * 0.5 for lp in whole.rollout.logprobs]
    sequences = training_sequences(whole.rollout, advantages, with_topk=True, ref_logprobs=ref,
                                   trainer_logprobs=whole.trainer_logprobs)
    splits = split_minibatches(N, 2, seed=1, step=2)
    view = StepRollout.from_whole(whole, SHARES[0])
    plans = [plan_minibatch(view.sequence_lengths[i], planner=planner, num_devices=devices, token_cap=T,
                            cost_model=LinearCost(), skip_empty_microbatches=planner_name == "lb_mini") for i in splits]
    destinations = sequence_destinations(plans, splits, device_processes, N)
    specs = extra_specs(["behaviour_logprobs", "advantages", "topk_ids", "topk_logprobs", "ref_logprobs",
                         "trainer_logprobs"], K)
    for process in (0, 1):
        placed = np.flatnonzero(destinations[:, process])
        received = {int(i): {"prompt_ids": whole.rollout.prompt_ids[i], "response_ids": whole.rollout.response_ids[i],
                             "behaviour_logprobs": whole.rollout.logprobs[i], "topk_ids": whole.rollout.topk_ids[i],
                             "topk_logprobs": whole.rollout.topk_logprobs[i], "ref_logprobs": ref[i],
                             "trainer_logprobs": whole.trainer_logprobs[i]} for i in placed}
        ids, local = local_sequences(received, advantages)
        assert ids == placed.tolist()
        mine = [d for d, p in enumerate(device_processes) if p == process]
        for indices, plan in zip(splits, plans):
            got = pack_local_minibatch(plan, indices, ids, local, sequence_lengths=view.sequence_lengths,
                                       response_lengths=view.response_lengths, local_devices=mine, specs=specs,
                                       aggregation="token-mean")
            _, want = pack_minibatch(sequences, indices, planner=planner, num_devices=devices, token_cap=T,
                                     cost_model=LinearCost(), aggregation="token-mean",
                                     skip_empty_microbatches=planner_name == "lb_mini")
            assert got.normalizer == want.normalizer and got.num_tokens == want.num_tokens
            np.testing.assert_array_equal(got.counts, want.counts)
            np.testing.assert_array_equal(got.microbatch_tokens, want.tokens_per_microbatch())
            others = [d for d in range(devices) if d not in mine]
            for name, rows in got.as_dict().items():
                assert rows.dtype == want.as_dict()[name].dtype and rows.shape == want.as_dict()[name].shape
                np.testing.assert_array_equal(rows[mine], want.as_dict()[name][mine], err_msg=name)
                assert not rows[others].any(), name
    digest = step_digest(view, advantages, splits, plans)
    assert digest.shape == (4,) and not np.array_equal(digest, step_digest(view, advantages[::-1], splits, plans))


def test_a_sequence_split_over_a_group_across_processes_goes_to_each():
    """A response split over a context-parallel group whose members sit in both processes goes to both
    (`sequence_destinations`: one row, two processes); each process then packs its members' pieces of it, and its rows
    equal the replicated packing's."""
    from jodc.balance.cp_cost import ContextParallelCost
    from jodc.balance.cp_planners import lb_mini_cp
    from test_fsdp_context_parallel import relabelled

    whole = whole_rollout()
    advantages = np.linspace(-1, 1, N).astype(np.float32)
    view = StepRollout.from_whole(whole, SHARES[0])
    cap, device_processes, indices = 8, [0, 0, 1, 1], np.arange(N)
    cost = ContextParallelCost(num_layers=1, seconds_per_token=1e-3, seconds_per_pair=1e-5,
                               exchange_bytes_per_token=8.0)
    plan = lb_mini_cp(view.sequence_lengths, 4, cap, cost_model=cost)
    assert plan.groups and view.sequence_lengths.max() > cap
    members = plan.groups[0].members  # relabelled: its first two members on devices 1 and 2, one in each process
    order = list(members) + [d for d in range(4) if d not in members]
    perm = [0] * 4
    for d, t in zip(order, [1, 2, 0, 3]):
        perm[d] = t
    plan = relabelled(plan, perm)
    split = plan.groups[0].seq_indices[0]
    destinations = sequence_destinations([plan], [indices], device_processes, N)
    assert destinations.shape == (N, 2) and destinations[split].all()
    assert destinations.any(axis=1).all()
    specs = extra_specs(["behaviour_logprobs", "advantages"], K)

    def received(placed):
        return {int(i): {"prompt_ids": whole.rollout.prompt_ids[i], "response_ids": whole.rollout.response_ids[i],
                         "behaviour_logprobs": whole.rollout.logprobs[i]} for i in placed}

    def packed(placed, devices):
        ids, local = local_sequences(received(placed), advantages)
        return pack_local_minibatch(plan, indices, ids, local, sequence_lengths=view.sequence_lengths,
                                    response_lengths=view.response_lengths, local_devices=devices, specs=specs,
                                    aggregation="token-mean")

    want = packed(range(N), range(4))
    assert want.has_context_parallel
    for process in (0, 1):
        mine = [d for d, p in enumerate(device_processes) if p == process]
        got = packed(np.flatnonzero(destinations[:, process]), mine)
        for name, rows in got.as_dict().items():
            np.testing.assert_array_equal(rows[mine], want.as_dict()[name][mine], err_msg=name)


def test_the_objectives_extras_decide_what_travels_and_the_placeholders():
    """`EXTRA_FIELDS` is the one description of the extras: the objective's names decide what travels (never the
    advantages, returns or old values, computed in every process) and the placeholders' dtypes and shapes."""
    from jodc.train.rl.batch import EXTRA_FIELDS, sequences_from_arrays, travelling_fields

    names = ["behaviour_logprobs", "advantages", "topk_ids", "topk_logprobs", "returns", "old_values"]
    assert travelling_fields(names) == ("prompt_ids", "response_ids", "behaviour_logprobs", "topk_ids",
                                        "topk_logprobs")
    specs = extra_specs(names, 5)
    assert specs["topk_ids"] == (np.int32, (5,)) and specs["returns"] == (np.float32, ())
    assert set(extra_specs(list(EXTRA_FIELDS), 1)) == set(EXTRA_FIELDS)
    with pytest.raises(ValueError, match="unknown minibatch extras"):  # the rollout's name, not the extra's
        sequences_from_arrays([np.ones(2, np.int32)], [np.ones(1, np.int32)], np.zeros(1, np.float32),
                              {"logprobs": [np.zeros(1)]})


def test_sequences_nobody_plans_and_empty_local_sets():
    """A plan that leaves a response unplaced is an error; a process that trains nothing gets no sequences."""
    plan = plan_minibatch([3, 4], planner=get_planner("lb_mini"), num_devices=2, token_cap=8, cost_model=LinearCost())
    with pytest.raises(ValueError, match=r"no device for responses \[2\]"):
        sequence_destinations([plan], [np.array([0, 1])], [0, 1], 3)
    ids, sequences = local_sequences({}, np.zeros(3, np.float32))
    assert ids == [] and len(sequences) == 0
    assert StepInputs(ref_logprobs=None, old_logprobs=None, values=None).values_all is None


def test_minibatch_from_plan_packs_only_the_given_devices():
    """`devices`: the other devices' rows stay zero and their sequences' arrays are never read (placeholders);
    `microbatch_tokens` counts every device's tokens."""
    plan = plan_minibatch([3, 5, 2], planner=get_planner("lb_mini"), num_devices=2, token_cap=8,
                          cost_model=LinearCost())
    inputs = [np.arange(1, n + 1, dtype=np.int32) for n in (3, 5, 2)]
    full = minibatch_from_plan(plan, inputs, inputs, [np.ones(n, np.float32) for n in (3, 5, 2)])
    on_0 = {i for mb in plan.devices[0] for i in mb.seq_indices}
    placeholders = [x if i in on_0 else np.broadcast_to(np.int32(0), x.shape) for i, x in enumerate(inputs)]
    part = minibatch_from_plan(plan, placeholders, placeholders,
                               [np.ones(n, np.float32) for n in (3, 5, 2)], devices=[0])
    np.testing.assert_array_equal(part.tokens[0], full.tokens[0])
    assert not part.tokens[1].any() and not part.segment_ids[1].any()
    np.testing.assert_array_equal(part.microbatch_tokens, full.microbatch_tokens)
    assert part.num_tokens == full.num_tokens == 10 == int((full.segment_ids > 0).sum())


def test_sequences_travel_packed_and_arrive_bit_for_bit():
    """`send_sequences`' message form: per field one concatenated array and the lengths; unpacked, every sequence's
    arrays equal what was sent (dtypes and trailing shapes kept)."""
    from jodc.train.rl.assembly import _packed, _unpacked

    whole = whole_rollout()
    fields = ("prompt_ids", "response_ids", "behaviour_logprobs", "topk_ids")
    sent = [(i, {"prompt_ids": whole.rollout.prompt_ids[i], "response_ids": whole.rollout.response_ids[i],
                 "behaviour_logprobs": whole.rollout.logprobs[i], "topk_ids": whole.rollout.topk_ids[i]})
            for i in (7, 2, 9)]
    got = _unpacked(pickle.loads(pickle.dumps(_packed(sent, fields))))
    assert list(got) == [7, 2, 9]
    for i, arrays in sent:
        for f in fields:
            assert got[i][f].dtype == arrays[f].dtype and np.array_equal(got[i][f], arrays[f]), (i, f)
