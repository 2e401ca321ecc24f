"""The model run in the learner's previous shared-prefix layout, the packing benchmark's baseline
(`benchmarks.shared_prefix_layout` builds its batches; `benchmarks.packing` times it against the
packed layout the learner runs now).

U shared prefixes [U,P] (left-padded), rows int[N] into them, and N continuations [N,C]
(right-padded): each layer runs the U prefixes once, then the N continuations attending to their
prefix's keys/values (read in place through `rows`, never copied per row) and to themselves,
so a GRPO group's G samples run their shared prompt once. The same numbers as the plain [N,T]
forward over each row's prefix + continuation (`jmarl.models.token_logprobs`), gradients
included: the tests hold it to that (tests/test_model.py, test_attention.py, test_gemma3.py,
test_qwen3_moe.py), since this is the reference the benchmarks compare against.

Built from the model's public pieces: the bound `Transformer`'s submodules, the layer scan's
helpers (`jmarl.models.layer_scan`), and the attention's partial forms that merge by their
log-sum-exps (`jmarl.models.attention.partial_attention`, `merge_attentions`). No sliding
window: a Gemma 3 batch whose prefixes plus continuations exceed it is refused (within it, the
sliding layers differ only by their RoPE).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmarl.errors import JmarlError
from jmarl.models import attention as attention_lib
from jmarl.models import moe as moe_lib
from jmarl.models.config import ModelConfig
from jmarl.models.layer_scan import (UNROLL_MAX_LAYERS, empty_router_stats, layer_kind, run_layer, scan_layers,
                                     split_xs)
from jmarl.models.logprobs import chunked_logprobs
from jmarl.models.model import Params, Transformer, bind, compact_rows, compaction, restore_rows
from jmarl.models.rope import rope_tables


def prefixed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_lengths: jax.Array,
    rows: jax.Array,
    *,
    impl: str = "auto",
    block_q: int = attention_lib.BLOCK_Q,
    block_k: int = attention_lib.BLOCK_K,
) -> jax.Array:
    """Continuations that also attend to a shared prompt. q [N,C,H,hd] and own k/v [N,C,KV,hd]
    (causal, lengths int[N]); prefixes prefix_k/prefix_v [U,P,KV,hd] with prefix_lengths int[U]
    (right-padded, all visible); rows int[N] in [0, U): the prefix of each continuation.
    -> [N,C,H,hd]: one softmax over the prefix's keys and the row's own, as if the N rows were
    prefix + continuation, computed as two attentions merged by their log-sum-exps. The
    blockwise form reads each prefix block by `rows` as it goes: no [N, P] copy of the prefix
    keys/values is made or kept for the backward pass (its gradient sums over the rows).
    impl: dense for "xla" / "dense", and for "auto" when the scores are small
    (`attention.DENSE_MAX_SCORES`); blockwise otherwise (no kernel form)."""
    if impl not in attention_lib.IMPLS:
        raise JmarlError(f"model.attention must be one of {', '.join(attention_lib.IMPLS)}, got {impl!r}")
    lengths = jnp.maximum(lengths.astype(jnp.int32), 1)
    rows = rows.astype(jnp.int32)
    p_len = prefix_lengths.astype(jnp.int32)[rows]
    n, c, h, _ = q.shape
    p = prefix_k.shape[1]
    small = n * h * c * (c + p) <= attention_lib.DENSE_MAX_SCORES
    form = "dense" if impl in ("xla", "dense") or (impl == "auto" and small) else "blockwise"
    part = functools.partial(attention_lib.partial_attention, form=form, block_q=block_q, block_k=block_k)
    own = part(q, k, v, lengths, causal=True)
    pre = part(q, prefix_k, prefix_v, p_len, causal=False, rows=rows)
    # a row whose prefix is empty: its prefix part holds only masked scores, weight exp(-huge) = 0
    pre_lse = jnp.where((p_len > 0)[:, None, None], pre[1], -jnp.inf)
    return attention_lib.merge_attentions(own, (pre[0], pre_lse)).astype(q.dtype)


def prefixed_step(layer_def: Any, impl: str, carry: tuple, xs: Any, consts: tuple, stats: bool = False) -> tuple:
    """One decoder layer of the shared-prefix layout (a `layer_scan.scan_layers` step): the U
    prefixes [U,P,D], then the N continuations [N,C,D] attending to their prefix's keys/values
    and to themselves. stats: the carry has a third item, the `moe.RouterStats` (prefixes and
    continuations added)."""
    p_cos, p_sin, s_cos, s_sin, prefix_len, own_len, rows = consts[:7]
    state, flags = split_xs(xs)
    if len(consts) > 7:  # sliding-window layers: their own RoPE (no window: sequences within it)
        p_local, s_local = consts[7][:2], consts[7][2:]
        s_cos, s_sin, _ = layer_kind(flags, s_cos, s_sin, s_local, 0)
        p_cos, p_sin, _ = layer_kind(flags, p_cos, p_sin, p_local, 0)
    xp, xs_ = carry[0], carry[1]
    p_valid = (jnp.arange(xp.shape[1])[None] < prefix_len[:, None]) if stats else None
    s_valid = (jnp.arange(xs_.shape[1])[None] < own_len[:, None]) if stats else None

    def attend_prefix(q, k, v):
        return attention_lib.attention(q, k, v, prefix_len, causal=True, impl=impl), (k, v)

    xp, (kp, vp), p_stats = run_layer(layer_def, state, flags, xp, p_cos, p_sin, attend_prefix, p_valid)

    def attend_continuation(q, k, v):
        return prefixed_attention(q, k, v, own_len, kp, vp, prefix_len, rows, impl=impl), None

    xs_, _, s_stats = run_layer(layer_def, state, flags, xs_, s_cos, s_sin, attend_continuation, s_valid)
    if not stats:
        return xp, xs_
    return xp, xs_, carry[2].plus(p_stats).plus(s_stats)


def hidden_prefixed(
    model: Transformer, prefix_tokens: jax.Array, prefix_mask: jax.Array, rows: jax.Array, tokens: jax.Array,
    mask: jax.Array, *, router_stats: bool = False,
) -> tuple[jax.Array, ...]:
    """A bound `Transformer` (`jmarl.models.model.bind`; inside a trace) on shared prefixes [U,P]
    (any padding), rows int[N] into them, continuations [N,C] (any padding) -> (final-normed
    hidden of each prefix's last real token [U,D], final-normed hidden of the continuations
    [N,C,D]). router_stats: a third item, the `moe.RouterStats` over the real tokens (each
    prefix counted once)."""
    c = model.config
    p, t = prefix_tokens.shape[1], tokens.shape[1]
    if c.window_exceeded(p + t):
        raise JmarlError(
            f"the shared-prefix layout does not implement sliding-window attention: prefixes of {p} plus "
            f"continuations of {t} slots exceed sliding_window={c.sliding_window}; score these sequences with "
            "token_logprobs or the packed layout (packed_token_logprobs), which are exact"
        )
    p_dest, prefix_len = compaction(prefix_mask)
    s_dest, own_len = compaction(mask)
    p_positions = jnp.arange(p, dtype=jnp.int32)[None]
    p_cos, p_sin = rope_tables(c, p_positions, p)
    s_positions = prefix_len[rows][:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    s_cos, s_sin = rope_tables(c, s_positions, p + t)

    layer_def, layer_state = nnx.split(model.layers)
    stats = router_stats and c.is_moe
    step = functools.partial(prefixed_step, layer_def, c.attention, stats=stats)
    consts = (p_cos, p_sin, s_cos, s_sin, prefix_len, own_len, rows.astype(jnp.int32))
    if c.has_sliding_window:  # no window to apply (checked above), only the local layers' RoPE
        consts = consts + (model.local_rope(p_positions, p) + model.local_rope(s_positions, p + t),)
    carry = (model.embed_tokens(compact_rows(prefix_tokens, p_dest)), model.embed_tokens(compact_rows(tokens, s_dest)))
    if stats:
        carry = carry + (moe_lib.RouterStats.zeros(c.num_experts),)
    unroll = c.num_layers <= UNROLL_MAX_LAYERS
    carry = scan_layers(step, carry, model.layer_xs(layer_state), consts, remat=c.remat, policy=c.remat_policy(),
                        unroll=unroll)
    xp, xs = carry[:2]
    last = jnp.maximum(prefix_len - 1, 0)[:, None, None]
    xp_last = jnp.take_along_axis(xp, last, axis=1)[:, 0]
    out = (model.final_norm(xp_last), restore_rows(model.final_norm(xs), s_dest))
    if not router_stats:
        return out
    return out + (carry[2] if stats else empty_router_stats(True),)


def prefix_token_logprobs(
    config: ModelConfig,
    params: Params,
    prefix_tokens: jax.Array,
    prefix_mask: jax.Array,
    rows: jax.Array,
    tokens: jax.Array,
    mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: int | None = None,
    with_router_stats: bool = False,
) -> jax.Array | tuple[jax.Array, moe_lib.RouterStats]:
    """float32[N,C]: out[n, j] = log p(tokens[n, j] | prefix rows[n], tokens[n, :j]) under
    softmax(logits / T), for U shared prefixes prefix_tokens/prefix_mask [U,P] (left-padded: each
    real prefix ends in slot P-1), rows int[N] in [0, U), and continuations tokens/mask [N,C]
    (right-padded).

    The same numbers as `token_logprobs` on the N concatenated rows (prefix rows[n] + tokens[n]),
    at the cost of running each distinct prefix once. The continuation attends to its prefix's
    keys/values (gathered per row; their gradients sum over the rows that share them). out is 0
    where mask is False or no real token precedes. with_router_stats: (out, `moe.RouterStats`
    over the real tokens, each prefix counted once).
    """
    model = bind(config, params)
    rows = rows.astype(jnp.int32)
    prefix_last, h, *stats = hidden_prefixed(model, prefix_tokens, prefix_mask, rows, tokens, mask,
                                             router_stats=with_router_stats)
    h_in = jnp.concatenate([prefix_last[rows][:, None], h[:, :-1]], axis=1)  # [N, C, D]
    lp = chunked_logprobs(model.head_master(), h_in, tokens, temperature, chunk_size=chunk_size,
                          compute_dtype=config.compute_dtype)
    prefix_len = jnp.sum(prefix_mask.astype(jnp.int32), axis=-1)[rows]
    mask = mask.astype(bool)
    has_context = mask & (prefix_len[:, None] + jnp.cumsum(mask.astype(jnp.int32), axis=-1) > 1)
    out = jnp.where(has_context, lp, 0.0)
    return (out, stats[0]) if with_router_stats else out
