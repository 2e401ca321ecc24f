"""Log-prob heads: the log-probabilities of given tokens under the model, in each of the two
layouts it runs (right- or left-padded rows, packed rows), without the float32
[tokens, vocabulary] logits of a whole batch in memory at once (`chunked_logprobs`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmarl.models import moe as moe_lib
from jmarl.models.config import ModelConfig
from jmarl.models.layers import LoraKernel, cast_kernel, dense
from jmarl.models.model import Params, bind, positions_from_mask

# Upper bound on the elements of one fp32 [B, chunk, V] logits block in `token_logprobs`.
_LOGPROB_CHUNK_ELEMENTS = 1 << 24


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
    The full-vocabulary log-softmax is computed `chunk_size` positions at a time (by default as
    many as keep a [B, chunk, V] float32 block under 2**24 elements) and recomputed in the
    backward pass, so memory stays O(B * chunk * V) for the forward and the gradient.
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
    compute_dtype: str | None = None,
) -> jax.Array:
    """float32[B,n]: log softmax(h @ kernel / T)[targets] for hidden h [B,n,D], kernel [D,V],
    targets int[B,n]. The full-vocabulary log-softmax runs `chunk_size` positions at a time (by
    default as many as keep a [B, chunk, V] float32 block under 2**24 elements) and is
    recomputed in the backward pass, so memory stays O(B * chunk * V). `compute_dtype`: the
    dtype of the product (default: the kernel's); the kernel is cast inside each chunk, so its
    gradient accumulates over the chunks in the kernel's own dtype (float32 masters), not in
    the compute dtype."""
    b, n, _ = h.shape
    v = kernel.shape[-1]
    if chunk_size is None:
        chunk_size = max(1, min(n, _LOGPROB_CHUNK_ELEMENTS // (b * v)))
    num_chunks = -(-n // chunk_size)
    pad = num_chunks * chunk_size - n
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    h_chunks = h.reshape(b, num_chunks, chunk_size, -1).swapaxes(0, 1)
    target_chunks = targets.reshape(b, num_chunks, chunk_size).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_logprobs(h_c: jax.Array, t_c: jax.Array) -> jax.Array:
        dtype = jnp.dtype(compute_dtype) if compute_dtype is not None else kernel.dtype
        logits = dense(h_c.astype(dtype), cast_kernel(kernel, dtype), preferred_element_type=jnp.float32) / temperature
        picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1)

    lp = jax.lax.map(lambda xs: chunk_logprobs(*xs), (h_chunks, target_chunks))
    return lp.swapaxes(0, 1).reshape(b, -1)[:, :n]
