"""Context-parallel attention that holds one member's keys and values at a time (memory-lean; exact).

`context_parallel.context_parallel_attention` all-gathers the group's K/V: a member holds k times its own K/V (and
the keyed kernel keeps them for the backward pass), which for a long sequence at a small model width can exceed what
the member's own activations take. Here the member's queries visit the group's K/V member by member instead:

- forward: attention of the queries against the member's own keys, then, for offsets r = 1 .. k-1, against member
  (i + r) % k's keys, pulled when needed (`SlotStream.fetch`) and dropped after use; the parts are merged by their
  log-sum-exp (`keyed_attention.merge_keyed_parts`: the one-pass softmax exactly, up to fp32 reassociation).
  Only q, the member's own K/V, the output and its log-sum-exp are kept for the backward pass.
- backward (FlashAttention-2 style over members): the member publishes its K/V again, pulls the others' one by one,
  computes each part's dq (summed here) and dK/dV (pushed at once into that member's accumulator), then meets the
  group and reads the sum pushed to it, plus its own part's.

The loops over members are `lax.scan`s (one body for any group size, each iteration's pulled K/V freed before the
next pull). The exchange must offer a `SlotStream` (`OdcGroupExchange(stream_kv=True)`): its publish / fetch / push /
collect are threaded on the exchange's token, which this function advances. Costs against the all-gather: one more
group barrier and k-1 more pulls per layer in the backward pass, and k-1 smaller pulls instead of one large one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .keyed_attention import keyed_attention_part, keyed_attention_part_grads, merge_keyed_parts, pad_tokens


def streamed_context_parallel_attention(q_bthd, k_btkd, v_btkd, keys, pairs_bij, exchange, *, block: int):
    """This member's attention output [B, T', H, D] for its queries against the group's keys, pulling one member's
    K/V at a time through ``exchange.kv_stream()`` (see the module docstring).

    Called by `context_parallel.context_parallel_attention` with its operands padded to a multiple of `block`
    (T' tokens): q_bthd [B, T', H, D] and `keys` (`GroupKeys`) padded, k_btkd / v_btkd this member's unpadded
    [B, T, KV, D] (exchanged as they are, padded after each pull), pairs_bij the group's block pairs [B, T'/blk,
    k * T'/blk] (member m's key blocks are columns m * T'/blk onwards). Call inside shard_map over the heap's axis.
    """
    key_arrays = (keys.query_segment_bt, keys.query_order_bt, keys.key_segment_gbt, keys.key_order_gbt)
    pad = q_bthd.shape[1] - k_btkd.shape[1]
    out, exchange.token = _attention(exchange.kv_stream(), block, pad, q_bthd, k_btkd, v_btkd, key_arrays,
                                     pairs_bij, keys.member, exchange.members, exchange.token)
    return out


def _member_keys(key_arrays, pairs_bij, m):
    """The (q_seg, q_order, k_seg, k_order) keys and block pairs of this member's queries against member m's keys."""
    q_seg, q_order, k_seg_g, k_order_g = key_arrays
    blocks = pairs_bij.shape[1]  # a member's key blocks: as many as its query blocks
    return (q_seg, q_order, k_seg_g[m], k_order_g[m]), lax.dynamic_slice_in_dim(pairs_bij, m * blocks, blocks, axis=2)


def _attention(stream, block, pad, q_pad, k_btkd, v_btkd, key_arrays, pairs_bij, member, members, token):
    """(out [B, T', H, D] in q's dtype, token): the custom_vjp over the pulls (defined per call: it closes over the
    stream and the static sizes only)."""
    k_group = members.shape[0]
    kv_shape = (2,) + k_btkd.shape
    numel = 2 * k_btkd.size

    def kv_of(flat):  # a pulled slot -> padded k, v
        kv = flat.reshape(kv_shape).astype(k_btkd.dtype)
        return pad_tokens(kv[0], 1, pad), pad_tokens(kv[1], 1, pad)

    def forward_parts(q, k, v, key_arrays, pairs_bij, member, members, token):
        token = stream.publish(jnp.stack([k, v]).reshape(-1), members, token)
        own_keys, own_pairs = _member_keys(key_arrays, pairs_bij, member)
        out, lse = keyed_attention_part(q, pad_tokens(k, 1, pad), pad_tokens(v, 1, pad), own_keys, own_pairs,
                                        block)

        def visit(carry, offset):
            out, lse, token = carry
            flat, token = stream.fetch(members, offset, token, numel)
            k_m, v_m = kv_of(flat)
            m_keys, m_pairs = _member_keys(key_arrays, pairs_bij, (member + offset) % k_group)
            part_out, part_lse = keyed_attention_part(q, k_m, v_m, m_keys, m_pairs, block)
            out, lse = merge_keyed_parts(out, lse, part_out, part_lse)
            return (out, lse, token), None

        (out, lse, token), _ = lax.scan(visit, (out, lse, token), jnp.arange(1, k_group, dtype=jnp.int32))
        return out, lse, token

    @jax.custom_vjp
    def attention(q, k, v, key_arrays, pairs_bij, member, members, token):
        out, _, token = forward_parts(q, k, v, key_arrays, pairs_bij, member, members, token)
        return out.astype(q.dtype), token

    def attention_fwd(q, k, v, key_arrays, pairs_bij, member, members, token):
        out, lse, token = forward_parts(q, k, v, key_arrays, pairs_bij, member, members, token)
        out = out.astype(q.dtype)
        return (out, token), (q, k, v, key_arrays, pairs_bij, member, members, out, lse, token)

    def attention_bwd(residuals, cotangents):
        q, k, v, key_arrays, pairs_bij, member, members, out, lse, token = residuals
        dout, _ = cotangents
        token = stream.publish(jnp.stack([k, v]).reshape(-1), members, token, backward=True, wait_for=(dout,))
        own_keys, own_pairs = _member_keys(key_arrays, pairs_bij, member)
        dq, dk_own, dv_own = keyed_attention_part_grads(q, pad_tokens(k, 1, pad), pad_tokens(v, 1, pad), own_keys,
                                                        own_pairs, block, out, lse, dout)
        t = k.shape[1]

        def visit(carry, offset):
            dq, token = carry
            flat, token = stream.fetch(members, offset, token, numel, backward=True)
            k_m, v_m = kv_of(flat)
            m_keys, m_pairs = _member_keys(key_arrays, pairs_bij, (member + offset) % k_group)
            dq_m, dk_m, dv_m = keyed_attention_part_grads(q, k_m, v_m, m_keys, m_pairs, block, out, lse, dout)
            token = stream.push(members, offset, jnp.stack([dk_m[:, :t], dv_m[:, :t]]).reshape(-1), token)
            return (dq + dq_m, token), None

        (dq, token), _ = lax.scan(visit, (dq, token), jnp.arange(1, k_group, dtype=jnp.int32))
        pushed, token = stream.collect(members, token, numel)
        dkv = pushed.reshape(kv_shape) + jnp.stack([dk_own[:, :t], dv_own[:, :t]])
        # the token's cotangent is unused: the backward pass's own ops are ordered by their data (dout)
        return (dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), (None,) * len(key_arrays), None,
                None, None, None)

    attention.defvjp(attention_fwd, attention_bwd)
    return attention(q_pad, k_btkd, v_btkd, key_arrays, pairs_bij, member, members, token)
