"""The platform kernel forms of `jmarl.models.attention.attention`: cuDNN flash attention (CUDA
GPUs, through `jax.nn.dot_product_attention`) and the Pallas splash-attention kernel (TPU).

Each takes right-padded rows (q [B,T,H,hd], k/v [B,S,KV,hd], lengths int[B]) and a `fallback`
form with the same arguments, which it runs for any shape or dtype it refuses
(`cudnn_supports`, `splash_supports`) or when this JAX lacks the kernel. The cuDNN form can be
lowered for CUDA from a host without cuDNN (`jax.export`, AOT compilation).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def cudnn_supports(q: jax.Array, k: jax.Array) -> bool:
    """Whether cuDNN flash attention takes these shapes/dtypes (bf16/f16, head_dim <= 128, a
    multiple of 8)."""
    hd = q.shape[-1]
    return q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and hd <= 128 and hd % 8 == 0


def cudnn_or(fallback: Callable, q, k, v, lengths, causal: bool):
    """cuDNN flash attention where it applies, else `fallback(q, k, v, lengths)`."""
    if not cudnn_supports(q, k):
        return fallback(q, k, v, lengths)
    b, t = q.shape[:2]
    # computed from lengths so that it is batched like them under jax.vmap (a stacked policy
    # axis): JAX's cuDNN batching rule needs both sequence-length arrays batched
    q_lengths = lengths * 0 + t
    kwargs = dict(is_causal=causal, query_seq_lengths=q_lengths, key_value_seq_lengths=lengths, implementation="cudnn")
    with _cudnn_version_for_lowering() as available:
        if not available:
            return fallback(q, k, v, lengths)
        return jax.nn.dot_product_attention(q, k, v, **kwargs)


class _cudnn_version_for_lowering:
    """Lets the cuDNN form be lowered for CUDA from a process without cuDNN (AOT compilation or
    `jax.export` from a CPU host): JAX asks cuDNN for its version while tracing, so there the
    version is taken as ASSUMED_CUDNN_VERSION (9.8). On a GPU host nothing is changed. Yields
    False when this JAX has no such hook (the caller then falls back to blockwise)."""

    ASSUMED_CUDNN_VERSION = 90800

    def __enter__(self) -> bool:
        self._module, self._saved = None, None
        try:
            from jax._src.cudnn import fused_attention_stablehlo as module
        except ImportError:
            return False
        try:
            module.check_cudnn_version()
            return True
        except RuntimeError:
            pass
        if not hasattr(module, "check_cudnn_version"):
            return False
        self._module, self._saved = module, module.check_cudnn_version
        module.check_cudnn_version = lambda: self.ASSUMED_CUDNN_VERSION
        return True

    def __exit__(self, *exc: Any) -> None:
        if self._module is not None:
            self._module.check_cudnn_version = self._saved


def _splash_block(n: int) -> int | None:
    """The largest splash block (512, 256, 128) dividing n, or None."""
    return next((blk for blk in (512, 256, 128) if n % blk == 0), None)


def splash_supports(q: jax.Array, k: jax.Array) -> bool:
    """Whether the splash kernel takes these shapes (T and S multiples of 128, head_dim a
    multiple of 128 or 64)."""
    return _splash_block(q.shape[1]) is not None and _splash_block(k.shape[1]) is not None and q.shape[-1] % 64 == 0


def splash_or(fallback: Callable, q, k, v, lengths, causal: bool):
    """Pallas splash attention (TPU) where it applies, else `fallback(q, k, v, lengths)`."""
    if not splash_supports(q, k):
        return fallback(q, k, v, lengths)
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
    except ImportError:
        return fallback(q, k, v, lengths)
    b, t, h, hd = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    bq, bk = _splash_block(t), _splash_block(s)
    one = mask_lib.CausalMask((t, s)) if causal else mask_lib.FullMask((t, s))
    blocks = kernel_lib.BlockSizes(
        block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
        block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk,
    )
    kernel = kernel_lib.make_splash_mqa_single_device(mask_lib.MultiHeadMask([one] * g), block_sizes=blocks)
    # padding as segment ids: valid slots 1, padding 0 (a query sees keys of its own segment)
    q_seg = (jnp.arange(t)[None] < lengths[:, None]).astype(jnp.int32) if causal else jnp.ones((b, t), jnp.int32)
    kv_seg = (jnp.arange(s)[None] < lengths[:, None]).astype(jnp.int32)

    def one_head_group(qh, kh, vh, qs, ks):  # [G,T,hd], [S,hd], [S,hd]
        return kernel(qh, kh, vh, segment_ids=kernel_lib.SegmentIds(q=qs, kv=ks))

    qg = (q * jnp.asarray(hd**-0.5, q.dtype)).reshape(b, t, kvh, g, hd).transpose(0, 2, 3, 1, 4)
    per_group = jax.vmap(one_head_group, in_axes=(0, 0, 0, None, None))
    out = jax.vmap(per_group)(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), q_seg, kv_seg)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd).astype(q.dtype)
