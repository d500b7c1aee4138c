"""A tiny staged language model (embedding, residual MLP layers, head) and random packed minibatches, for testing
the FSDP engines without the full decoder."""
import jax
import jax.numpy as jnp
import numpy as np

from jodc.fsdp import MinibatchArrays, Stage, StagedModel

VOCAB, HIDDEN = 32, 16


def init_groups(num_layers=3, seed=0, tied=False):
    rng = np.random.default_rng(seed)
    groups = {"embed": {"table": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.5}}
    for i in range(num_layers):
        groups[f"layer_{i}"] = {
            "w_in": rng.standard_normal((HIDDEN, 2 * HIDDEN)).astype(np.float32) / np.sqrt(HIDDEN),
            "w_out": rng.standard_normal((2 * HIDDEN, HIDDEN)).astype(np.float32) / np.sqrt(2 * HIDDEN),
            "pos": rng.standard_normal((HIDDEN,)).astype(np.float32) * 0.1,
        }
    groups["head"] = {"scale": np.ones((HIDDEN,), np.float32)}
    if not tied:
        groups["head"]["w"] = rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32) / np.sqrt(HIDDEN)
    return groups


def embed(params, h, mb):
    (p,) = params
    return p["table"][mb["tokens"]]


def layer(params, h, mb):
    (p,) = params
    x = h + mb["positions"][..., None].astype(h.dtype) * p["pos"]
    return h + jnp.tanh(x @ p["w_in"]) @ p["w_out"]


def head_loss(logits, mb):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, mb["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mb["loss_mask"]) / mb["normalizer"]


def head(params, h, mb):
    (p,) = params
    return head_loss((h * p["scale"]) @ p["w"], mb)


def tied_head(params, h, mb):
    p, e = params
    return head_loss((h * p["scale"]) @ e["table"].T, mb)


def make_model(num_layers=3, seed=0, tied=False):
    groups = init_groups(num_layers, seed, tied)
    stages = [Stage("embed", ("embed",), embed)]
    stages += [Stage(f"layer_{i}", (f"layer_{i}",), layer) for i in range(num_layers)]
    stages.append(Stage("head", ("head", "embed"), tied_head) if tied else Stage("head", ("head",), head))
    return StagedModel.build(groups, stages), groups


def random_minibatch(counts, token_cap=12, seed=0, max_micro=None):
    """Packed rows of random sequences; device d has counts[d] real microbatches, the rest are empty."""
    rng = np.random.default_rng(seed)
    d = len(counts)
    m = max_micro or max(max(counts), 1)
    shape = (d, m, token_cap)
    tokens = np.zeros(shape, np.int32)
    targets = np.zeros(shape, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    positions = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    sequences = 0
    for dev, c in enumerate(counts):
        for j in range(c):
            used, seg = 0, 0
            while used < token_cap - 1:
                n = int(rng.integers(2, token_cap - used + 1))
                seg += 1
                sequences += 1
                ids = rng.integers(0, VOCAB, n + 1)
                sl = slice(used, used + n)
                tokens[dev, j, sl] = ids[:-1]
                targets[dev, j, sl] = ids[1:]
                loss_mask[dev, j, sl] = (rng.random(n) < 0.8).astype(np.float32)
                positions[dev, j, sl] = np.arange(n)
                segment_ids[dev, j, sl] = seg
                used += n
                if rng.random() < 0.3:
                    break
    normalizer = float(max(loss_mask.sum(), 1.0))
    return MinibatchArrays(tokens, targets, loss_mask, positions, segment_ids, np.asarray(counts), normalizer,
                           sequences)


# ---------------------------------------------------------------------------------------------------------------
# a forced non-finite backward pass (test-only): what a numerical blow-up on one device looks like
# ---------------------------------------------------------------------------------------------------------------

POISON_POSITION = -7  # a position no real token has: a microbatch holding it gets a NaN backward pass


@jax.custom_vjp
def _nan_backward_if(h, flag):
    return h


def _nan_backward_fwd(h, flag):
    return h, flag


def _nan_backward_bwd(flag, g):
    return jnp.where(flag, jnp.nan, 1.0).astype(g.dtype) * g, None


_nan_backward_if.defvjp(_nan_backward_fwd, _nan_backward_bwd)


def poison_backward(model):
    """`model` with its first stage's output passed through an identity whose backward pass is NaN for a
    microbatch holding POISON_POSITION (the forward pass, hence the loss, is unchanged and finite)."""
    from jodc.fsdp import Stage, StagedModel

    first = model.stages[0]

    def fn(params, h, mb):
        return _nan_backward_if(first.fn(params, h, mb), jnp.any(mb["positions"] == POISON_POSITION))

    return StagedModel(model.group_names, model.layouts, (Stage(first.name, first.groups, fn),) + model.stages[1:],
                       model.metric_names)


def poison(batch, device=0, microbatch=0):
    """Marks one microbatch of one device (in place) so that `poison_backward` models give it a NaN gradient.
    The last slot of that row gets POISON_POSITION (a padding slot when the row has one)."""
    batch.positions[device, microbatch, -1] = POISON_POSITION
    return batch
