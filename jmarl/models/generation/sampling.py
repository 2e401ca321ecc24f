"""Token choice: one token per row from its next-token logits, for both engines.

`sample_token` scales the logits by the temperature, truncates (top-k, then top-p) and draws one
token per row by inverting the CDF with one uniform per row, which is much cheaper on CPU than a
Gumbel variate per vocabulary entry. Top-p works on the `lax.top_k` candidates
(`truncated_weights`), not a sort of the whole vocabulary per token. Greedy (temperature 0) takes
the first argmax. The log-prob it returns is the token's under softmax(logits / T) before
truncation (`jmarl.models.generation.spec`).

The static sampler draws each step's uniforms from fold_in(rng, step); the engine draws a
completion's N uniforms once, when its slot is filled (`row_uniforms`), so its outputs do not
depend on which slot or chunk served it (`choose_token`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TOP_P_CANDIDATES = 1024  # top-p looks at this many most likely entries (top_k's when set) before a full sort


def sample_token(
    logits: jax.Array,
    rng: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    *,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
    axis_name: str | None = None,
    uniform: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """logits float32[B,V] -> (token int32[B], log-prob float32[B] under softmax(logits / T),
    before truncation). Greedy: argmax, log-prob at T=1. Else top-k, then top-p (the smallest
    set of most likely tokens whose probability reaches top_p; `truncated_weights`), then one
    draw per row by inverse-CDF sampling (one uniform per row instead of a Gumbel per vocabulary
    entry). axis_name: the `jax.vmap` axis this runs under, if any (generate_stacked's policies),
    so that top-p's rare full-sort fallback is decided once for all of them, not a select that
    runs the sort every token. uniform float32[B] in [0, 1): the rows' draws, given (drawn from
    rng otherwise; the engine draws each completion's own, `row_uniforms`)."""
    logits = logits.astype(jnp.float32)
    scaled = logits if greedy else logits / temperature
    peak = jnp.max(scaled, axis=-1, keepdims=True)
    weights = jnp.exp(scaled - peak)  # unnormalized softmax(scaled)
    log_normalizer = peak[:, 0] + jnp.log(jnp.sum(weights, axis=-1))
    if greedy:
        token = first_argmax(scaled)
    else:
        weights = truncated_weights(scaled, weights, top_p, top_k=top_k, use_top_p=use_top_p,
                                    candidates=TOP_P_CANDIDATES, axis_name=axis_name)
        if uniform is None:
            uniform = jax.random.uniform(rng, (logits.shape[0],), jnp.float32)
        token = inverse_cdf_sample(weights, uniform)
    picked = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0]
    return token, picked - log_normalizer


def candidate_count(vocab: int, top_k: int, candidates: int) -> int:
    """How many most likely entries top-p looks at first: top_k when it truncates
    (0 < top_k < vocab), else min(vocab, candidates)."""
    return top_k if 0 < top_k < vocab else min(vocab, candidates)


def top_p_threshold(descending: jax.Array, total: jax.Array, top_p: jax.Array) -> jax.Array:
    """The top-p cut for weights sorted in descending order, descending float32[B,C] (the C
    largest weights of each row, C up to V), total float32[B,1] (each row's whole mass) ->
    float32[B,1]: the smallest weight among the entries whose mass before them (in that order)
    is below top_p * total. Entries with weight >= it are kept. Exact when the entries beyond
    the C given hold no kept entry (their mass before them, the sum of the C, reaches
    top_p * total)."""
    mass_before = jnp.cumsum(descending, axis=-1) - descending
    kept = mass_before < top_p * total
    return jnp.min(jnp.where(kept, descending, jnp.inf), axis=-1, keepdims=True)


