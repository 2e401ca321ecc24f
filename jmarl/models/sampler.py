"""KV-cache sampler: `generate` (one policy) and `generate_stacked` (P policies, one call).

One compiled program per static settings and input shape (batch size, bucketed prompt length,
number of distinct prompts rounded up to a power of two): prefill writes
the prompt's keys/values into a preallocated, donated KV cache, then a `lax.while_loop` decodes
one token per row per step until every row has emitted a stop token or `max_new_tokens` is
reached. No Python runs per token and nothing returns to the host until the end.

Prompts are left-aligned on the host (real tokens moved to the end of the row) and left-padded
to a bucket length (`jmarl.padding.bucket_length`), so prompts of varied lengths reuse a few
compiled programs. Positions come from the prompt mask, so padding never shifts RoPE.
Identical prompt rows (a GRPO group repeats its prompt G times) are prefilled once. When they
come in blocks of G consecutive rows (as the trainer's sampler lays a group out), the prompt's
keys/values stay in one cache per group that its G rows attend to (each decode step reads a
group's prompt once, not G times) and the per-row cache holds only the generated tokens;
otherwise they are copied to every row of the group. Each decode step runs the layers as an
unrolled loop over per-layer cache buffers (updated in place) and per-layer parameter slices taken once
before the loop (this holds one extra copy of the layer weights while generating). The cache is
windowed (`jmarl.models.kv_cache`): a sliding-window layer (Gemma 3) holds a ring of the last
min(C, W) positions of each row (the prompt's last slots, then the generated tokens written over
them), and a group's shared prompt cache keeps its last min(S, W) slots there.
From 32 generated slots on, the decode loop runs in two phases over two cache blocks: the
first half of the steps attends to the first block only (`first_phase_slots`).
Sampling draws one uniform per row and inverts the CDF (top-k/top-p applied to the weights
first), which is much cheaper on CPU than a Gumbel variate per vocabulary entry. Top-p works on
the `lax.top_k` candidates (`truncated_weights`), not a sort of the whole vocabulary per token.

Log-probs: `Generation.logprobs[:, i]` is the log-probability of the sampled token under
softmax(logits / temperature) BEFORE top-k/top-p truncation, i.e. exactly what
`token_logprobs(..., temperature=T)` gives when re-scoring the same tokens. That is the
behaviour-policy probability the importance ratio pi_new / pi_old needs: the learner scores
tokens without truncation, so the sampler reports the same quantity. With `temperature=0`
(greedy, argmax) the log-probs are taken under temperature 1.

Many policies: `generate_stacked` takes parameters stacked on a leading policy axis [P, ...]
and prompts [P, B, S]; the program is `jax.vmap`ped over policies, so a whole multi-agent turn
is one device call. Leaves without the policy axis are shared by every policy (`policy_axes`):
per-agent LoRA adapters [P, ...] attached to one base (`jmarl.train.lora.attach_lora`) decode
with that base read once, not P merged copies of it. Policy p draws its randomness from `jax.random.fold_in(rng, p)`: its rows
equal `generate(config, params_p, prompts_p, masks_p, jax.random.fold_in(rng, p), ...)`.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jmarl.errors import JmarlError
from jmarl.models.config import ModelConfig
from jmarl.models import moe as moe_lib
from jmarl.models.decode import Ring, decode_step, prefill, ring_mask, ring_prompt, window_block_mask
from jmarl.models.kv_cache import KVCache, empty_cache, window_capacity
from jmarl.models.layers import is_lora
from jmarl.models.model import Params, cache_axes, param_shapes
from jmarl.padding import DEFAULT_LENGTH_BUCKETS, bucket_length
from jmarl import sharding

_TRACES = {"count": 0}


@struct.dataclass
class Generation:
    """Sampled completions. tokens int32[..., B, N] (pad_id after a stop), logprobs
    float32[..., B, N] (0 where masked), mask bool[..., B, N] (True up to and including the stop
    token), lengths int32[..., B] (number of True in mask).

    Routing replay (`ModelConfig.replays_routing`; None otherwise: nothing is recorded): the
    experts each token ran in each of the S sparse layers, ids in `moe.routing_dtype`:
    routing [..., B, N, S, k] of the generated tokens (token i's as the decode step that read
    it ran them; the marker `moe.no_route` where none did: a row's last token, which no step
    reads, and the slots after it), prompt_routing [..., U, S_p, S, k] of the U prefilled
    prompts (left-aligned to S_p slots, real tokens last, as `_run` lays them out) and
    prompt_row int32[..., B], the prompt of each row."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    lengths: jax.Array
    routing: jax.Array | None = None
    prompt_routing: jax.Array | None = None
    prompt_row: jax.Array | None = None


