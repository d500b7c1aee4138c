"""Plan + examples -> MinibatchArrays: every token lands exactly once with its next-token target, loss tokens are
counted once, segment ids / positions follow the plan, and devices are padded with empty microbatches."""
import numpy as np
import pytest

from jodc.balance import get_planner
from jodc.train.sft.batching import minibatch_arrays, shifted_targets
from jodc.train.sft.data import Example

def random_examples(n, seed=0, max_len=40):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(2, max_len))
        tokens = rng.integers(0, 50, length).astype(np.int32)
        mask = rng.random(length) < 0.6
        mask[0] = False
        mask[-1] = True  # at least one trained token
        out.append(Example(tokens, mask))
    return out


def unpack(batch):
    """Sequences back out of the arrays: {(device, row, segment): (tokens, targets, mask, positions)}."""
    out = {}
    for d in range(batch.num_devices):
        for m in range(batch.tokens.shape[1]):
            seg = batch.segment_ids[d, m]
            for s in np.unique(seg[seg > 0]):
                where = seg == s
                assert np.all(np.diff(np.flatnonzero(where)) == 1), "a sequence must be contiguous in its row"
                out[d, m, int(s)] = tuple(getattr(batch, f)[d, m][where]
                                          for f in ("tokens", "targets", "loss_mask", "positions"))
    return out


@pytest.mark.parametrize("planner", ["lb_mini", "lb_micro", "local_sort"])
@pytest.mark.parametrize("devices", [1, 3, 4])
def test_every_token_lands_once_with_its_target(planner, devices):
    examples = random_examples(13, seed=devices)
    plan = get_planner(planner)([e.length for e in examples], devices, 64)
    batch = minibatch_arrays(plan, examples)
    assert batch.tokens.shape[:2] == (devices, max(plan.microbatch_counts()))
    assert batch.counts.tolist() == list(plan.microbatch_counts())
    assert batch.num_tokens == sum(e.length for e in examples)
    assert batch.normalizer == sum(int(e.loss_mask[1:].sum()) for e in examples) == batch.loss_mask.sum()
    assert batch.num_sequences == len(examples)
    pieces = unpack(batch)
    assert len(pieces) == len(examples)
    for d, device in enumerate(plan.devices):
        for m, mb in enumerate(device):
            for j, i in enumerate(mb.seq_indices):
                tokens, targets, mask, positions = pieces[d, m, j + 1]
                e = examples[i]
                np.testing.assert_array_equal(tokens, e.tokens)
                np.testing.assert_array_equal(targets[:-1], e.tokens[1:])
                np.testing.assert_array_equal(mask, np.append(e.loss_mask[1:], False))
                np.testing.assert_array_equal(positions, np.arange(e.length))
    padding = batch.segment_ids == 0
    assert np.all(batch.loss_mask[padding] == 0) and np.all(batch.segment_ids[padding] == 0)
    assert np.all(batch.positions[padding] == 0)


def test_odc_skips_empty_microbatches_and_pads_rows():
    examples = random_examples(5, seed=1)  # local_sort: one sequence per microbatch, 2 devices -> counts 3, 2+1 empty
    plan = get_planner("local_sort")([e.length for e in examples], 2, 64)
    assert plan.microbatch_counts() == (3, 3) and plan.devices[1][-1].is_empty
    batch = minibatch_arrays(plan, examples, skip_empty_microbatches=True)
    assert batch.counts.tolist() == [3, 2] and batch.tokens.shape[1] == 3
    assert np.all(batch.segment_ids[1, 2] == 0) and np.all(batch.loss_mask[1, 2] == 0)
    assert plan.without_empty_microbatches().microbatch_counts() == (3, 2)


def test_a_device_with_nothing_gets_only_padding():
    examples = random_examples(2, seed=2)
    plan = get_planner("lb_mini")([e.length for e in examples], 4, 64)
    batch = minibatch_arrays(plan, examples)
    assert sorted(batch.counts.tolist()) == [0, 0, 1, 1] and batch.tokens.shape[1] == 1
    empty = batch.counts == 0
    assert np.all(batch.segment_ids[empty] == 0)


def test_shifted_targets_of_one_sequence():
    e = Example(np.array([5, 6, 7], np.int32), np.array([False, True, True]))
    targets, mask = shifted_targets(e)
    assert targets.tolist() == [6, 7, 0] and mask.tolist() == [1.0, 1.0, 0.0]


def test_mismatched_inputs_are_refused():
    examples = random_examples(4)
    plan = get_planner("lb_mini")([e.length for e in examples], 2, 64)
    with pytest.raises(ValueError, match="covers 4 sequences, the minibatch has 3"):
        minibatch_arrays(plan, examples[:3])
    with pytest.raises(ValueError, match="sequence 0 has .* tokens, the plan was made for"):
        minibatch_arrays(plan, [random_examples(1, seed=9)[0]] + examples[1:])
    no_loss = [Example(e.tokens, np.zeros_like(e.loss_mask)) for e in examples]
    with pytest.raises(ValueError, match="no trained token"):
        minibatch_arrays(plan, no_loss)
