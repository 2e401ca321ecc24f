"""The KV-cache pair of the model's pure API: `prefill` (a prompt's keys/values into the cache and
its last slot's logits) and `decode_step` (one new token per row, written to the cache, attending
to it), with the sliding-window masks of the decode step (`window_masks`).

Like the forward API of `jmarl.models.model`, both take the parameters as a plain dict and
rebuild the modules inside the trace (`model.bind`). The cache layout is `jmarl.models.kv_cache`;
the attention over it, `jmarl.models.cached_attention`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jmarl.models.cached_attention import cached_attention, pooled_cached_attention, prefixed_cached_attention
from jmarl.models.config import ModelConfig
from jmarl.models.kv_cache import KVCache
from jmarl.models.model import Params, bind, rope_tables


def prefill(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array,
    cache: KVCache,
    rows: jax.Array | None = None,
    *,
    record_routing: bool = False,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
    """Runs the prompt tokens [U,S] through the model; writes their keys/values to cache slots
    [0, S) and returns (float32 logits of the last slot [B,V], cache). Prompts should be
    left-padded so every row's last real token sits in slot S-1. Without `rows`, U = B; with
    rows int[B], cache row b receives prompt rows[b] (identical prompts are computed once).
    record_routing (a model with experts): a third item, the experts each prompt token ran in
    each sparse layer, int32[U,S,num_sparse,k] (one per prompt, not per row; routing replay)."""
    model = bind(config, params)
    h, (keys, values), *routing = model.hidden(tokens, attention_mask, return_kv=True, last_only=True,
                                               record_routing=record_routing)
    h = h[:, -1]
    if rows is not None:
        keys, values, h = keys[:, rows], values[:, rows], h[rows]
    dtype = jnp.dtype(config.compute_dtype)

    def write(buffers: tuple[jax.Array, ...], new: jax.Array) -> tuple[jax.Array, ...]:
        new = new.astype(dtype)
        return tuple(jax.lax.dynamic_update_slice(buf, new[i], (0, 0, 0, 0)) for i, buf in enumerate(buffers))

    keys = keys.transpose(0, 1, 3, 4, 2)  # [L, B, S, KV, hd] -> [L, B, KV, hd, S]
    values = values.swapaxes(2, 3)  # -> [L, B, KV, S, hd]
    cache = KVCache(keys=write(cache.keys, keys), values=write(cache.values, values))
    return (model.logits(h), cache, *routing)


def decode_step(
    config: ModelConfig,
    params: Params,
    cache: KVCache,
    token: jax.Array,
    position: jax.Array,
    slot: jax.Array,
    key_mask: jax.Array,
    layers: Sequence[Params] | None = None,
    prefix: KVCache | None = None,
    prefix_mask: jax.Array | None = None,
    earlier: KVCache | None = None,
    earlier_rows: jax.Array | None = None,
    earlier_groups: int = 1,
    *,
    record_routing: bool = False,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
    """One new token per row: token int[B] at RoPE position int[B], written to cache slot `slot`
    (a scalar shared by all rows, or int[B]: one slot per row); attends to the cache slots where
    key_mask bool[B,C] is True (the slot itself included). Returns (float32 logits [B,V], updated cache).

    `earlier`: a read-only cache whose C0 slots come before `cache`'s (key_mask is then
    bool[B, C0 + C]): the first phase's block of a decode loop in two phases (`jmarl.models.sampler`).
    With `earlier_rows` int[B], `earlier` holds Q rows (a pool of prompt caches) and row b reads
    its row earlier_rows[b] in place (`pooled_cached_attention`; `earlier_groups`: the pool's
    groups, e.g. one per device: the continuous engine's prompts shared by their completions).

    With `prefix` (a [U, ...] KV cache of U shared prompts, U dividing B, and prefix_mask
    bool[U,S]) rows b = u*G .. u*G+G-1 (G = B/U) also attend to prompt u's keys/values, which are
    stored once per group instead of once per row (a GRPO group reads its prompt's cache once).

    Layers run as an unrolled Python loop over per-layer cache buffers, so each buffer is updated
    in place and read directly by the attention (no per-step copy of the cache).

    Sliding-window layers (Gemma 3) attend to the slots of key_mask (and prefix_mask) within the
    window of `position`, the keys' positions counted along the mask's slots (`window_masks`),
    and rotate by the local RoPE tables; the cache keeps every slot.

    record_routing (a model with experts): a third item, the experts the new token ran in each
    sparse layer, int32[B,num_sparse,k] (routing replay)."""
    model = bind(config, params)
    cos, sin = rope_tables(config, position[:, None])
    sliding, sparse = config.sliding_layers(), config.sparse_layers()
    if any(sliding):
        cos_l, sin_l = rope_tables(config, position[:, None], local=True)
        key_mask_l, prefix_mask_l = window_masks(config, position, key_mask, prefix_mask)
    x = model.embed_tokens(token[:, None])
    layer_def, layer_state = nnx.split(model.layers)
    keys, values = list(cache.keys), list(cache.values)
    routing = []  # the sparse layers' experts [B, k], with record_routing
    for i in range(config.num_layers):
        if sliding[i]:
            cos_i, sin_i, key_mask_i, prefix_mask_i = cos_l, sin_l, key_mask_l, prefix_mask_l
        else:
            cos_i, sin_i, key_mask_i, prefix_mask_i = cos, sin, key_mask, prefix_mask
        if layers is None:
            state_i = jax.tree.map(lambda a: a[i], layer_state)
        else:
            state_i = jax.tree.map(lambda a: a, layer_state)
            nnx.replace_by_pure_dict(state_i, layers[i])
        layer = nnx.merge(layer_def, state_i)

        def attend(q, k, v, i=i, key_mask=key_mask_i, prefix_mask=prefix_mask_i):
            k = k.transpose(0, 2, 3, 1).astype(keys[i].dtype)  # [B, KV, hd, 1]
            v = v.swapaxes(1, 2).astype(values[i].dtype)  # [B, KV, 1, hd]
            if jnp.ndim(slot) == 0:
                k_buf = jax.lax.dynamic_update_slice(keys[i], k, (0, 0, 0, slot))
                v_buf = jax.lax.dynamic_update_slice(values[i], v, (0, 0, slot, 0))
            else:  # a write index per row (the continuous-batching engine's slots)
                k_buf = _write_rows(keys[i], k, slot, axis=3)
                v_buf = _write_rows(values[i], v, slot, axis=2)
            if earlier is None:
                k_all, v_all = (k_buf,), (v_buf,)
            elif earlier_rows is None:
                k_all, v_all = (earlier.keys[i], k_buf), (earlier.values[i], v_buf)
            else:  # rows of a pool: read where they lie (`pooled_cached_attention`)
                pooled = pooled_cached_attention(q, earlier.keys[i], earlier.values[i], earlier_rows, earlier_groups,
                                                  k_buf, v_buf, key_mask)
                return pooled, (k_buf, v_buf)
            if prefix is None:
                return cached_attention(q, k_all, v_all, key_mask), (k_buf, v_buf)
            out = prefixed_cached_attention(
                q, prefix.keys[i], prefix.values[i], prefix_mask, k_all, v_all, key_mask
            )
            return out, (k_buf, v_buf)

        x, (keys[i], values[i]), _, experts = layer.run(x, cos_i, sin_i, attend, sparse=sparse[i],
                                                         record=record_routing)
        if record_routing and sparse[i]:
            routing.append(experts[:, 0])
    h = model.final_norm(x[:, 0])
    out = (model.logits(h), KVCache(keys=tuple(keys), values=tuple(values)))
    return out + (jnp.stack(routing, axis=1),) if record_routing else out


def window_masks(
    config: ModelConfig, position: jax.Array, key_mask: jax.Array, prefix_mask: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """(key_mask, prefix_mask) of a sliding-window layer in `decode_step`: the slots of key_mask
    bool[B,C] (and prefix_mask bool[U,S]) whose keys lie less than `sliding_window` positions
    before the query's, position int[B]. A key's position is the count of valid slots before it
    along the mask (the prefix's first, with one): the cache layout of the sampler and the engine,
    whose slots are in the order of their tokens and whose RoPE positions count the real tokens.
    With a prefix, the rows of a group (B/U consecutive rows) decode at the same position (the
    sampler's groups share their prompt and step), so the prefix's window is the group's."""
    w = jnp.int32(config.sliding_window)
    key_mask = key_mask.astype(bool)
    before = 0
    local_prefix = None
    if prefix_mask is not None:
        prefix_mask = prefix_mask.astype(bool)
        u = prefix_mask.shape[0]
        prefix_pos = jnp.cumsum(prefix_mask.astype(jnp.int32), axis=-1) - 1  # [U, S]
        group_position = position.reshape(u, -1)[:, 0]
        local_prefix = prefix_mask & (group_position[:, None] - prefix_pos < w)
        before = jnp.repeat(prefix_pos[:, -1] + 1, key_mask.shape[0] // u)[:, None]  # each row's prefix length
    key_pos = before + jnp.cumsum(key_mask.astype(jnp.int32), axis=-1) - 1
    return key_mask & (position[:, None] - key_pos < w), local_prefix


def _write_rows(buffer: jax.Array, new: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    """buffer [B, ...] with new [B, ...] (size 1 along `axis`) written at index slot[b] of `axis`
    in row b (a scatter, updated in place inside a loop)."""
    update = lambda buf, x, s: jax.lax.dynamic_update_index_in_dim(buf, x, s, axis - 1)  # noqa: E731
    return jax.vmap(update)(buffer, new, slot)
