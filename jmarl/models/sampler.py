"""KV-cache sampler: `generate` (one policy) and `generate_stacked` (P policies, one call).

One compiled program per (static settings, bucketed prompt length, batch size): prefill writes
the prompt's keys/values into a preallocated, donated KV cache, then a `lax.while_loop` decodes
one token per row per step until every row has emitted a stop token or `max_new_tokens` is
reached. No Python runs per token and nothing returns to the host until the end.

Prompts are left-aligned on the host (real tokens moved to the end of the row) and left-padded
to a bucket length (`jmarl.rollouts.bucket_length`), so prompts of varied lengths reuse a few
compiled programs. Positions come from the prompt mask, so padding never shifts RoPE.

Log-probs: `Generation.logprobs[:, i]` is the log-probability of the sampled token under
softmax(logits / temperature) BEFORE top-k/top-p truncation, i.e. exactly what
`token_logprobs(..., temperature=T)` gives when re-scoring the same tokens. That is the
behaviour-policy probability the importance ratio pi_new / pi_old needs: the learner scores
tokens without truncation, so the sampler reports the same quantity. With `temperature=0`
(greedy, argmax) the log-probs are taken under temperature 1.

Many policies: `generate_stacked` takes parameters stacked on a leading policy axis [P, ...]
and prompts [P, B, S]; the program is `jax.vmap`ped over policies, so a whole multi-agent turn
is one device call. Policy p draws its randomness from `jax.random.fold_in(rng, p)`: its rows
equal `generate(config, params_p, prompts_p, masks_p, jax.random.fold_in(rng, p), ...)`.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jmarl.errors import JmarlError
from jmarl.models.config import ModelConfig
from jmarl.models.model import KVCache, Params, decode_step, prefill
from jmarl.rollouts import DEFAULT_LENGTH_BUCKETS, bucket_length

_NEG_INF = -jnp.inf
_TRACES = {"count": 0}


@struct.dataclass
class Generation:
    """Sampled completions. tokens int32[..., B, N] (pad_id after a stop), logprobs
    float32[..., B, N] (0 where masked), mask bool[..., B, N] (True up to and including the stop
    token), lengths int32[..., B] (number of True in mask)."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array


def num_compiled_programs() -> int:
    """How many generation programs have been traced (= compiled) in this process so far."""
    return _TRACES["count"]


