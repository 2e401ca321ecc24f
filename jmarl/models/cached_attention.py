"""Attention of one new query per row over a KV cache (`jmarl.models.kv_cache` layout), in three forms:

- `cached_attention`: over the row's own cache, optionally in consecutive blocks along the slot
  axis, each read where it lies (the sampler's two-phase decode loop);
- `pooled_cached_attention`: over rows of a pool of prompt caches, gathered one layer at a time
  (`take_rows`), then the row's own cache (the continuous engine);
- `prefixed_cached_attention`: over its group's shared prompt cache (stored once per group),
  then the row's own cache (the static sampler's GRPO groups).

Each is one softmax over all the keys it reads. `jmarl.models.decode.decode_step` picks the form.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from jmarl.models.kv_cache import take_rows

# Large negative score for masked keys: a fully masked row becomes uniform instead of NaN.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)

Blocks = jax.Array | Sequence[jax.Array]


def _blocks(x: Blocks) -> list[jax.Array]:
    """A cache buffer, or consecutive blocks of one along the slot axis, as a list of blocks."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _split_slots(probs: jax.Array, values: list[jax.Array]) -> list[jax.Array]:
    """probs [..., C1 + C2 + ...] cut into the slots of each values block [B,KV,Ci,hd]."""
    edges = [sum(v.shape[2] for v in values[:i + 1]) for i in range(len(values) - 1)]
    return jnp.split(probs, edges, axis=-1) if edges else [probs]


