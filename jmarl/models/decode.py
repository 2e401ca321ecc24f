"""The KV-cache pair of the model's pure API: `prefill` (a prompt's keys/values into the cache and
its last slot's logits) and `decode_step` (one new token per row, written to the cache, attending
to it), with the sliding-window masks of the decode step: over a cache that keeps every slot
(`window_masks`), or over a windowed one whose sliding layers hold only the window as rings
(`Ring`, `ring_prompt`, `ring_mask`, `window_block_mask`; `jmarl.models.kv_cache`).

Like the forward API of `jmarl.models.model`, both take the parameters as a plain dict and
rebuild the modules inside the trace (`model.bind`). The cache layout is `jmarl.models.kv_cache`;
the attention over it, `jmarl.models.cached_attention`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jmarl.models.cached_attention import cached_attention, pooled_cached_attention, prefixed_cached_attention
from jmarl.models.config import ModelConfig
from jmarl.models.kv_cache import KVCache
from jmarl.models.model import Params, bind
from jmarl.models.rope import rope_tables


@struct.dataclass
class Ring:
    """How `decode_step` writes and reads the sliding-window layers of a windowed cache
    (`jmarl.models.kv_cache.empty_cache(..., windowed=True)`), whose buffers hold only the
    window, R slots used as a ring. slot: the ring slot the new token's keys/values go to, a
    scalar or int[B] (generated token j: j mod R); key_mask bool[B, R0 + R]: the slots the query
    sees, over the layer's `earlier` block (R0 slots: a pool entry's last slots; none where
    that block is None) then its ring (`ring_mask`, `window_block_mask`); prefix_mask
    bool[U, Sp]: over the prefix's buffers of the layer (its last Sp slots), with a prefix.
    The masks keep only keys within the window of the query: no position counting is left
    to `decode_step` (a ring holds the window and nothing older)."""

    slot: jax.Array
    key_mask: jax.Array
    prefix_mask: jax.Array | None = None


def prefill(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array,
    cache: KVCache,
    rows: jax.Array | None = None,
    *,
    record_routing: bool = False,
    ring: bool = False,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
    """Runs the prompt tokens [U,S] through the model; writes their keys/values to cache slots
    [0, S) and returns (float32 logits of the last slot [B,V], cache). Prompts should be
    left-padded so every row's last real token sits in slot S-1. Without `rows`, U = B; with
    rows int[B], cache row b receives prompt rows[b] (identical prompts are computed once).
    record_routing (a model with experts): a third item, the experts each prompt token ran in
    each sparse layer, int32[U,S,num_sparse,k] (one per prompt, not per row; routing replay).

    ring: the cache is windowed (`jmarl.models.kv_cache`): a sliding layer's buffer of R slots
    receives the prompt's last min(S, R) slots, ending at its last slot (prompt slot k in ring
    slot (k - S) mod R); the other layers' buffers receive slots [0, S) as without it."""
    model = bind(config, params)
    h, (keys, values), *routing = model.hidden(tokens, attention_mask, return_kv=True, last_only=True,
                                               record_routing=record_routing)
    h = h[:, -1]
    if rows is not None:
        keys, values, h = keys[:, rows], values[:, rows], h[rows]
    dtype = jnp.dtype(config.compute_dtype)
    rings = config.sliding_layers() if ring else (False,) * config.num_layers
    s = tokens.shape[1]

    def write(buffers: tuple[jax.Array, ...], new: jax.Array, axis: int) -> tuple[jax.Array, ...]:
        """new [L, B, ...] (S slots along `axis` of a layer's buffer) into each layer's buffer."""
        out = []
        for i, buf in enumerate(buffers):
            layer, start = new[i].astype(dtype), 0
            if rings[i]:  # the last m slots, ending at the ring's last slot
                m = min(s, buf.shape[axis])
                layer, start = jax.lax.slice_in_dim(layer, s - m, s, axis=axis), buf.shape[axis] - m
            index = [0] * buf.ndim
            index[axis] = start
            out.append(jax.lax.dynamic_update_slice(buf, layer, tuple(index)))
        return tuple(out)

    keys = keys.transpose(0, 1, 3, 4, 2)  # [L, B, S, KV, hd] -> [L, B, KV, hd, S]
    values = values.swapaxes(2, 3)  # -> [L, B, KV, S, hd]
    cache = KVCache(keys=write(cache.keys, keys, 3), values=write(cache.values, values, 2))
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
    ring: Ring | None = None,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
    """One new token per row: token int[B] at RoPE position int[B], written to cache slot `slot`
    (a scalar shared by all rows, or int[B]: one slot per row); attends to the cache slots where
    key_mask bool[B,C] is True (the slot itself included). Returns (float32 logits [B,V], updated cache).

    `earlier`: a read-only cache whose C0 slots come before `cache`'s (key_mask is then
    bool[B, C0 + C]): the first phase's block of a decode loop in two phases (`jmarl.models.generation.static`).
    With `earlier_rows` int[B], `earlier` holds Q rows (a pool of prompt caches) and row b reads
    its row earlier_rows[b] in place (`pooled_cached_attention`; `earlier_groups`: the pool's
    groups, e.g. one per device: the continuous engine's prompts shared by their completions).

    With `prefix` (a [U, ...] KV cache of U shared prompts, U dividing B, and prefix_mask
    bool[U,S]) rows b = u*G .. u*G+G-1 (G = B/U) also attend to prompt u's keys/values, which are
    stored once per group instead of once per row (a GRPO group reads its prompt's cache once).

    Layers run as an unrolled Python loop over per-layer cache buffers, so each buffer is updated
    in place and read directly by the attention (no per-step copy of the cache).

    Sliding-window layers (Gemma 3) rotate by the local RoPE tables. Without `ring` the cache
    keeps every slot on them and they attend to the slots of key_mask (and prefix_mask) within
    the window of `position`, the keys' positions counted along the mask's slots
    (`window_masks`). With `ring` (a windowed cache, `jmarl.models.kv_cache`) their buffers hold
    only the window: the new token goes to ring slot ring.slot and they attend with ring's
    masks (`Ring`); `earlier` (and `earlier_rows`' pool) may then hold None on such a layer
    (no earlier block: a ring written through both phases of a decode loop).

    record_routing (a model with experts): a third item, the experts the new token ran in each
    sparse layer, int32[B,num_sparse,k] (routing replay)."""
    model = bind(config, params)
    cos, sin = rope_tables(config, position[:, None])
    sliding, sparse = config.sliding_layers(), config.sparse_layers()
    if any(sliding):
        cos_l, sin_l = rope_tables(config, position[:, None], local=True)
        if ring is None:
            key_mask_l, prefix_mask_l, slot_l = *window_masks(config, position, key_mask, prefix_mask), slot
        else:
            key_mask_l, prefix_mask_l, slot_l = ring.key_mask, ring.prefix_mask, ring.slot
    x = model.embed_tokens(token[:, None])
    layer_def, layer_state = nnx.split(model.layers)
    keys, values = list(cache.keys), list(cache.values)
    routing = []  # the sparse layers' experts [B, k], with record_routing
    for i in range(config.num_layers):
        if sliding[i]:
            cos_i, sin_i, key_mask_i, prefix_mask_i, slot_i = cos_l, sin_l, key_mask_l, prefix_mask_l, slot_l
        else:
            cos_i, sin_i, key_mask_i, prefix_mask_i, slot_i = cos, sin, key_mask, prefix_mask, slot
        earlier_i = None if earlier is None or earlier.keys[i] is None else (earlier.keys[i], earlier.values[i])
        if layers is None:
            state_i = jax.tree.map(lambda a: a[i], layer_state)
        else:
            state_i = jax.tree.map(lambda a: a, layer_state)
            nnx.replace_by_pure_dict(state_i, layers[i])
        layer = nnx.merge(layer_def, state_i)

        def attend(q, k, v, i=i, key_mask=key_mask_i, prefix_mask=prefix_mask_i, slot=slot_i, earlier=earlier_i):
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
                k_all, v_all = (earlier[0], k_buf), (earlier[1], v_buf)
            else:  # rows of a pool: read where they lie (`pooled_cached_attention`)
                pooled = pooled_cached_attention(q, earlier[0], earlier[1], earlier_rows, earlier_groups,
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


def ring_prompt(mask: jax.Array, ring: int) -> jax.Array:
    """mask bool[B, S] of a left-aligned prompt -> bool[B, R] (R = `ring`): the prompt's slots
    as a ring of R slots holds them after `prefill(..., ring=True)`: ring slot r holds prompt
    slot S - R + r (False where that lies before slot 0: a generated token's slot to be)."""
    return jnp.pad(mask.astype(bool), ((0, 0), (ring, 0)))[:, -ring:]


def ring_mask(written: jax.Array, prompt: jax.Array) -> jax.Array:
    """bool[B, R]: the slots of a ring (a windowed sliding layer's buffer, R slots) that hold
    keys the query sees once `written` generated tokens (a scalar or int[B], the query's own
    included) have been written at slots j mod R: slots r < written hold generated tokens
    (the last R, all within the window), the others still what `prompt` bool[B, R] says
    (`ring_prompt`; all False for a ring of generated tokens only). A ring of R <= W slots
    holds nothing outside the window, so no position is compared."""
    r = prompt.shape[-1]
    return (jnp.arange(r)[None, :] < jnp.reshape(written, (-1, 1))) | prompt


def window_block_mask(config: ModelConfig, mask: jax.Array, written: jax.Array) -> jax.Array:
    """bool[B, Sp]: the slots of a prompt block kept to its last Sp slots (a windowed prefix or
    pool entry; mask bool[B, Sp] its real tokens, left-aligned) that a sliding layer's query
    sees once `written` generated tokens (a scalar or int[B], the query's own included) follow
    the prompt: block slot r lies Sp - r positions before the first generated token, so
    written - 1 + Sp - r before the query, which sees fewer than W = sliding_window back."""
    sp = mask.shape[-1]
    back = jnp.reshape(written, (-1, 1)) - 1 + sp - jnp.arange(sp)[None, :]
    return mask.astype(bool) & (back < int(config.sliding_window))


def _write_rows(buffer: jax.Array, new: jax.Array, slot: jax.Array, axis: int) -> jax.Array:
    """buffer [B, ...] with new [B, ...] (size 1 along `axis`) written at index slot[b] of `axis`
    in row b (a scatter, updated in place inside a loop)."""
    update = lambda buf, x, s: jax.lax.dynamic_update_index_in_dim(buf, x, s, axis - 1)  # noqa: E731
    return jax.vmap(update)(buffer, new, slot)