def truncated_weights(
    scaled: jax.Array,
    weights: jax.Array,
    top_p: jax.Array,
    *,
    top_k: int,
    use_top_p: bool,
    candidates: int = TOP_P_CANDIDATES,
    axis_name: str | None = None,
) -> jax.Array:
    """scaled float32[B,V] (logits / T), weights float32[B,V] (exp(scaled - row max)) ->
    float32[B,V]: the weights with the entries outside top-k (0 < top_k < V: scaled below the
    k-th largest; ties with it are kept), then outside top-p (`top_p_threshold`), set to 0.

    No full-vocabulary sort per token: `jax.lax.top_k` takes the C = `candidate_count` most
    likely entries and top-p's cumulative sum runs over those. That is exact when top_k
    truncates (nothing else has weight, bar ties with the k-th, which share its weight) or when
    the cut falls before the last candidate (the others hold at least top_p of the mass); only
    when top_k is off and it does not (a flat distribution) does one `jax.lax.cond` sort the
    whole vocabulary instead, for every row of the batch (and every policy along `axis_name`)
    at once, as this function did for every token before."""
    vocab = scaled.shape[-1]
    truncating = 0 < top_k < vocab
    if not truncating and not use_top_p:
        return weights
    c = candidate_count(vocab, top_k, candidates)
    values, indices = jax.lax.top_k(scaled, c)
    if truncating:  # the k-th largest as a min over all k: XLA:CPU keeps a TopK, whereas [:, -1:] makes a full sort
        weights = jnp.where(scaled >= jnp.min(values, axis=-1, keepdims=True), weights, 0.0)
    if not use_top_p:
        return weights
    descending = jnp.take_along_axis(weights, indices, axis=-1)  # the c largest weights, largest first
    total = jnp.sum(weights, axis=-1, keepdims=True)
    threshold = top_p_threshold(descending, total, top_p)
    if not truncating and c < vocab:
        # The cut reaches the last candidate (the candidates before it hold less than top_p): it may lie beyond.
        short = jnp.sum((threshold[:, 0] <= descending[:, -1]).astype(jnp.int32))
        if axis_name is not None:
            short = jax.lax.psum(short, axis_name)
        threshold = jax.lax.cond(
            short > 0,
            lambda: top_p_threshold(-jnp.sort(-weights, axis=-1), total, top_p),
            lambda: threshold,
        )
    return jnp.where(weights >= threshold, weights, 0.0)


def first_argmax(x: jax.Array) -> jax.Array:
    """int32[B]: the first index of the maximum of each row of x [B,V] (two plain reductions,
    which XLA:CPU runs much faster than argmax's (value, index) reduction)."""
    iota = jnp.arange(x.shape[-1], dtype=jnp.int32)
    is_max = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(is_max, iota, x.shape[-1]), axis=-1).astype(jnp.int32)


def inverse_cdf_sample(weights: jax.Array, uniform: jax.Array, block: int = 256) -> jax.Array:
    """Index i drawn with probability weights[b, i] / sum(weights[b]) for weights float32[B,V]
    >= 0 and uniform float32[B] in [0, 1) -> int32[B]. Entries of weight 0 are never drawn.

    Two levels: a cumulative sum over blocks of `block` entries picks the block, a cumulative
    sum inside that block picks the entry (no full-vocabulary scan)."""
    b, v = weights.shape
    block = min(block, v)
    num_blocks = -(-v // block)
    blocks = jnp.pad(weights, ((0, 0), (0, num_blocks * block - v))).reshape(b, num_blocks, block)
    block_mass = jnp.sum(blocks, axis=-1)
    cum = jnp.cumsum(block_mass, axis=-1)
    target = uniform * cum[:, -1]
    block_ids = jnp.arange(num_blocks, dtype=jnp.int32)
    chosen = jnp.sum(cum <= target[:, None], axis=-1).astype(jnp.int32)
    last_nonempty = jnp.max(jnp.where(block_mass > 0, block_ids, 0), axis=-1)
    chosen = jnp.minimum(chosen, last_nonempty)  # only reachable through rounding at the top end
    before = jnp.where(chosen > 0, jnp.take_along_axis(cum, jnp.maximum(chosen - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inside = jnp.take_along_axis(blocks, chosen[:, None, None], axis=1)[:, 0]
    entry = jnp.sum(jnp.cumsum(inside, axis=-1) <= (target - before)[:, None], axis=-1).astype(jnp.int32)
    last_positive = jnp.max(jnp.where(inside > 0, jnp.arange(block, dtype=jnp.int32), 0), axis=-1)
    return chosen * block + jnp.minimum(entry, last_positive)


def row_uniforms(rng: jax.Array, request: jax.Array, completion: jax.Array, steps: int) -> jax.Array:
    """float32[R, steps]: the draws of tokens 0 .. steps-1 of completion (request, completion) of
    each row: uniform(fold_in(fold_in(rng, request), completion), (steps,)). Made once per slot
    fill, so a decode step only reads its column."""

    def one(r, j):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(rng, r), j), (steps,), jnp.float32)

    return jax.vmap(one)(request, completion)


def choose_token(logits: jax.Array, rng: jax.Array, uniform: jax.Array, temperature: jax.Array, top_p: jax.Array, *,
                 greedy: bool, top_k: int, use_top_p: bool) -> tuple[jax.Array, jax.Array]:
    """`sample_token` of logits float32[R, V] with the rows' own draws uniform float32[R] (the
    engine's, `row_uniforms`; unused when greedy) -> (token int32[R], log-prob float32[R])."""
    return sample_token(logits, rng, temperature, top_p, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                        uniform=None if greedy else uniform)
