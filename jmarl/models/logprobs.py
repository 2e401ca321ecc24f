"""Log-prob heads: the log-probabilities of given tokens under the model, in each of the two
layouts it runs (right- or left-padded rows, packed rows), without the float32
[tokens, vocabulary] logits in memory: `chunked_logprobs` runs the LM head a block of positions
and of vocabulary columns at a time, with its gradient written out.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jmarl.models import moe as moe_lib
from jmarl.models.config import ModelConfig
from jmarl.models.layers import LoraKernel, is_lora
from jmarl.models.model import Params, bind, positions_from_mask

# Upper bound on the elements of one float32 logits block [B, chunk, vocab_chunk] (`chunked_logprobs`).
_LOGPROB_CHUNK_ELEMENTS = 1 << 24
# The vocabulary columns of one block: a [rows, D] x [D, 8192] product keeps a GPU's matrix units
# busy, and a 151,936-word head runs in 19 blocks.
VOCAB_CHUNK = 8192


def token_logprobs(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    attention_mask: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: int | None = None,
    with_router_stats: bool = False,
) -> jax.Array | tuple[jax.Array, moe_lib.RouterStats]:
    """float32[B,T]: out[:, t] = log p(tokens[:, t] | tokens[:, :t]) under softmax(logits / T).

    out[:, t] is 0 where token t is padding or has no real token before it (so out[:, 0] = 0).
    The LM head runs `chunk_size` positions and `VOCAB_CHUNK` vocabulary columns at a time
    (`chunked_logprobs`), recomputed in the backward pass, so memory stays O(B * chunk *
    VOCAB_CHUNK) for the forward and the gradient.
    with_router_stats: (out, `moe.RouterStats` over the real tokens), from the same forward pass,
    differentiable: a loss adds `config.router_aux_loss_coef * moe.load_balancing_loss(stats)`.
    """
    model = bind(config, params)
    h, stats = model.hidden(tokens, attention_mask, router_stats=with_router_stats)
    b, t = tokens.shape
    if t == 1:
        out = jnp.zeros((b, t), jnp.float32)
        return (out, stats) if with_router_stats else out
    lp = chunked_logprobs(model.head_master(), h[:, :-1], tokens[:, 1:], temperature, chunk_size=chunk_size,
                          compute_dtype=config.compute_dtype)
    out = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), lp], axis=1)
    mask = attention_mask.astype(bool)
    has_context = mask & (positions_from_mask(attention_mask) > 0)
    out = jnp.where(has_context, out, 0.0)
    return (out, stats) if with_router_stats else out


def packed_token_logprobs(
    config: ModelConfig,
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    segment: jax.Array,
    branch: jax.Array,
    source: jax.Array,
    target: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: int | None = None,
    with_router_stats: bool = False,
    routing: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, moe_lib.RouterStats]:
    """float32[M]: out[m] = log p(target[m] | the sequence up to packed slot source[m]) under
    softmax(logits / T), for packed rows tokens/positions/segment/branch int[R,T]
    (`Transformer.hidden_packed`) and M predictions source int[M] (flat slots, r * T + t) and
    target int[M]. A prompt's last slot is the source of each of its continuations' first
    token, so the LM head runs over the M predictions, not over padded [N, C] slots.
    with_router_stats: (out, `moe.RouterStats` over the packed slots of segment != 0: a prompt
    counted once, not once per continuation). routing: recorded expert ids [R,T,S,k] of each
    slot in the S sparse layers (routing replay; `moe.no_route` where a slot has none): the
    experts run there instead of the router's top k, weighted by the router (`moe.replay_route`);
    the stats then count the recorded pairs whose own top k differs (`moe.mismatch_fraction`)."""
    model = bind(config, params)
    h = model.hidden_packed(tokens, positions, segment, branch, router_stats=with_router_stats, routing=routing)
    h, stats = h if with_router_stats else (h, None)
    h = h.reshape(-1, h.shape[-1])[source.astype(jnp.int32)]
    lp = chunked_logprobs(model.head_master(), h[None], target.astype(jnp.int32)[None], temperature,
                          chunk_size=chunk_size, compute_dtype=config.compute_dtype)
    return (lp[0], stats) if with_router_stats else lp[0]


def chunked_logprobs(
    kernel: jax.Array | LoraKernel,
    h: jax.Array,
    targets: jax.Array,
    temperature: float | jax.Array = 1.0,
    *,
    chunk_size: int | None = None,
    vocab_chunk: int | None = None,
    compute_dtype: str | None = None,
) -> jax.Array:
    """float32[B,n]: log softmax(h @ kernel / T)[targets] for hidden h [B,n,D], kernel [D,V]
    (an array, or a `LoraKernel`), targets int[B,n], without the [B, n, V] float32 logits.

    Positions run `chunk_size` at a time (`jax.lax.map`); within a chunk the vocabulary runs
    `vocab_chunk` columns at a time (default VOCAB_CHUNK) with an online log-sum-exp, so the
    largest logits block is [B, chunk, vocab_chunk] (by default chunk is as many positions as
    keep it under 2**24 elements). The gradient is written out (`_head_logprobs`): it
    recomputes each block's logits from h and the kernel rather than saving them. Products run
    in `compute_dtype` (default: the kernel's) accumulating in float32; the kernel's gradient
    accumulates over the blocks in the kernel's own dtype (float32 masters)."""
    b, n, _ = h.shape
    v = kernel.shape[-1]
    vc = max(1, min(v, vocab_chunk or VOCAB_CHUNK))
    if chunk_size is None:
        chunk_size = max(1, min(n, _LOGPROB_CHUNK_ELEMENTS // (b * vc)))
    num_chunks = -(-n // chunk_size)
    pad = num_chunks * chunk_size - n
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad)))
    h_chunks = h.reshape(b, num_chunks, chunk_size, -1).swapaxes(0, 1).reshape(num_chunks, b * chunk_size, -1)
    target_chunks = targets.reshape(b, num_chunks, chunk_size).swapaxes(0, 1).reshape(num_chunks, b * chunk_size)
    dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else jnp.dtype(kernel.dtype)
    if is_lora(kernel):
        w, a, up, scale = jax.lax.stop_gradient(kernel.w), kernel.a, kernel.b, kernel.scale
    else:
        w, a, up, scale = kernel, None, None, 1.0
    temperature = jnp.asarray(temperature, jnp.float32)
    head = functools.partial(_head_logprobs, vc, dtype, scale)
    lp = jax.lax.map(lambda xs: head(xs[0], xs[1], w, a, up, temperature), (h_chunks, target_chunks))
    return lp.reshape(num_chunks, b, chunk_size).swapaxes(0, 1).reshape(b, -1)[:, :n]


# ---------------------------------------------------------------------------- the blocked LM head
# One chunk of positions, h [N, D] and targets [N], against the head w [D, V] (plus a low-rank
# adapter a [D, r], up [r, V] with its scale, when the head is adapted), vc vocabulary columns at
# a time. Block c covers columns [start, start + vc) with start = min(c * vc, V - vc): the last
# block is shifted back to stay inside the kernel (no padded copy of it), and the columns it
# shares with the block before are masked out (-inf logits, zero gradient).


def _block(vc: int, dtype: Any, scale: float, c: jax.Array, h: jax.Array, w: jax.Array, a: jax.Array | None,
           up: jax.Array | None, temperature: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """Block c's (start, columns int[vc] (-1 where masked), logits float32[N, vc] (-inf where
    masked), the product's operands for the gradient)."""
    v = w.shape[-1]
    start = jnp.minimum(c * vc, v - vc)
    w_c = jax.lax.dynamic_slice_in_dim(w, start, vc, axis=1).astype(dtype)
    x = h.astype(dtype)
    z = jnp.dot(x, w_c, preferred_element_type=jnp.float32)
    low = up_c = None
    if a is not None:
        low = jnp.dot(x, a.astype(dtype)) * scale  # [N, r]
        up_c = jax.lax.dynamic_slice_in_dim(up, start, vc, axis=1).astype(dtype)
        z = z + jnp.dot(low, up_c, preferred_element_type=jnp.float32)
    cols = start + jnp.arange(vc)
    cols = jnp.where(cols >= c * vc, cols, -1)
    logits = jnp.where(cols >= 0, z / temperature, -jnp.inf)
    return start, cols, logits, (x, w_c, low, up_c)


def _num_blocks(v: int, vc: int) -> int:
    return -(-v // vc)


def _forward_stats(vc, dtype, scale, h, targets, w, a, up, temperature):
    """(log-sum-exp [N], the target's logit [N]) over the vocabulary, block by block."""
    n = h.shape[0]

    def step(carry, c):
        m, s, picked = carry
        _, cols, logits, _ = _block(vc, dtype, scale, c, h, w, a, up, temperature)
        m_new = jnp.maximum(m, logits.max(-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[:, None]).sum(-1)
        picked = picked + jnp.where(cols[None] == targets[:, None], logits, 0.0).sum(-1)
        return (m_new, s, picked), None

    init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
    (m, s, picked), _ = jax.lax.scan(step, init, jnp.arange(_num_blocks(w.shape[-1], vc)))
    return m + jnp.log(s), picked


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _head_logprobs(vc: int, dtype: Any, scale: float, h: jax.Array, targets: jax.Array, w: jax.Array,
                   a: jax.Array | None, up: jax.Array | None, temperature: jax.Array) -> jax.Array:
    """float32[N]: log softmax((h @ w + scale (h @ a) @ up) / T)[targets], vc columns at a time."""
    lse, picked = _forward_stats(vc, dtype, scale, h, targets, w, a, up, temperature)
    return picked - lse


def _head_logprobs_fwd(vc, dtype, scale, h, targets, w, a, up, temperature):
    lse, picked = _forward_stats(vc, dtype, scale, h, targets, w, a, up, temperature)
    return picked - lse, (h, targets, w, a, up, temperature, lse, picked)


def _head_logprobs_bwd(vc, dtype, scale, residuals, g):
    """d out[i] / d logit[i, j] = onehot(target i)[j] - softmax[i, j]; each block's logits are
    recomputed, its share of dh, dW (and of the adapter's da, dup) added; d out / d T =
    (E_softmax[logit] - logit[target]) / T."""
    h, targets, w, a, up, temperature, lse, picked = residuals
    g = g.astype(jnp.float32)

    def step(carry, c):
        dh, dw, da, dup, expected = carry
        start, cols, logits, (x, w_c, low, up_c) = _block(vc, dtype, scale, c, h, w, a, up, temperature)
        p = jnp.exp(logits - lse[:, None])  # 0 where masked
        expected = expected + jnp.where(cols[None] >= 0, p * logits, 0.0).sum(-1)
        dz = (jnp.where(cols[None] == targets[:, None], 1.0, 0.0) - p) * (g / temperature)[:, None]
        dzc = dz.astype(dtype)
        dh = dh + jnp.dot(dzc, w_c.T, preferred_element_type=jnp.float32)
        if a is None:
            dw_c = jnp.dot(x.T, dzc, preferred_element_type=jnp.float32)
            dw = jax.lax.dynamic_update_slice_in_dim(
                dw, jax.lax.dynamic_slice_in_dim(dw, start, vc, axis=1) + dw_c.astype(dw.dtype), start, axis=1)
        else:
            d_low = jnp.dot(dzc, up_c.T, preferred_element_type=jnp.float32)  # [N, r]
            dh = dh + scale * jnp.dot(d_low.astype(dtype), a.astype(dtype).T, preferred_element_type=jnp.float32)
            da = da + scale * jnp.dot(x.T, d_low.astype(dtype), preferred_element_type=jnp.float32)
            dup_c = jnp.dot(low.T, dzc, preferred_element_type=jnp.float32)
            dup = jax.lax.dynamic_update_slice_in_dim(
                dup, jax.lax.dynamic_slice_in_dim(dup, start, vc, axis=1) + dup_c.astype(dup.dtype), start, axis=1)
        return (dh, dw, da, dup, expected), None

    n = h.shape[0]
    init = (jnp.zeros(h.shape, jnp.float32),
            jnp.zeros(w.shape, w.dtype) if a is None else None,
            None if a is None else jnp.zeros(a.shape, jnp.float32),
            None if a is None else jnp.zeros(up.shape, up.dtype),
            jnp.zeros((n,), jnp.float32))
    (dh, dw, da, dup, expected), _ = jax.lax.scan(step, init, jnp.arange(_num_blocks(w.shape[-1], vc)))
    d_temperature = jnp.sum(g * (expected - picked)) / temperature
    if a is None:
        return dh.astype(h.dtype), None, dw, None, None, d_temperature.astype(temperature.dtype)
    return dh.astype(h.dtype), None, None, da.astype(a.dtype), dup, d_temperature.astype(temperature.dtype)


_head_logprobs.defvjp(_head_logprobs_fwd, _head_logprobs_bwd)