# ---------------------------------------------------------------------------------- sampling
def sample_token(
    logits: jax.Array,
    rng: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    *,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
) -> tuple[jax.Array, jax.Array]:
    """logits float32[B,V] -> (token int32[B], log-prob float32[B] under softmax(logits / T),
    before truncation). Greedy: argmax, log-prob at T=1. Else top-k, then top-p (the smallest
    set of most likely tokens whose probability reaches top_p), then a categorical draw."""
    logits = logits.astype(jnp.float32)
    if greedy:
        token = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
    scaled = logits / temperature
    logp = jax.nn.log_softmax(scaled, axis=-1)
    allowed = scaled
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        allowed = jnp.where(scaled >= kth, allowed, _NEG_INF)
    if use_top_p:
        descending = -jnp.sort(-allowed, axis=-1)
        probs = jax.nn.softmax(descending, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        threshold = jnp.min(jnp.where(mass_before < top_p, descending, jnp.inf), axis=-1, keepdims=True)
        allowed = jnp.where(allowed >= threshold, allowed, _NEG_INF)
    token = jax.random.categorical(rng, allowed, axis=-1).astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _generate_one(
    config: ModelConfig,
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    mask: jax.Array,
    rng: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    *,
    max_new_tokens: int,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
    stop_tokens: tuple[int, ...],
    pad_id: int,
) -> tuple[Generation, KVCache]:
    """Prefill + while-loop decode for left-aligned prompts tokens/mask [B,S] (one policy).

    Returns (Generation, final cache); the cache is returned so that the donated input buffer
    is updated in place instead of copied."""
    b, s = tokens.shape
    n = max_new_tokens
    compute = jnp.dtype(config.compute_dtype)
    params = jax.tree.map(lambda a: a.astype(compute) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
    config = config.replace(param_dtype=config.compute_dtype)
    mask = mask.astype(bool)
    prompt_len = mask.sum(axis=1).astype(jnp.int32)
    stops = jnp.asarray(stop_tokens, jnp.int32)

    def choose(logits, step, done):
        token, logprob = sample_token(
            logits, jax.random.fold_in(rng, step), temperature, top_p,
            greedy=greedy, top_k=top_k, use_top_p=use_top_p,
        )
        token = jnp.where(done, pad_id, token)
        logprob = jnp.where(done, 0.0, logprob)
        return token, logprob, done | jnp.isin(token, stops)

    logits, cache = prefill(config, params, tokens, mask, cache)
    layers = [jax.tree.map(lambda a: a[i], params["layers"]) for i in range(config.num_layers)]
    not_done = jnp.zeros((b,), bool)
    token, logprob, done = choose(logits, 0, not_done)
    out_tokens = jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(token)
    out_logprobs = jnp.zeros((b, n), jnp.float32).at[:, 0].set(logprob)
    lengths = jnp.ones((b,), jnp.int32)

    def cond(carry):
        step, _, _, done, *_ = carry
        return (step < n) & ~jnp.all(done)

    def body(carry):
        step, cache, token, done, out_tokens, out_logprobs, lengths = carry
        generated = jnp.broadcast_to(jnp.arange(n - 1)[None, :] < step, (b, n - 1))
        key_mask = jnp.concatenate([mask, generated], axis=1)  # [B, S + N - 1]
        logits, cache = decode_step(
            config, params, cache, token, prompt_len + step - 1, s + step - 1, key_mask, layers
        )
        lengths = lengths + (~done).astype(jnp.int32)
        token, logprob, done = choose(logits, step, done)
        out_tokens = jax.lax.dynamic_update_slice(out_tokens, token[:, None], (0, step))
        out_logprobs = jax.lax.dynamic_update_slice(out_logprobs, logprob[:, None], (0, step))
        return step + 1, cache, token, done, out_tokens, out_logprobs, lengths

    carry = (jnp.int32(1), cache, token, done, out_tokens, out_logprobs, lengths)
    _, cache, _, _, out_tokens, out_logprobs, lengths = jax.lax.while_loop(cond, body, carry)
    out_mask = jnp.arange(n)[None, :] < lengths[:, None]
    generation = Generation(tokens=out_tokens, logprobs=out_logprobs, mask=out_mask, lengths=lengths)
    return generation, cache


@functools.lru_cache(maxsize=None)
def _program(
    config: ModelConfig,
    stacked: bool,
    max_new_tokens: int,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
    stop_tokens: tuple[int, ...],
    pad_id: int,
):
    """The jitted generation program for one set of static settings (cache donated)."""
    core = functools.partial(
        _generate_one, config, max_new_tokens=max_new_tokens, greedy=greedy, top_k=top_k,
        use_top_p=use_top_p, stop_tokens=stop_tokens, pad_id=pad_id,
    )

    def program(params, cache, tokens, mask, rng, temperature, top_p):
        _TRACES["count"] += 1  # runs once per trace, i.e. once per compiled program
        if stacked:
            rngs = jax.vmap(lambda p: jax.random.fold_in(rng, p))(jnp.arange(tokens.shape[0]))
            return jax.vmap(core, in_axes=(0, 0, 0, 0, 0, None, None))(
                params, cache, tokens, mask, rngs, temperature, top_p
            )
        return core(params, cache, tokens, mask, rng, temperature, top_p)

    return jax.jit(program, donate_argnums=(1,))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _empty_cache(config: ModelConfig, leading: tuple[int, ...], capacity: int) -> KVCache:
    shape = leading + (config.num_kv_heads, capacity, config.head_dim)
    dtype = jnp.dtype(config.compute_dtype)
    layers = range(config.num_layers)
    return KVCache(
        keys=tuple(jnp.zeros(shape, dtype) for _ in layers),
        values=tuple(jnp.zeros(shape, dtype) for _ in layers),
    )


# ---------------------------------------------------------------------------------- host side
def left_align(
    tokens: np.ndarray, mask: np.ndarray, length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Moves each row's real tokens (mask True, order kept) to the end of a [..., length] row;
    returns (tokens int32[..., length], mask bool[..., length])."""
    lead = tokens.shape[:-1]
    tokens = tokens.reshape(-1, tokens.shape[-1])
    mask = mask.reshape(-1, mask.shape[-1])
    counts = mask.sum(axis=1)
    order = np.argsort(~mask, axis=1, kind="stable")  # real tokens first, in order
    real_first = np.take_along_axis(tokens, order, axis=1)
    source = np.arange(length)[None, :] - (length - counts[:, None])
    valid = source >= 0
    picked = np.take_along_axis(real_first, np.clip(source, 0, tokens.shape[1] - 1), axis=1)
    out = np.where(valid, picked, pad_id).astype(np.int32)
    return out.reshape(lead + (length,)), valid.reshape(lead + (length,))


def _check_options(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    if int(max_new_tokens) < 1:
        raise JmarlError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise JmarlError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise JmarlError(f"top_p must be in (0, 1], got {top_p}")
    if int(top_k) < 0:
        raise JmarlError(f"top_k must be >= 0 (0 = off), got {top_k}")


def _run(
    config: ModelConfig,
    params: Params,
    prompt_tokens,
    prompt_mask,
    rng: jax.Array,
    *,
    stacked: bool,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    stop_tokens: Sequence[int],
    pad_id: int,
    buckets: Sequence[int],
) -> Generation:
    _check_options(max_new_tokens, temperature, top_p, top_k)
    tokens = np.asarray(prompt_tokens)
    mask = np.asarray(prompt_mask).astype(bool)
    want = 3 if stacked else 2
    if tokens.ndim != want or tokens.shape != mask.shape:
        axes = "[P, B, S]" if stacked else "[B, S]"
        raise JmarlError(
            f"prompt_tokens and prompt_mask must both be {axes}; got {tokens.shape} and {mask.shape}"
        )
    if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
        raise JmarlError(f"prompt token ids must be in [0, {config.vocab_size}), the model's vocabulary")
    length = bucket_length(max(int(mask.sum(axis=-1).max(initial=0)), 1), buckets)
    tokens, mask = left_align(tokens, mask, length, pad_id)
    greedy = float(temperature) == 0.0
    program = _program(
        config, stacked, int(max_new_tokens), greedy, int(top_k), float(top_p) < 1.0,
        tuple(int(t) for t in stop_tokens), int(pad_id),
    )
    cache = _empty_cache(config, tokens.shape[:-1], length + int(max_new_tokens) - 1)
    temp = jnp.float32(1.0 if greedy else temperature)
    generation, _ = program(params, cache, tokens, mask, rng, temp, jnp.float32(top_p))
    return generation


def generate(
    config: ModelConfig,
    params: Params,
    prompt_tokens,
    prompt_mask,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
) -> Generation:
    """Samples up to max_new_tokens per prompt. prompt_tokens int[B,S], prompt_mask bool[B,S]
    (any padding side) -> Generation with [B, max_new_tokens] fields. temperature 0 = greedy;
    top_k 0 and top_p 1 disable truncation; a row stops after emitting any of stop_tokens."""
    return _run(
        config, params, prompt_tokens, prompt_mask, rng, stacked=False,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_tokens=stop_tokens, pad_id=pad_id, buckets=buckets,
    )


def generate_stacked(
    config: ModelConfig,
    stacked_params: Params,
    prompt_tokens,
    prompt_mask,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
) -> Generation:
    """P policies of one architecture in one device call: stacked_params with a leading [P]
    axis, prompt_tokens/prompt_mask [P,B,S] -> Generation with [P, B, max_new_tokens] fields.
    Policy p uses jax.random.fold_in(rng, p)."""
    return _run(
        config, stacked_params, prompt_tokens, prompt_mask, rng, stacked=True,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_tokens=stop_tokens, pad_id=pad_id, buckets=buckets,
    )
