"""Rotary position embeddings: the frequencies of a config, their scaling, the cos/sin tables of
token positions, and the rotation.

The inverse frequencies follow the config's RoPE fields (`inv_frequencies`): plain, or scaled
as transformers scales them (linear, Llama 3.1's wavelength blend, YaRN's ramp between
interpolated and extrapolated frequencies, YaRN's attention factor on cos/sin:
`rope_attention_scaling`); Gemma 3's sliding layers use their own unscaled theta (local). The
layout is HF's `rotate_half` (the two halves of head_dim rotated as pairs).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmarl.models.config import ModelConfig


ROPE_TABLE_MAX_BYTES = 4 << 20


def inv_frequencies(config: ModelConfig, local: bool = False) -> np.ndarray:
    """RoPE inverse frequencies float32[head_dim // 2], scaled as `rope_type` says. local: those
    of the sliding-window layers (theta `rope_local_theta`, never scaled)."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.int64).astype(np.float32) / config.head_dim
    if local:
        theta = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
        return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    if config.rope_type == "linear":
        return (inv_freq / np.float32(config.rope_factor)).astype(np.float32)
    if config.rope_type == "llama3":
        return _llama3_scaled(inv_freq, config)
    if config.rope_type == "yarn":
        return _yarn_inv_freq(config)
    return inv_freq


def rope_attention_scaling(config: ModelConfig, local: bool = False) -> float:
    """The factor transformers puts on RoPE's cos and sin (its `attention_scaling`): YaRN's
    attention factor (`rope_attention_factor`, by default 0.1 ln(factor) + 1 for factor > 1),
    1.0 for every other type and for the sliding-window layers (local)."""
    if local or config.rope_type != "yarn":
        return 1.0
    if config.rope_attention_factor is not None:
        return float(config.rope_attention_factor)
    return yarn_mscale(config.rope_factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context `factor` (transformers' `get_mscale`):
    0.1 * mscale * ln(factor) + 1, or 1 when factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(config: ModelConfig) -> np.ndarray:
    """YaRN inverse frequencies float32[head_dim // 2], transformers' `_compute_yarn_parameters`
    step by step in float32: the frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by factor), those that turn more than beta_fast
    times are kept (extrapolated), and a linear ramp over the dimensions blends the two between."""
    dim, base = config.head_dim, float(config.rope_theta)
    original = config.rope_original_max_position

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(config.rope_beta_fast), correction_dim(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(config.rope_factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)  # 1: extrapolated (kept), 0: interpolated
    return (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend in between."""
    factor = np.float32(config.rope_factor)
    low, high = np.float32(config.rope_low_freq_factor), np.float32(config.rope_high_freq_factor)
    old_len = np.float32(config.rope_original_max_position)
    wavelen = np.float32(2 * math.pi) / inv_freq
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, blended, scaled).astype(np.float32)


def rope_tables(
    config: ModelConfig, positions: jax.Array, num_positions: int | None = None, *, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """positions int[B,T] -> (cos, sin) float32[B,T,head_dim] (HF `rotate_half` layout). local:
    the sliding-window layers' tables (`inv_frequencies(local=True)`).

    num_positions: a static bound on the positions (each < num_positions). Given, and the two
    tables [num_positions, head_dim] within ROPE_TABLE_MAX_BYTES, cos and sin are computed once
    per position at trace time and gathered: computed in the program instead, XLA fuses them into
    every consumer and evaluates them again for each head of each layer (on CPU, cos and sin then
    take most of the time of the fusions that apply the rotation). Both are multiplied by
    `rope_attention_scaling` (YaRN's attention factor; 1 otherwise), as transformers does."""
    inv_freq = inv_frequencies(config, local)
    scale = rope_attention_scaling(config, local)
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