def num_compiled_programs() -> int:
    """How many generation programs have been traced (= compiled) in this process so far."""
    return _TRACES["count"]


# ---------------------------------------------------------------------------------- sampling
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
    rng otherwise; the engine draws each completion's own, `jmarl.models.engine`)."""
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


TWO_PHASES_FROM = 32  # generated slots from which the decode loop runs in two phases


def first_phase_slots(gen_slots: int) -> int:
    """Generated slots of the first phase of the decode loop: half of them (rounded up) from
    TWO_PHASES_FROM slots on, else 0 (one phase). The steps of the first half then attend to
    half the slots, so the loop reads about 3/4 of what one phase over every slot reads."""
    return -(-gen_slots // 2) if gen_slots >= TWO_PHASES_FROM else 0


def _slots(cache: KVCache, start: int, stop: int, rings: Sequence[bool]) -> KVCache:
    """Cache slots [start, stop) of every full layer (its buffer itself when that is all of it);
    the whole buffer of each layer flagged in `rings` (a windowed sliding layer's ring, which
    every phase of the decode loop writes and reads)."""
    def cut(buffers: tuple[jax.Array, ...], slot_axis: int) -> tuple[jax.Array, ...]:
        return tuple(buf if ring or (start == 0 and stop == buf.shape[slot_axis])
                     else jax.lax.slice_in_dim(buf, start, stop, axis=slot_axis)
                     for buf, ring in zip(buffers, rings))

    return KVCache(keys=cut(cache.keys, -1), values=cut(cache.values, -2))


def _without_rings(cache: KVCache, rings: Sequence[bool]) -> KVCache:
    """cache with None in place of each ring layer's buffers (`rings`): the earlier block of the
    decode loop's second phase, which on those layers is the ring the phase carries itself."""
    drop = lambda buffers: tuple(None if ring else buf for buf, ring in zip(buffers, rings))  # noqa: E731
    return KVCache(keys=drop(cache.keys), values=drop(cache.values))


def _with_rings(block: KVCache, source: KVCache, rings: Sequence[bool]) -> KVCache:
    """block with each ring layer's buffers (`rings`) taken from `source` (the first phase's
    output: the second phase goes on writing the same rings)."""
    take = lambda own, other: tuple(o if ring else b for b, o, ring in zip(own, other, rings))  # noqa: E731
    return KVCache(keys=take(block.keys, source.keys), values=take(block.values, source.values))


def _generate_one(
    config: ModelConfig,
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    mask: jax.Array,
    rows: jax.Array | None,
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
    policy_axis: str | None = None,
    group_size: int = 1,
    half: int = 0,
) -> tuple[Generation, KVCache]:
    """Prefill + while-loop decode for left-aligned prompts tokens/mask [U,S] (one policy);
    row b of the batch continues prompt rows[b] (rows None: U = B, row b continues prompt b).
    Under `jax.vmap(..., axis_name=policy_axis)` the loop stops when every row of every policy
    is done: one shared loop condition, so the vmapped loop never selects between the old and
    new carry (with a per-policy condition it would copy the whole KV cache every step).

    group_size G > 1: tokens/mask hold U distinct prompts and rows u*G .. u*G+G-1 of the B = U*G
    batch continue prompt u (rows is None); the prompts' keys/values stay in a [U, ...] cache of
    their own that each group's rows share, and `cache` holds only the generated tokens.

    half > 0: the decode loop runs in two phases, the first over `half` generated slots
    (`first_phase_slots`).

    The cache is windowed (`jmarl.models.kv_cache`; `_run` allocates it so): on sliding-window
    layers it holds a ring of R = min(C, W) slots, C its full layers' capacity; with groups,
    the prompts' cache keeps their last min(S, W) slots there. The decode steps write and read
    those layers as `decode.Ring` says; in two phases each ring is carried through both.

    Returns (Generation, final cache); the cache is returned so that the donated input buffer
    is updated in place instead of copied (when the loop runs in two phases the generated
    tokens' keys/values live in the phases' blocks and the returned cache holds the prompt's).

    With `config.replays_routing` the prefill and every decode step also return the experts
    their tokens ran, stored in the Generation's routing fields; otherwise the program has no
    such output and carries nothing for it."""
    prompt_tokens, prompt_mask = tokens, mask.astype(bool)
    if group_size > 1:
        mask = jnp.repeat(prompt_mask, group_size, axis=0)
    else:
        mask = prompt_mask if rows is None else prompt_mask[rows]
    b, s = mask.shape
    n = max_new_tokens
    compute = jnp.dtype(config.compute_dtype)
    params = jax.tree.map(lambda a: a.astype(compute) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
    config = config.replace(param_dtype=config.compute_dtype)
    prompt_len = mask.sum(axis=1).astype(jnp.int32)
    stops = jnp.asarray(stop_tokens, jnp.int32)
    record = config.replays_routing
    ids = moe_lib.routing_dtype(config.num_experts)  # the recorded ids' storage dtype

    def choose(logits, step, done):
        token, logprob = sample_token(
            logits, jax.random.fold_in(rng, step), temperature, top_p,
            greedy=greedy, top_k=top_k, use_top_p=use_top_p, axis_name=policy_axis,
        )
        token = jnp.where(done, pad_id, token)
        logprob = jnp.where(done, 0.0, logprob)
        return token, logprob, done | jnp.isin(token, stops)

    prefix = None
    if group_size > 1:
        prompt_cache = empty_cache(config, (prompt_tokens.shape[0],), s, windowed=True)
        logits, prefix, *prompt_routing = prefill(config, params, prompt_tokens, prompt_mask, prompt_cache,
                                                  record_routing=record, ring=True)
        logits = jnp.repeat(logits, group_size, axis=0)
    else:
        logits, cache, *prompt_routing = prefill(config, params, prompt_tokens, prompt_mask, cache, rows,
                                                 record_routing=record, ring=True)
    out_routing = None  # [B, N, S, k]: generated token i's experts, written by the step that reads it
    if record:
        out_routing = jnp.full((b, n, config.num_sparse_layers, config.num_experts_per_tok), moe_lib.no_route(ids), ids)
    layers = [jax.tree.map(lambda a: a[i], params["layers"]) for i in range(config.num_layers)]
    base = 0 if prefix is not None else s  # cache slots before the generated tokens' (the prompt's)
    gen_slots = cache.capacity - base
    # sliding layers: rings of R slots (generated token j at j mod R), the prompt's last slots
    # in the ring (no groups) or in the prefix's last min(S, W) slots (groups)
    rings = config.sliding_layers()
    ring_slots = window_capacity(config, cache.capacity)

    def ring_view(step: jax.Array) -> Ring | None:
        """The sliding layers' ring slot and masks at step `step` (generated token step - 1
        written); None without sliding layers."""
        if not any(rings):
            return None
        if prefix is None:  # [B, R]: the ring starts with the prompt's last slots
            return Ring(slot=(step - 1) % ring_slots, key_mask=ring_mask(step, ring_prompt(mask, ring_slots)))
        kept = prompt_mask[:, s - window_capacity(config, s):]  # [U, Sp]: the prefix's slots on sliding layers
        return Ring(slot=(step - 1) % ring_slots, key_mask=ring_mask(step, jnp.zeros((b, ring_slots), bool)),
                    prefix_mask=window_block_mask(config, kept, step))

    not_done = jnp.zeros((b,), bool)
    token, logprob, done = choose(logits, 0, not_done)
    out_tokens = jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(token)
    out_logprobs = jnp.zeros((b, n), jnp.float32).at[:, 0].set(logprob)
    lengths = jnp.ones((b,), jnp.int32)

    # Step t (1 .. n-1) writes its keys/values to cache slot base + t - 1 (ring slot (t - 1) mod R
    # on the sliding layers). In two phases (`first_phase_slots`), phase 1 writes the first `half`
    # generated slots to a block of its own (with the prompt's slots before them) and attends to
    # that block only; phase 2 writes the rest to a second block and reads both. A sliding layer's
    # ring is the whole of its buffer in both phases: phase 2 goes on with phase 1's.
    ends = [half, gen_slots] if half else [gen_slots]
    starts = [0, base + half] if half else [0]  # cache slot of each block's first slot
    earlier = None
    carry = (jnp.int32(1), token, done, out_tokens, out_logprobs, lengths, out_routing)
    for start, end in zip(starts, ends):
        block = _slots(cache, start, base + end, rings)
        if earlier is not None:  # phase 2: the rings as phase 1 left them; the earlier block without them
            block, earlier = _with_rings(block, earlier, rings), _without_rings(earlier, rings)

        def cond(carry, end=end):
            step, done = carry[0], carry[3]
            running = jnp.sum(~done)
            if policy_axis is not None:
                running = jax.lax.psum(running, policy_axis)
            return (step <= end) & (step < n) & (running > 0)

        def body(carry, start=start, end=end, earlier=earlier):
            step, block, token, done, out_tokens, out_logprobs, lengths, out_routing = carry
            generated = jnp.broadcast_to(jnp.arange(end)[None, :] < step, (b, end))  # this phase's and earlier slots
            if prefix is None:
                key_mask = jnp.concatenate([mask, generated], axis=1)  # [B, S + end]
                logits, block, *routing = decode_step(
                    config, params, block, token, prompt_len + step - 1, base + step - 1 - start, key_mask, layers,
                    earlier=earlier, record_routing=record, ring=ring_view(step),
                )
            else:  # the cache holds the generated tokens only; the prompts sit in `prefix`
                logits, block, *routing = decode_step(
                    config, params, block, token, prompt_len + step - 1, step - 1 - start, generated, layers,
                    prefix=prefix, prefix_mask=prompt_mask, earlier=earlier, record_routing=record,
                    ring=ring_view(step),
                )
            if record:  # the experts of the token this step read: generated token step - 1
                out_routing = jax.lax.dynamic_update_index_in_dim(out_routing, routing[0].astype(ids), step - 1, 1)
            lengths = lengths + (~done).astype(jnp.int32)
            token, logprob, done = choose(logits, step, done)
            out_tokens = jax.lax.dynamic_update_slice(out_tokens, token[:, None], (0, step))
            out_logprobs = jax.lax.dynamic_update_slice(out_logprobs, logprob[:, None], (0, step))
            return step + 1, block, token, done, out_tokens, out_logprobs, lengths, out_routing

        step, earlier, *rest = jax.lax.while_loop(cond, body, carry[:1] + (block,) + carry[1:])
        carry = (step, *rest)
    _, _, _, out_tokens, out_logprobs, lengths, out_routing = carry
    if not half:
        cache = earlier  # the donated buffer, updated in place
    out_mask = jnp.arange(n)[None, :] < lengths[:, None]
    generation = Generation(tokens=out_tokens, logprobs=out_logprobs, mask=out_mask, lengths=lengths)
    if record:
        # row b continues prompt rows[b], or prompt b // G of the groups, or prompt b
        prompt_row = rows if rows is not None else jnp.arange(b, dtype=jnp.int32) // group_size
        generation = generation.replace(routing=out_routing, prompt_routing=prompt_routing[0].astype(ids),
                                        prompt_row=prompt_row.astype(jnp.int32))
    return generation, cache


def generation_params(config: ModelConfig, params: Params) -> Params:
    """The parameters generation reads: floating leaves in the compute dtype, cast once per call
    (every layer casts its weights to it before use, so the numbers are the same; float32
    masters are then not read, nor gathered over an FSDP mesh, at every decode step). The cast
    is per leaf, so params of any layout (one policy, stacked over policies, LoRA adapters over
    a shared base) keep their shapes and structure."""
    dtype = jnp.dtype(config.compute_dtype)
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def policy_axes(config: ModelConfig, params: Params) -> Params:
    """The policy axis of each leaf of params stacked over policies (a `jax.vmap` in_axes tree,
    params' structure): 0 where a leaf has one axis more than `config`'s parameter at its path,
    None where it has not (held once for every policy: the base of per-agent LoRA adapters,
    whose `LoraKernel`s then have w None and a, b 0)."""

    def axes(shape: jax.ShapeDtypeStruct, leaf: Any) -> Any:
        stacked = lambda x: 0 if x.ndim > len(shape.shape) else None  # noqa: E731
        return jax.tree.map(stacked, leaf) if is_lora(leaf) else stacked(leaf)

    return jax.tree.map(axes, param_shapes(config), params)


def select_policy(config: ModelConfig, params: Params, policy: jax.Array) -> Params:
    """Policy `policy`'s parameters (int32 scalar) of params stacked over policies: its slice of
    each stacked leaf (read in place), the shared leaves as they are (`policy_axes`)."""
    return jax.tree.map(lambda p, axis: p if axis is None else jax.lax.dynamic_index_in_dim(p, policy, keepdims=False),
                        params, policy_axes(config, params))


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
    group_size: int = 1,
    half: int = 0,
    select: bool = False,
):
    """The jitted generation program for one set of static settings (cache donated). With
    `select`, params are stacked [P, ...] and the program takes a trailing int32 policy index:
    it generates with that policy alone (its rows unstacked)."""
    core = functools.partial(
        _generate_one, config, max_new_tokens=max_new_tokens, greedy=greedy, top_k=top_k,
        use_top_p=use_top_p, stop_tokens=stop_tokens, pad_id=pad_id, policy_axis="policy" if stacked else None,
        group_size=group_size, half=half,
    )

    def program(params, cache, tokens, mask, rows, rng, temperature, top_p, policy=None):
        _TRACES["count"] += 1  # runs once per trace, i.e. once per compiled program
        if select:  # one policy of a stacked group: its slice, read in place
            params = select_policy(config, params, policy)
        params = generation_params(config, params)
        if stacked:
            rngs = jax.vmap(lambda p: jax.random.fold_in(rng, p))(jnp.arange(tokens.shape[0]))
            rows_axis = None if rows is None else 0
            axes = policy_axes(config, params)
            return jax.vmap(core, in_axes=(axes, 0, 0, 0, rows_axis, 0, None, None), axis_name="policy")(
                params, cache, tokens, mask, rows, rngs, temperature, top_p
            )
        return core(params, cache, tokens, mask, rows, rng, temperature, top_p)

    return jax.jit(program, donate_argnums=(1,))


_empty_cache = jax.jit(functools.partial(empty_cache, windowed=True), static_argnums=(0, 1, 2))


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


def unique_prompts(
    tokens: np.ndarray, mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Finds repeated prompts (GRPO groups repeat each prompt G times) so the prefill runs once
    per distinct prompt. tokens/mask [..., B, S] -> (tokens [..., U, S], mask [..., U, S],
    rows int32[..., B] or None), U the number of distinct rows rounded up to a power of two
    (padded with copies of a real prompt). None (and the inputs unchanged) when U would be B."""
    *lead, b, s = tokens.shape
    flat_t = tokens.reshape(-1, b, s)
    flat_m = mask.reshape(-1, b, s)
    found = [np.unique(np.concatenate([t, m], axis=1), axis=0, return_inverse=True) for t, m in zip(flat_t, flat_m)]
    distinct = max(len(u) for u, _ in found)
    padded = 1 << (distinct - 1).bit_length()
    if padded >= b:
        return tokens, mask, None
    out_t = np.empty((len(found), padded, s), tokens.dtype)
    out_m = np.empty((len(found), padded, s), bool)
    rows = np.empty((len(found), b), np.int32)
    for i, (uniq, inverse) in enumerate(found):
        uniq = np.concatenate([uniq, np.repeat(uniq[:1], padded - len(uniq), axis=0)])
        out_t[i], out_m[i] = uniq[:, :s], uniq[:, s:].astype(bool)
        rows[i] = inverse.reshape(-1)
    shape = tuple(lead)
    return out_t.reshape(shape + (padded, s)), out_m.reshape(shape + (padded, s)), rows.reshape(shape + (b,))


def contiguous_group_size(tokens: np.ndarray, mask: np.ndarray) -> int:
    """G > 1 when every row of tokens/mask [..., B, S] lies in a block of G consecutive identical
    rows (b // G the block), as a sampler batch of prompts each repeated G times is; else 1.
    G is the length of the first run of identical rows of the first entry (of the leading axes,
    e.g. a stacked policy) whose rows are not all alike: an idle policy's rows (all padding)
    fit any G."""
    *_, b, s = tokens.shape
    rows = np.concatenate([tokens.reshape(-1, b, s), mask.reshape(-1, b, s).astype(tokens.dtype)], axis=-1)
    runs = [np.all(r == r[:1], axis=-1) for r in rows]
    mixed = [same for same in runs if not same.all()]
    g = int(np.argmin(mixed[0])) if mixed else b
    if g < 2 or b % g:
        return 1
    blocks = rows.reshape(rows.shape[0], b // g, g, 2 * s)
    return g if bool(np.all(blocks == blocks[:, :, :1])) else 1


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
    mesh: Any = None,
    policy: int | None = None,
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
    batch_shape = tokens.shape[:-1]
    group = contiguous_group_size(tokens, mask)
    if group > 1:  # groups of identical consecutive prompts: one shared prompt cache per group
        tokens, mask, rows = tokens[..., ::group, :], mask[..., ::group, :], None
        capacity = max(int(max_new_tokens) - 1, 1)
    else:
        tokens, mask, rows = unique_prompts(tokens, mask)
        capacity = length + int(max_new_tokens) - 1
    greedy = float(temperature) == 0.0
    program = _program(
        config, stacked, int(max_new_tokens), greedy, int(top_k), float(top_p) < 1.0,
        tuple(int(t) for t in stop_tokens), int(pad_id), group,
        first_phase_slots(capacity - (0 if group > 1 else length)), policy is not None,
    )
    if mesh is not None and mesh.size > 1:
        cache, (tokens, mask, rows) = placed_on_mesh(config, mesh, stacked, batch_shape, capacity, (tokens, mask, rows))
    else:
        cache = _empty_cache(config, batch_shape, capacity)
    temp = jnp.float32(1.0 if greedy else temperature)
    extra = () if policy is None else (jnp.int32(policy),)
    if policy is not None:  # the key the stacked program gives policy p
        rng = jax.random.fold_in(rng, policy)
    with sharding.mesh_context(mesh):  # the prefill keeps its rows sharded (`jmarl.models.layers.batch_sharded`)
        generation, _ = program(params, cache, tokens, mask, rows, rng, temp, jnp.float32(top_p), *extra)
    return generation


def generation_shardings(config: ModelConfig, mesh: Any, stacked: bool, batch_shape: tuple[int, ...], capacity: int,
                         prompts: tuple) -> tuple[Any, tuple]:
    """(KV cache shardings, shardings of the prompt arrays) of a generation call on `mesh`: cache
    and prompt rows over the batch axes (data, fsdp), key/value heads over tensor, a stacked
    policy axis over policy. None for an absent prompt array."""
    abstract = jax.eval_shape(lambda: empty_cache(config, batch_shape, capacity, windowed=True))
    cache_sh = sharding.shardings(mesh, sharding.cache_specs(cache_axes(abstract, stacked=stacked), abstract, mesh))
    prompt_sh = tuple(
        None if x is None else jax.sharding.NamedSharding(mesh, sharding.batch_spec(np.shape(x), mesh, stacked=stacked))
        for x in prompts)
    return cache_sh, prompt_sh


def placed_on_mesh(config: ModelConfig, mesh: Any, stacked: bool, batch_shape: tuple[int, ...], capacity: int,
                   prompts: tuple) -> tuple[KVCache, tuple]:
    """An empty KV cache created sharded on `mesh` and the prompt arrays placed there (see
    `generation_shardings`): every device holds and decodes only its rows."""
    cache_sh, prompt_sh = generation_shardings(config, mesh, stacked, batch_shape, capacity, prompts)
    cache = jax.jit(lambda: empty_cache(config, batch_shape, capacity, windowed=True), out_shardings=cache_sh)()
    placed = tuple(None if x is None else sharding.put(np.asarray(x), sh) for x, sh in zip(prompts, prompt_sh))
    return cache, placed


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
    mesh: Any = None,
    policy: int | None = None,
) -> Generation:
    """Samples up to max_new_tokens per prompt. prompt_tokens int[B,S], prompt_mask bool[B,S]
    (any padding side) -> Generation with [B, max_new_tokens] fields. temperature 0 = greedy;
    top_k 0 and top_p 1 disable truncation; a row stops after emitting any of stop_tokens.
    `mesh` (a `jax.sharding.Mesh` of several devices): the KV cache and prompt rows are sharded
    over its batch axes (data, fsdp) and key/value heads over tensor, so each device decodes its
    own rows; params keep whatever placement they have. `policy`: params are stacked [P, ...]
    per-agent policies and policy p's are used, with the key `generate_stacked` gives it (the
    same tokens as its rows there), without decoding the other policies' (padding) rows."""
    return _run(
        config, params, prompt_tokens, prompt_mask, rng, stacked=False,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_tokens=stop_tokens, pad_id=pad_id, buckets=buckets, mesh=mesh, policy=policy,
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
    mesh: Any = None,
) -> Generation:
    """P policies of one architecture in one device call: stacked_params with a leading [P]
    axis, prompt_tokens/prompt_mask [P,B,S] -> Generation with [P, B, max_new_tokens] fields.
    Policy p uses jax.random.fold_in(rng, p). `mesh`: see `generate`."""
    return _run(
        config, stacked_params, prompt_tokens, prompt_mask, rng, stacked=True,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_tokens=stop_tokens, pad_id=pad_id, buckets=buckets, mesh=mesh,
    )
