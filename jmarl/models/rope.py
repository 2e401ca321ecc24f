"""Rotary position embeddings: the cos/sin tables of token positions and the rotation.

The frequencies and any scaling (linear, Llama 3, YaRN; Gemma 3's local theta) come from the
config (`ModelConfig.inv_frequencies`, `rope_attention_scaling`); the layout is HF's
`rotate_half` (the two halves of head_dim rotated as pairs).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmarl.models.config import ModelConfig


ROPE_TABLE_MAX_BYTES = 4 << 20


def rope_tables(
    config: ModelConfig, positions: jax.Array, num_positions: int | None = None, *, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """positions int[B,T] -> (cos, sin) float32[B,T,head_dim] (HF `rotate_half` layout). local:
    the sliding-window layers' tables (`ModelConfig.inv_frequencies(local=True)`).

    num_positions: a static bound on the positions (each < num_positions). Given, and the two
    tables [num_positions, head_dim] within ROPE_TABLE_MAX_BYTES, cos and sin are computed once
    per position at trace time and gathered: computed in the program instead, XLA fuses them into
    every consumer and evaluates them again for each head of each layer (on CPU, cos and sin then
    take most of the time of the fusions that apply the rotation). Both are multiplied by
    `config.rope_attention_scaling` (YaRN's attention factor; 1 otherwise), as transformers does."""
    inv_freq = config.inv_frequencies(local=True) if local else config.inv_frequencies()
    scale = config.rope_attention_scaling(local)
    if num_positions is not None and 2 * num_positions * config.head_dim * 4 <= ROPE_TABLE_MAX_BYTES:
        cos, sin = _cos_sin(np, np.arange(num_positions, dtype=np.float32), inv_freq, scale)
        return jnp.take(cos, positions, axis=0, mode="clip"), jnp.take(sin, positions, axis=0, mode="clip")
    return _cos_sin(jnp, positions.astype(jnp.float32), inv_freq, scale)


def _cos_sin(xp: Any, positions: Any, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[Any, Any]:
    """float32 positions [...] -> (cos, sin) [..., head_dim] times `scale` (in float32), with
    `xp` NumPy or jax.numpy."""
    angles = positions[..., None] * xp.asarray(inv_freq)
    angles = xp.concatenate([angles, angles], axis=-1)
    if scale == 1.0:
        return xp.cos(angles), xp.sin(angles)
    factor = np.float32(scale)
    return xp.cos(angles) * factor, xp.sin(angles) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [B,T,N,hd] by cos/sin [B,T,hd]."""
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
