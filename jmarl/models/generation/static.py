"""The static KV-cache sampler: `generate` (one policy) and `generate_stacked` (P policies, one call).

Every row of a call keeps its place until the call's longest row ends (no refill: the continuous
engine, `jmarl.models.generation.engine`, refills finished rows' slots instead).

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

Many policies: `generate_stacked` takes parameters stacked on a leading policy axis [P, ...]
and prompts [P, B, S]; the program is `jax.vmap`ped over policies, so a whole multi-agent turn
is one device call. Leaves without the policy axis are shared by every policy (`policy_axes`):
per-agent LoRA adapters [P, ...] attached to one base (`jmarl.train.lora.attach_lora`) decode
with that base read once, not P merged copies of it. Policy p draws its randomness from
`jax.random.fold_in(rng, p)`: its rows equal
`generate(config, params_p, prompts_p, masks_p, jax.random.fold_in(rng, p), spec)`.

Host prep (`lay_out`): the prompts are bucketed, left-aligned (`left_align`), their groups found
(`contiguous_group_size`) or their duplicates removed (`unique_prompts`), and the program chosen
for that layout; `program_and_args` gives the same program with abstract arguments (the memory
planner's view of a call, `jmarl.train.sampling.ModelSampler.generation_program`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmarl import sharding
from jmarl.errors import JmarlError
from jmarl.models import moe as moe_lib
from jmarl.models.config import ModelConfig
from jmarl.models.decode import Ring, decode_step, prefill, ring_mask, ring_prompt, window_block_mask
from jmarl.models.generation.layout import (generation_params, generation_shardings, placed_on_mesh, policy_axes,
                                            select_policy)
from jmarl.models.generation.sampling import sample_token
from jmarl.models.generation.spec import Generation, GenerationSpec
from jmarl.models.kv_cache import KVCache, empty_cache, window_capacity
from jmarl.models.model import Params
from jmarl.padding import bucket_length

_TRACES = {"count": 0}


def num_compiled_programs() -> int:
    """How many static generation programs have been traced (= compiled) in this process so far."""
    return _TRACES["count"]


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

    The cache is windowed (`jmarl.models.kv_cache`; `lay_out` sizes it so): on sliding-window
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

@dataclass(frozen=True)
class StaticCall:
    """One static call laid out on the host (`lay_out`): the prompts left-aligned to S slots and,
    with groups, one row per group (tokens/mask [(P,) U, S], rows int32[(P,) B] or None: row b
    continues prompt rows[b]; None with groups or no duplicates), the batch shape [(P,) B] of the
    KV cache, its capacity C (slots per row), and the jitted program for that layout. The program
    takes (params, cache, tokens, mask, rows, rng, temperature, top_p[, policy])."""

    program: Callable
    tokens: np.ndarray
    mask: np.ndarray
    rows: np.ndarray | None
    batch_shape: tuple[int, ...]
    capacity: int


def lay_out(config: ModelConfig, prompt_tokens: np.ndarray, prompt_mask: np.ndarray, spec: GenerationSpec, *,
            stacked: bool, select: bool = False) -> StaticCall:
    """The host prep of a call of prompts tokens/mask [(P,) B, S'] (any padding side): bucketed
    to S = the bucket of the longest prompt (`spec.buckets`), left-aligned, groups of G identical
    consecutive rows kept as one prompt row each (`contiguous_group_size`: the prompt's cache is
    shared, C = max(N - 1, 1) generated slots per row), else duplicates prefilled once
    (`unique_prompts`, C = S + N - 1). `select`: params stacked [P, ...], one policy generated."""
    tokens = np.asarray(prompt_tokens)
    mask = np.asarray(prompt_mask).astype(bool)
    new_tokens = int(spec.max_new_tokens)
    length = bucket_length(max(int(mask.sum(axis=-1).max(initial=0)), 1), spec.buckets)
    tokens, mask = left_align(tokens, mask, length, spec.pad_id)
    batch_shape = tokens.shape[:-1]
    group = contiguous_group_size(tokens, mask)
    if group > 1:  # groups of identical consecutive prompts: one shared prompt cache per group
        tokens, mask, rows = tokens[..., ::group, :], mask[..., ::group, :], None
        capacity = max(new_tokens - 1, 1)
    else:
        tokens, mask, rows = unique_prompts(tokens, mask)
        capacity = length + new_tokens - 1
    greedy, top_k, use_top_p, stop_tokens = spec.program_sampling()
    program = _program(
        config, stacked, new_tokens, greedy, top_k, use_top_p, stop_tokens, int(spec.pad_id), group,
        first_phase_slots(capacity - (0 if group > 1 else length)), select,
    )
    return StaticCall(program, tokens, mask, rows, batch_shape, capacity)


def program_and_args(config: ModelConfig, params: Any, prompt_tokens: np.ndarray, prompt_mask: np.ndarray,
                     spec: GenerationSpec, *, stacked: bool, select: bool = False) -> tuple[Callable, tuple]:
    """(jitted program, abstract arguments) of the call `generate` (`stacked` False) or
    `generate_stacked` makes for these prompts [(P,) B, S'] (`lay_out`), its KV cache and prompts
    with the shardings `spec.mesh` gives them (`generation_shardings`). params: arrays or
    ShapeDtypeStructs, as the call would get them. Nothing is allocated on a device."""
    call = lay_out(config, prompt_tokens, prompt_mask, spec, stacked=stacked, select=select)
    cache = jax.eval_shape(lambda: empty_cache(config, call.batch_shape, call.capacity, windowed=True))
    prompts = (call.tokens, call.mask, call.rows)
    prompt_sh: tuple = (None, None, None)
    if spec.mesh is not None and spec.mesh.size > 1:
        cache_sh, prompt_sh = generation_shardings(config, spec.mesh, stacked, call.batch_shape, call.capacity,
                                                   prompts)
        cache = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), cache, cache_sh)

    def shape(x: np.ndarray | None, sh: Any) -> jax.ShapeDtypeStruct | None:
        return None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    args = (params, cache, *(shape(x, sh) for x, sh in zip(prompts, prompt_sh)),
            jax.eval_shape(lambda: jax.random.key(0)), f32, f32)
    return call.program, args + ((jax.ShapeDtypeStruct((), jnp.int32),) if select else ())


def _run(config: ModelConfig, params: Params, prompt_tokens: Any, prompt_mask: Any, rng: jax.Array,
         spec: GenerationSpec, *, stacked: bool, policy: int | None = None) -> Generation:
    """Checks the prompts [(P,) B, S], lays the call out (`lay_out`), places its cache and prompts
    (on `spec.mesh` when it has several devices) and runs its program."""
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
    call = lay_out(config, tokens, mask, spec, stacked=stacked, select=policy is not None)
    prompts = (call.tokens, call.mask, call.rows)
    mesh = spec.mesh
    if mesh is not None and mesh.size > 1:
        cache, prompts = placed_on_mesh(config, mesh, stacked, call.batch_shape, call.capacity, prompts)
    else:
        cache = _empty_cache(config, call.batch_shape, call.capacity)
    temp = jnp.float32(1.0 if spec.greedy else spec.temperature)
    extra = () if policy is None else (jnp.int32(policy),)
    if policy is not None:  # the key the stacked program gives policy p
        rng = jax.random.fold_in(rng, policy)
    with sharding.mesh_context(mesh):  # the prefill keeps its rows sharded (`jmarl.models.layers.batch_sharded`)
        generation, _ = call.program(params, cache, *prompts, rng, temp, jnp.float32(spec.top_p), *extra)
    return generation


def generate(config: ModelConfig, params: Params, prompt_tokens: Any, prompt_mask: Any, rng: jax.Array,
             spec: GenerationSpec, *, policy: int | None = None) -> Generation:
    """Samples up to spec.max_new_tokens per prompt. prompt_tokens int[B,S], prompt_mask bool[B,S]
    (any padding side) -> Generation with [B, max_new_tokens] fields. spec.temperature 0 = greedy;
    top_k 0 and top_p 1 disable truncation; a row stops after emitting any of spec.stop_tokens.
    `spec.mesh` (a `jax.sharding.Mesh` of several devices): the KV cache and prompt rows are
    sharded over its batch axes (data, fsdp) and key/value heads over tensor, so each device
    decodes its own rows; params keep whatever placement they have. `policy`: params are stacked
    [P, ...] per-agent policies and policy p's are used, with the key `generate_stacked` gives it
    (the same tokens as its rows there), without decoding the other policies' (padding) rows. The
    engine-only fields of `spec` (slots, budget, chunks) are not used."""
    return _run(config, params, prompt_tokens, prompt_mask, rng, spec, stacked=False, policy=policy)


def generate_stacked(config: ModelConfig, stacked_params: Params, prompt_tokens: Any, prompt_mask: Any,
                     rng: jax.Array, spec: GenerationSpec) -> Generation:
    """P policies of one architecture in one device call: stacked_params with a leading [P]
    axis, prompt_tokens/prompt_mask [P,B,S] -> Generation with [P, B, max_new_tokens] fields.
    Policy p uses jax.random.fold_in(rng, p). `spec`: see `generate`."""
    return _run(config, stacked_params, prompt_tokens, prompt_mask, rng, spec, stacked=True)
