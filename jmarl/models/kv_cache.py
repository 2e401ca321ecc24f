"""The KV cache: its layout (`KVCache`, per-layer key/value buffers), its constructors and the
row gather of a pool of cache rows (`take_rows`).

Keys are stored transposed, [B, KV, head_dim, C], so the query-key product reads them in their
natural layout; values [B, KV, C, head_dim] (C = capacity, in the compute dtype). The logical
axes of both buffers are declared with the model's others (`jmarl.models.model.cache_axes`).
The decode step that writes and reads them is `jmarl.models.decode`; the attention forms over
them, `jmarl.models.cached_attention`.

Windowed caches (`empty_cache(..., windowed=True)`, what the sampler and the engine allocate):
a sliding-window layer (Gemma 3's local layers) sees only the last W = `sliding_window`
positions, so its buffers hold R = min(C, W) slots instead of C (`layer_capacities`), used as a
ring: a block's slot k lives in ring slot (k - S) mod R, S the block's slots before its
generated ones (a prompt's last min(S, R) slots end at the ring's last slot, generated token j
is written at j mod R over the token W positions before it). The full layers keep C slots.
`jmarl.models.decode.Ring` says how a decode step reads and writes such a layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jmarl.models.config import ModelConfig


@struct.dataclass
class KVCache:
    """Per-layer buffers in the compute dtype (C = capacity): keys [B, KV, head_dim, C] (stored
    transposed, so the query-key product reads them in their natural layout), values
    [B, KV, C, head_dim]."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]

    @property
    def capacity(self) -> int:
        """C, the number of token slots (of the full layers; a windowed cache's sliding layers
        may hold fewer, `capacities`)."""
        return max(self.capacities)

    @property
    def capacities(self) -> tuple[int, ...]:
        """The token slots of each layer's buffers."""
        return tuple(int(v.shape[-2]) for v in self.values)


def init_cache(config: ModelConfig, batch_size: int, capacity: int) -> KVCache:
    """Zeroed KV cache for `batch_size` rows of up to `capacity` tokens."""
    return empty_cache(config, (batch_size,), capacity)


def window_capacity(config: ModelConfig, capacity: int) -> int:
    """R = min(capacity, sliding_window): the slots a windowed cache's sliding layer holds for
    `capacity` positions (`capacity` without a window)."""
    return int(capacity) if config.sliding_window is None else min(int(capacity), int(config.sliding_window))


def layer_capacities(config: ModelConfig, capacity: int, windowed: bool = False) -> tuple[int, ...]:
    """Per layer, the token slots of a cache of `capacity` positions: `capacity` on every layer,
    or with `windowed` `window_capacity` on the sliding-window layers (rings, the module
    docstring)."""
    ring = window_capacity(config, capacity) if windowed else int(capacity)
    return tuple(ring if sliding else int(capacity) for sliding in config.sliding_layers())


def empty_cache(config: ModelConfig, leading: tuple[int, ...], capacity: int, windowed: bool = False) -> KVCache:
    """Zeroed KV cache whose buffers have the batch shape `leading` (e.g. (P, B) when stacked),
    `capacity` slots per layer, or with `windowed` only the window's on the sliding layers
    (`layer_capacities`)."""
    kv, hd, dtype = config.num_kv_heads, config.head_dim, jnp.dtype(config.compute_dtype)
    caps = layer_capacities(config, capacity, windowed)
    return KVCache(
        keys=tuple(jnp.zeros(leading + (kv, hd, c), dtype) for c in caps),
        values=tuple(jnp.zeros(leading + (kv, c, hd), dtype) for c in caps),
    )


def take_rows(buffer: jax.Array, rows: jax.Array, groups: int = 1) -> jax.Array:
    """buffer [Q, ...], rows int[B] -> [B, ...]: row b is buffer[g * Q/G + rows[b]] where g is the
    group of b (b // (B/G), G = `groups`); rows are indices within the group's Q/G rows. Taken
    as one batched gather over the groups, so with Q and B split over G devices in order each
    device gathers only from its own part of the buffer."""
    q, b = buffer.shape[0], rows.shape[0]
    parts = buffer.reshape((groups, q // groups) + buffer.shape[1:])
    taken = jax.vmap(lambda part, idx: part[idx])(parts, rows.reshape(groups, b // groups))
    return taken.reshape((b,) + buffer.shape[1:])
