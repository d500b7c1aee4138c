"""The Flax decoder (jodc.models) as a `StagedModel` for the engines: one bucket per parameter group (embed, each
layer, head, and the critic's value head when asked), one stage per group, and a head loss (by default the SFT loss
of `jodc.losses`, next-token cross-entropy normalised by the minibatch's global loss-token count).

It lives with the trainers, not in `jodc.fsdp`: the engines know only `StagedModel`, never a model family."""
from __future__ import annotations

import jax

from jodc.fsdp.stages import CP_SPLIT_SEGMENTS, ContextParallel, GroupLayout, Stage, StagedModel
from jodc.fsdp.state import GroupSource
from jodc.losses import sft_loss_from_logits
from jodc.models import layerwise
from jodc.models.context_parallel import context_parallel_layer_apply, group_keys
from jodc.models.config import DecoderConfig
from jodc.models.value_head import VALUE_HEAD, init_value_head, value_apply

from .init_source import WithGroups, abstract_groups


def decoder_staged_model(config: DecoderConfig, groups: dict | None = None, *, seed: int = 0,
                         logprob_chunk_size: int | None = None, head_loss=None,
                         metric_names: tuple[str, ...] = (), value_head: bool = False
                         ) -> tuple[StagedModel, dict]:
    """Returns (staged model, initial group params). `groups` defaults to a random initialisation from `seed`; it may
    be a `jodc.fsdp.state.GroupSource` (e.g. `train.core.init_source.RandomInitSource`: each engine then builds only
    its devices' ranges, group by group), which is returned in its place.

    `head_loss(logits_btv, microbatch)` turns the logits of a microbatch (fields: tokens, targets, loss_mask,
    positions, segment_ids, normalizer, plus the minibatch's extras) into its loss, or into (loss, {metric: value})
    with the metrics named in `metric_names` (e.g. an RL policy loss); the default is next-token cross-entropy.

    `value_head=True` adds the critic's value head (`jodc.models.value_head`) as one more parameter group,
    `value_head` (zeros unless `groups` holds it), read by the head stage; `head_loss` is then called as
    `head_loss(logits_btv, microbatch, values_bt)` (critic PPO with a shared trunk).
    """
    if groups is None:
        groups = layerwise.init_params(config, jax.random.PRNGKey(seed))
    source = groups if isinstance(groups, GroupSource) else None
    shapes = abstract_groups(config) if source is not None else groups
    names = layerwise.param_groups(config)
    layer_names = names[1:-1]
    if value_head:
        if head_loss is None:
            raise ValueError("decoder_staged_model: value_head=True needs a head_loss taking the values")
        value = init_value_head(config) if source is not None else groups.get(VALUE_HEAD, init_value_head(config))
        shapes = {**shapes, VALUE_HEAD: value}
        names = names + [VALUE_HEAD]
        if source is not None:
            source = WithGroups(source, {VALUE_HEAD: GroupLayout.of(value)}, {VALUE_HEAD: value})
        else:
            groups = shapes
    missing = [n for n in names if n not in shapes]
    if missing:
        raise ValueError(f"decoder parameter groups {missing} are missing")

    def embed(params, h, mb):
        return layerwise.embed_apply(config, params[0], mb["tokens"])

    def layer(params, h, mb):
        return layerwise.layer_apply(config, params[0], h, mb["positions"], mb["segment_ids"])

    def layer_cp(params, h, mb, exchange):  # the layer on a context-parallel row: attention over the group
        return context_parallel_layer_apply(config, params[0], h, mb["positions"], mb["cp_keys"], exchange)

    def cp_keys(mb, exchange):  # segments 1..n of a CP row are its split sequences (zigzag_row); the engine gives n
        return group_keys(mb["segment_ids"], mb["positions"], mb[CP_SPLIT_SEGMENTS], exchange)

    def slot_numel(token_cap):  # a [1, T] row: the stacked K/V, or the keys' [3, 1, T]
        return max(2 * token_cap * config.num_kv_heads * config.head_dim, 3 * token_cap)

    def head(params, h, mb):
        embed_params = params[1] if config.tie_word_embeddings else None
        logits = layerwise.head_apply(config, params[0], h, embed_params)
        if value_head:
            return head_loss(logits, mb, value_apply(config, params[0], params[-1], h))
        if head_loss is not None:
            return head_loss(logits, mb)
        return sft_loss_from_logits(logits, mb, chunk_size=logprob_chunk_size)

    stages = [Stage(layerwise.EMBED, (layerwise.EMBED,), embed)]
    stages += [Stage(n, (n,), layer, context_parallel=layer_cp) for n in layer_names]
    head_groups = (layerwise.HEAD, layerwise.EMBED) if config.tie_word_embeddings else (layerwise.HEAD,)
    head_groups += (VALUE_HEAD,) if value_head else ()
    stages.append(Stage(layerwise.HEAD, head_groups, head))
    ordered = {n: shapes[n] for n in names}
    model = StagedModel.build(ordered, stages, metric_names, ContextParallel(cp_keys, slot_numel))
    return model, (source if source is not None else ordered)