def cached_attention(q: jax.Array, keys: Blocks, values: Blocks, key_mask: jax.Array) -> jax.Array:
    """One query per row over the cache. q [B,1,H,hd], keys [B,KV,hd,C], values [B,KV,C,hd],
    key_mask bool[B,C] -> [B,1,H,hd]. keys/values may be consecutive blocks along the slot axis
    (C = C1 + C2 + ...), each read where it lies."""
    keys, values = _blocks(keys), _blocks(values)
    b, _, h, hd = q.shape
    kv = keys[0].shape[1]
    q = q.reshape(b, kv, h // kv, hd).astype(keys[0].dtype)
    scores = jnp.concatenate(
        [jnp.einsum("bkgd,bkdc->bkgc", q, k, preferred_element_type=jnp.float32) for k in keys], axis=-1)
    scores = jnp.where(key_mask[:, None, None, :], scores * hd**-0.5, _MASKED)
    probs = _split_slots(jax.nn.softmax(scores, axis=-1).astype(values[0].dtype), values)
    out = functools.reduce(jnp.add, [jnp.einsum("bkgc,bkcd->bkgd", p, v) for p, v in zip(probs, values)])
    return out.reshape(b, 1, h, hd)


def pooled_cached_attention(q: jax.Array, pool_keys: jax.Array, pool_values: jax.Array, rows: jax.Array, groups: int,
                            keys: jax.Array, values: jax.Array, key_mask: jax.Array) -> jax.Array:
    """One query per row over a pooled prompt cache and the row's own cache. q [B,1,H,hd];
    pool_keys [Q,KV,hd,P], pool_values [Q,KV,P,hd] (G = `groups` equal groups of rows: row b,
    of group b // (B/G), reads pool row g Q/G + rows[b]; `take_rows`); keys [B,KV,hd,C],
    values [B,KV,C,hd]; key_mask bool[B, P + C] -> [B,1,H,hd]. One softmax over the P + C keys
    (`cached_attention` over the two blocks).

    The rows' prompt keys/values are gathered for this call only: inside a decode step's layer
    loop, one layer's [B, ..., P] rows at a time. The rows are made to depend on the query (a
    row whose query is NaN, whose output is NaN anyway, reads row 0), so that XLA neither hoists
    the gathers of every layer out of a decode loop (the rows do not change from step to step)
    nor schedules them all ahead of the layers; `optimization_barrier` does not survive
    XLA:CPU's pipeline for this. A broadcast multiply-sum over the pool (which could fuse the
    gather) measured larger on XLA:CPU: its products are materialised."""
    rows = jnp.where(jnp.isnan(q[:, 0, 0, 0]), 0, rows)
    pool_k = take_rows(pool_keys, rows, groups)
    pool_v = take_rows(pool_values, rows, groups)
    return cached_attention(q, (pool_k, keys), (pool_v, values), key_mask)


def prefixed_cached_attention(
    q: jax.Array,
    prefix_keys: jax.Array,
    prefix_values: jax.Array,
    prefix_mask: jax.Array,
    keys: Blocks,
    values: Blocks,
    key_mask: jax.Array,
    *,
    use_dot: bool | None = None,
) -> jax.Array:
    """One query per row over its group's shared prompt cache and its own cache. q [B,1,H,hd];
    prefix_keys [U,KV,hd,S], prefix_values [U,KV,S,hd], prefix_mask bool[U,S] (rows u*G ..
    u*G+G-1 share prompt u, G = B/U); keys [B,KV,hd,C], values [B,KV,C,hd], key_mask bool[B,C]
    -> [B,1,H,hd]. One softmax over the S + C keys of each row, taken over the two blocks of
    scores as they are (no concatenated copy). keys/values may be consecutive blocks along the
    slot axis (C = C1 + C2 + ...), each read where it lies.

    use_dot: the query-key and probability-value products as matrix products (the default off
    CPU, picked when the program is lowered) or as a broadcast multiply and sum (the CPU default: each batch element has only H/KV
    query rows, and XLA's CPU batched matrix products cost more than the fused multiply-sum).
    Both accumulate in float32."""
    if use_dot is None:  # chosen when the program is lowered, for the platform it is lowered for
        args = (q, prefix_keys, prefix_values, prefix_mask, keys, values, key_mask)
        form = functools.partial(prefixed_cached_attention)
        return jax.lax.platform_dependent(
            *args, cpu=functools.partial(form, use_dot=False), default=functools.partial(form, use_dot=True))
    keys, values = _blocks(keys), _blocks(values)
    b, _, h, hd = q.shape
    u, kv, _, s = prefix_keys.shape
    g, r = b // u, h // kv
    f32 = jnp.float32
    q = q.reshape(b, kv, r, hd).astype(keys[0].dtype)
    if use_dot:
        q_groups = q.reshape(u, g, kv, r, hd)
        from_prefix = jnp.einsum("ugkhd,ukds->ugkhs", q_groups, prefix_keys, preferred_element_type=f32) * hd**-0.5
        own = jnp.concatenate(
            [jnp.einsum("bkgd,bkdc->bkgc", q, k, preferred_element_type=f32) for k in keys], axis=-1) * hd**-0.5
    else:  # the scale goes on the H x hd queries rather than on the H x (S + C) scores
        scaled = q.astype(f32) * hd**-0.5
        q_groups = scaled.reshape(u, g, kv, r, hd)
        from_prefix = jnp.sum(q_groups[..., None] * prefix_keys.astype(f32)[:, None, :, None], axis=-2)
        # Block i > 0 takes the unscaled queries and scales its scores: were every block's
        # multiply-sum to broadcast the same queries, XLA would merge the broadcasts of
        # equal-length blocks into one materialised buffer that each block then reads (measured
        # 2x slower generation), instead of fusing the broadcast into each multiply-sum.
        own = jnp.concatenate(
            [jnp.sum(scaled[..., None] * keys[0].astype(f32)[:, :, None], axis=3)]
            + [jnp.sum(q.astype(f32)[..., None] * k.astype(f32)[:, :, None], axis=3) * hd**-0.5 for k in keys[1:]],
            axis=-1)
    from_prefix = jnp.where(prefix_mask[:, None, None, None, :], from_prefix, _MASKED)  # [U,G,KV,r,S]
    own = jnp.where(key_mask[:, None, None, :], own, _MASKED)  # [B,KV,r,C]
    top = jnp.maximum(from_prefix.max(axis=-1).reshape(b, kv, r), own.max(axis=-1))[..., None]  # [B,KV,r,1]
    e_prefix = jnp.exp(from_prefix - top.reshape(u, g, kv, r, 1))
    e_own = jnp.exp(own - top)
    total = e_prefix.sum(axis=-1).reshape(b, kv, r, 1) + e_own.sum(axis=-1, keepdims=True)
    dtype = values[0].dtype
    p_prefix = (e_prefix / total.reshape(u, g, kv, r, 1)).astype(dtype)
    p_own = _split_slots((e_own / total).astype(dtype), values)
    if use_dot:
        out = jnp.einsum("ugkhs,uksd->ugkhd", p_prefix, prefix_values, preferred_element_type=f32).reshape(b, kv, r, hd)
        parts = [jnp.einsum("bkgc,bkcd->bkgd", p, v, preferred_element_type=f32) for p, v in zip(p_own, values)]
    else:
        out = jnp.sum(p_prefix.astype(f32)[..., None] * prefix_values.astype(f32)[:, None, :, None], axis=-2)
        out = out.reshape(b, kv, r, hd)
        parts = [jnp.sum(p.astype(f32)[..., None] * v.astype(f32)[:, :, None], axis=3) for p, v in zip(p_own, values)]
    return functools.reduce(jnp.add, parts, out).astype(dtype).reshape(b, 1, h, hd)
