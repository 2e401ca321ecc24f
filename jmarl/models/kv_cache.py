"""The KV cache: its layout (`KVCache`, per-layer key/value buffers), its constructors and the
row gather of a pool of cache rows (`take_rows`).

Keys are stored transposed, [B, KV, head_dim, C], so the query-key product reads them in their
natural layout; values [B, KV, C, head_dim] (C = capacity, in the compute dtype). The logical
axes of both buffers are declared with the model's others (`jmarl.models.model.cache_axes`).
The decode step that writes and reads them is `jmarl.models.decode`; the attention forms over
them, `jmarl.models.cached_attention`.
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
        """C, the number of token slots."""
        return int(self.values[0].shape[2])


def init_cache(config: ModelConfig, batch_size: int, capacity: int) -> KVCache:
    """Zeroed KV cache for `batch_size` rows of up to `capacity` tokens."""
    return empty_cache(config, (batch_size,), capacity)


def empty_cache(config: ModelConfig, leading: tuple[int, ...], capacity: int) -> KVCache:
    """Zeroed KV cache whose buffers have the batch shape `leading` (e.g. (P, B) when stacked)."""
    kv, hd, dtype = config.num_kv_heads, config.head_dim, jnp.dtype(config.compute_dtype)
    layers = range(config.num_layers)
    return KVCache(
        keys=tuple(jnp.zeros(leading + (kv, hd, capacity), dtype) for _ in layers),
        values=tuple(jnp.zeros(leading + (kv, capacity, hd), dtype) for _ in layers),
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
