"""The continuous engine's device programs: S slots, a pool of shared prompt caches, static shapes.

The programs are pure and jitted, one per static shape and settings (`num_traces` counts them):
- the prompt pool holds Q entries, each one prompt's keys/values ([Q, ...] rows of P tokens, P
  the prompt bucket of the call), its mask, length and next-token logits. The completions of
  one request read its entry in place: a GRPO group's or a tree node's K completions share one
  copy of their prompt's cache, as the static sampler's group layout does;
- the engine state holds S slots, each with its own KV-cache row for its generated tokens only
  (capacity G = max(N - 1, 1), N = max_new_tokens), its pool entry, write index, RoPE position,
  last token, request/completion ids and length limit;
- the prefill program (`prefill_program`) prefills U prompts into U pool entries (U rounded up
  to a power of two, one program per U; at most `budget.prefill_prompts`, whose keys/values fit
  a quarter of the budget: a larger refill runs several calls) and starts the R admitted
  completions in their slots from their entries' logits, sampling each slot's first token;
  completions of requests already in the pool are started by the start program alone
  (`start_program`; a request admitted over several refills is prefilled once);
- the chunk program (`chunk_program`, `decode_slots`) runs up to K decode steps for all S slots
  (a `lax.while_loop` that also stops as soon as every slot is done). Each layer's attention
  reads the slot's pool entry (gathered one layer at a time, `jmarl.models.kv_cache.take_rows`)
  followed by the slot's own cache; while every request asks the same G completions and each
  request's busy slots are the G consecutive slots i G .. i G + G - 1 reading entry i (counted
  per device), the slots read their prompts in groups instead, in place, with the static
  sampler's group attention (no gather);
- a run whose completions all fit the slots at once (nothing queued after the first admission,
  its prompts within one prefill call) is one fused program: state, prefill, start and drain,
  with the policy's parameters selected and cast inside it (no separate cast program). It
  stops where the drain would (the run's end, or its tail's shrink point), and the general
  programs decode what is left.

The host loop that calls them is `jmarl.models.generation.engine`; the slots and entries a run
gets, `jmarl.models.generation.budget`; their placement on a mesh, `jmarl.models.generation.layout`.
"""

from __future__ import annotations

import collections
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding

from jmarl.models.config import ModelConfig
from jmarl.models.decode import Ring, decode_step, prefill, ring_mask, window_block_mask
from jmarl.models.generation.budget import generated_capacity
from jmarl.models.generation.layout import Layout, gathered, prepare_params, row_devices
from jmarl.models.generation.sampling import choose_token, row_uniforms
from jmarl.models.kv_cache import KVCache, empty_cache, take_rows, window_capacity
from jmarl.models.model import Params


@struct.dataclass
class PromptPool:
    """Q prompt entries, shared by the slots that continue them. cache: [Q, ...] rows of P
    tokens (`KVCache`); mask bool[Q, P] (the prompt, left-padded); length int32[Q]; logits
    float32[Q, V]: the next-token logits after the prompt (a new slot samples its first token
    from them)."""

    cache: KVCache
    mask: jax.Array
    length: jax.Array
    logits: jax.Array


@struct.dataclass
class EngineState:
    """The slots on device and the pool. cache: [S, ...] rows of capacity G (the slot's generated
    tokens); entry int32[S] (the slot's pool entry, counted within its device's part of the pool:
    entry e of device d is pool row d Q/D + e); prompt_len, token (the last sampled), count
    (tokens generated), limit (max tokens of this slot), request, completion int32[S]; done
    bool[S] (free or finished); uniforms float32[S, N]: the draws of the slot's N tokens, made
    when it is filled."""

    cache: KVCache
    entry: jax.Array
    prompt_len: jax.Array
    token: jax.Array
    count: jax.Array
    limit: jax.Array
    request: jax.Array
    completion: jax.Array
    done: jax.Array
    uniforms: jax.Array
    pool: PromptPool


_TRACES = collections.Counter()


def num_traces() -> dict[str, int]:
    """How many times each engine program has been traced (= compiled) in this process."""
    return dict(_TRACES)


def state_shardings(layout: Layout, num_layers: int) -> EngineState:
    """NamedSharding per field of an EngineState on `layout`'s mesh: slots and pool entries over `rows`, the
    caches' heads over `heads`."""
    row = NamedSharding(layout.mesh, layout.row_spec())
    cache = NamedSharding(layout.mesh, layout.cache_spec())
    caches = KVCache(keys=(cache,) * num_layers, values=(cache,) * num_layers)
    return EngineState(
        cache=caches, entry=row, prompt_len=row, token=row, count=row, limit=row, request=row, completion=row,
        done=row, uniforms=row, pool=PromptPool(cache=caches, mask=row, length=row, logits=row),
    )


def _jit(program, layout: Layout | None, num_layers: int, state_arg: int | None, outputs: int, donate: tuple):
    """jax.jit of `program`; with a layout, the state argument `state_arg` and output 0 (the
    state) carry the layout's shardings (the other outputs follow XLA's propagation)."""
    if layout is None:
        return jax.jit(program, donate_argnums=donate)
    state_sh = state_shardings(layout, num_layers)
    kwargs: dict[str, Any] = dict(donate_argnums=donate)
    if state_arg is not None:
        nargs = len(inspect.signature(program).parameters)
        kwargs["in_shardings"] = tuple(state_sh if i == state_arg else None for i in range(nargs))
    kwargs["out_shardings"] = state_sh if outputs == 1 else (state_sh,) + (None,) * (outputs - 1)
    return jax.jit(program, **kwargs)


@functools.lru_cache(maxsize=None)
def prepare_program(config: ModelConfig, select: bool):
    """(params[, policy]) -> the parameters the refill and chunk programs read (`prepare_params`:
    with `select`, policy `policy` (int32) of params stacked over policies; cast once per run)."""

    def program(params, policy=None):
        _TRACES["prepare"] += 1
        return prepare_params(config, params, policy if select else None)

    return jax.jit(program)


def empty_state(config: ModelConfig, slots: int, entries: int, prompt_len: int, max_new_tokens: int) -> EngineState:
    """An EngineState of `slots` free slots (done) and `entries` empty pool entries of
    `prompt_len` tokens, the slots' caches of G = `generated_capacity`(max_new_tokens) tokens.
    Both caches are windowed (`jmarl.models.kv_cache`): on the sliding-window layers an entry
    keeps its prompt's last min(P, W) slots and a slot a ring of min(G, W)."""
    zeros = jnp.zeros((slots,), jnp.int32)
    pool = PromptPool(
        cache=empty_cache(config, (entries,), prompt_len, windowed=True), mask=jnp.zeros((entries, prompt_len), bool),
        length=jnp.zeros((entries,), jnp.int32), logits=jnp.zeros((entries, config.vocab_size), jnp.float32),
    )
    return EngineState(
        cache=empty_cache(config, (slots,), generated_capacity(max_new_tokens), windowed=True), entry=zeros,
        prompt_len=zeros, token=zeros, count=zeros, limit=zeros, request=zeros, completion=zeros,
        done=jnp.ones((slots,), bool), uniforms=jnp.zeros((slots, int(max_new_tokens)), jnp.float32), pool=pool,
    )


@functools.lru_cache(maxsize=None)
def init_program(config: ModelConfig, slots: int, entries: int, prompt_len: int, max_new_tokens: int,
                  layout: Layout | None = None):
    def program():
        _TRACES["init"] += 1
        return empty_state(config, slots, entries, prompt_len, max_new_tokens)

    return _jit(program, layout, config.num_layers, None, 1, ())


def _fill_entries(gen_config: ModelConfig, params: Params, state: EngineState, tokens, mask, dest) -> EngineState:
    """The state with prompt u (tokens/mask [U,P]) prefilled into pool row dest[u] (dest[u] = Q,
    out of range, marks an unused entry: dropped)."""
    u, p = tokens.shape
    prompts = empty_cache(gen_config, (u,), p, windowed=True)  # the pool's layout: last W slots on sliding layers
    logits, cache = prefill(gen_config, params, tokens, mask, prompts, ring=True)
    pool = state.pool

    def put(buf, new):
        return buf.at[dest].set(new.astype(buf.dtype), mode="drop")

    return state.replace(pool=PromptPool(
        cache=jax.tree.map(put, pool.cache, cache), mask=put(pool.mask, mask.astype(bool)),
        length=put(pool.length, mask.astype(jnp.int32).sum(axis=1)), logits=put(pool.logits, logits),
    ))


def _start_slots(state: EngineState, entry, dest, request, completion, limit, rng, temperature, top_p, *, groups: int,
                 greedy: bool, top_k: int, use_top_p: bool, stop_tokens: tuple[int, ...]):
    """(state, token [R], logprob [R], done [R]): slot dest[i] starts completion (request[i],
    completion[i]) of the prompt in pool row entry[i] (on the slot's device), its first token
    sampled from the entry's logits; dest[i] = S (out of range) marks an unused entry (dropped)."""
    pool = state.pool
    uniforms = row_uniforms(rng, request, completion, state.uniforms.shape[1])
    token, logprob = choose_token(pool.logits[entry], rng, uniforms[:, 0], temperature, top_p, greedy=greedy,
                             top_k=top_k, use_top_p=use_top_p)
    done = jnp.isin(token, jnp.asarray(stop_tokens, jnp.int32)) | (limit <= 1)

    def put(buf, new):
        return buf.at[dest].set(new, mode="drop")

    state = state.replace(
        entry=put(state.entry, entry % (pool.length.shape[0] // groups)),
        prompt_len=put(state.prompt_len, pool.length[entry]),
        token=put(state.token, token),
        count=put(state.count, jnp.ones_like(request)),
        limit=put(state.limit, limit),
        request=put(state.request, request),
        completion=put(state.completion, completion),
        done=put(state.done, done),
        uniforms=put(state.uniforms, uniforms),
    )
    return state, token, logprob, done


def _leading_rows(buffer: jax.Array, groups: int, rows: int) -> jax.Array:
    """buffer [Q, ...] in `groups` equal parts (one per device) -> [groups * rows, ...]: the
    first `rows` rows of each part, in order (a slice of each device's own part)."""
    q = buffer.shape[0]
    parts = buffer.reshape((groups, q // groups) + buffer.shape[1:])[:, :rows]
    return parts.reshape((groups * rows,) + buffer.shape[1:])


def decode_slots(gen_config: ModelConfig, params: Params, state: EngineState, rng, temperature, top_p, floor, *,
            steps: int, greedy: bool, top_k: int, use_top_p: bool, stop_tokens: tuple[int, ...], pad_id: int,
            groups: int, group_size: int, aligned: bool = False) -> tuple[EngineState, jax.Array, jax.Array, jax.Array]:
    """(state, tokens int32[S, K], logprobs float32[S, K], emitted bool[S, K]): up to K = `steps`
    decode steps of every slot not done (params gathered, in the compute dtype). The loop ends
    early once every slot is done or, when more than `floor` (int32) slots are busy at the start,
    once at most `floor` are (after at least one step): the tail's shrink point. A slot attends to
    its pool entry's prompt, then its own tokens; emitted[i] is True on a prefix of the K steps.

    group_size G = 0: slot i reads pool entry state.entry[i], gathered one layer at a time
    (`pooled_cached_attention`). G > 0 (the host checked it): slot i of device d reads the
    device's entry i // G (counted within the device's S/D slots and Q/D entries), i.e. each G
    consecutive slots share one prompt, read in place by the static sampler's group attention
    (`prefixed_cached_attention`) without a per-slot gather.

    aligned: every busy slot has generated exactly one token when the loop starts (a fused run's
    drain), so step i writes cache slot i of every row (one slice; a done row's write lands past
    its tokens, or in its ring, no longer read) and reads draw i + 1, instead of a write and a read
    at each row's own count.

    Sliding-window layers (windowed caches, `empty_state`): a slot writes its generated token j
    to ring slot j mod R (R = min(G, W)) and reads its entry's last min(P, W) prompt slots
    within the window, then its ring (`decode.Ring`). Not with group_size (`group_size` is 0
    for such models)."""
    s = state.token.shape[0]
    gen_slots = state.cache.capacity
    sliding = any(gen_config.sliding_layers())
    assert not (group_size and sliding), "grouped prompt reads are off for sliding-window models"
    ring_slots = window_capacity(gen_config, gen_slots)
    layers = [jax.tree.map(lambda a: a[i], params["layers"]) for i in range(gen_config.num_layers)]
    stops = jnp.asarray(stop_tokens, jnp.int32)
    pool = state.pool
    busy0 = jnp.sum(~state.done)
    floor = jnp.where(busy0 > floor, floor, 0)
    if group_size:
        per_device = s // groups // group_size  # the entries the device's slots read: its first ones
        prefix = jax.tree.map(lambda a: _leading_rows(a, groups, per_device), pool.cache)
        prefix_mask = _leading_rows(pool.mask, groups, per_device)
    else:
        prompt_mask = take_rows(pool.mask, state.entry, groups)  # [S, P]; entries do not change in a chunk
        p = prompt_mask.shape[1]
        prompt_window = prompt_mask[:, p - window_capacity(gen_config, p):]  # [S, Pw]: the entries' windowed slots
    out_tokens = jnp.full((s, steps), pad_id, jnp.int32)
    out_logprobs = jnp.zeros((s, steps), jnp.float32)
    out_emitted = jnp.zeros((s, steps), bool)

    def cond(carry):
        i, st = carry[0], carry[1]
        busy = jnp.sum(~st.done)
        return (i < steps) & (busy > 0) & ((busy > floor) | (i == 0))

    def body(carry):
        i, st, out_tokens, out_logprobs, out_emitted = carry
        active = ~st.done
        count = st.count
        generated = jnp.arange(gen_slots)[None, :] < count[:, None]
        write = jnp.minimum(i, gen_slots - 1) if aligned else jnp.clip(count - 1, 0, gen_slots - 1)
        position = st.prompt_len + count - 1
        ring = None
        if sliding:  # the slot's ring after its count generated tokens, behind its entry's last slots
            ring_write = i % ring_slots if aligned else jnp.maximum(count - 1, 0) % ring_slots
            ring_keys = jnp.concatenate([window_block_mask(gen_config, prompt_window, count),
                                         ring_mask(count, jnp.zeros((s, ring_slots), bool))], axis=1)
            ring = Ring(slot=ring_write, key_mask=ring_keys)
        if group_size:
            logits, cache = decode_step(gen_config, params, st.cache, st.token, position, write, generated, layers,
                                        prefix=prefix, prefix_mask=prefix_mask)
        else:
            key_mask = jnp.concatenate([prompt_mask, generated], axis=1)
            logits, cache = decode_step(gen_config, params, st.cache, st.token, position, write, key_mask, layers,
                                        earlier=pool.cache, earlier_rows=st.entry, earlier_groups=groups, ring=ring)
        last = st.uniforms.shape[1] - 1
        if aligned:
            uniform = jax.lax.dynamic_index_in_dim(st.uniforms, jnp.minimum(i + 1, last), axis=1, keepdims=False)
        else:
            uniform = jnp.take_along_axis(st.uniforms, jnp.minimum(count, last)[:, None], axis=1)[:, 0]
        token, logprob = choose_token(logits, rng, uniform, temperature, top_p,
                                 greedy=greedy, top_k=top_k, use_top_p=use_top_p)
        token = jnp.where(active, token, pad_id)
        logprob = jnp.where(active, logprob, 0.0)
        count = count + active.astype(jnp.int32)
        done = st.done | (active & (jnp.isin(token, stops) | (count >= st.limit)))
        st = st.replace(cache=cache, token=jnp.where(active, token, st.token), count=count, done=done)
        out_tokens = jax.lax.dynamic_update_slice(out_tokens, token[:, None], (0, i))
        out_logprobs = jax.lax.dynamic_update_slice(out_logprobs, logprob[:, None], (0, i))
        out_emitted = jax.lax.dynamic_update_slice(out_emitted, active[:, None], (0, i))
        return i + 1, st, out_tokens, out_logprobs, out_emitted

    _, state, out_tokens, out_logprobs, out_emitted = jax.lax.while_loop(
        cond, body, (jnp.int32(0), state, out_tokens, out_logprobs, out_emitted))
    return state, out_tokens, out_logprobs, out_emitted


@functools.lru_cache(maxsize=None)
def prefill_program(config: ModelConfig, greedy: bool, top_k: int, use_top_p: bool, stop_tokens: tuple[int, ...],
                     layout: Layout | None = None):
    """(params, state, tokens [U,P], mask [U,P], fill [U], entry [R], dest [R], request [R],
    completion [R], limit [R], rng, temperature, top_p) -> (state, token [R], logprob [R],
    done [R]): prompt u prefilled into pool row fill[u] (`_fill_entries`), then the R slots
    started (`_start_slots`), in one program."""
    gen_config = config.replace(param_dtype=config.compute_dtype)
    start = functools.partial(_start_slots, groups=row_devices(layout), greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                              stop_tokens=stop_tokens)

    def program(params, state, tokens, mask, fill, entry, dest, request, completion, limit, rng, temperature, top_p):
        _TRACES["prefill"] += 1
        state = _fill_entries(gen_config, gathered(layout, params), state, tokens, mask, fill)
        return start(state, entry, dest, request, completion, limit, rng, temperature, top_p)

    return _jit(program, layout, config.num_layers, 1, 4, (1,))


@functools.lru_cache(maxsize=None)
def start_program(config: ModelConfig, greedy: bool, top_k: int, use_top_p: bool, stop_tokens: tuple[int, ...],
                   layout: Layout | None = None):
    """(state, entry [R], dest [R], request [R], completion [R], limit [R], rng, temperature,
    top_p) -> (state, token [R], logprob [R], done [R]): `_start_slots` alone, for completions of
    requests already in the pool."""
    start = functools.partial(_start_slots, groups=row_devices(layout), greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                              stop_tokens=stop_tokens)

    def program(state, entry, dest, request, completion, limit, rng, temperature, top_p):
        _TRACES["start"] += 1
        return start(state, entry, dest, request, completion, limit, rng, temperature, top_p)

    return _jit(program, layout, config.num_layers, 0, 4, (0,))


@functools.lru_cache(maxsize=None)
def chunk_program(config: ModelConfig, steps: int, greedy: bool, top_k: int, use_top_p: bool,
                   stop_tokens: tuple[int, ...], pad_id: int, layout: Layout | None = None, group_size: int = 0):
    """(params, state, rng, temperature, top_p, floor) -> (state, tokens int32[S, K], logprobs
    float32[S, K], emitted bool[S, K]): `decode_slots` of up to K = `steps` steps; `floor` (int32,
    traced) the busy slots at which the loop stops early when more are busy at its start (0:
    none), `group_size` its prompt layout (0: a gather per slot)."""
    gen_config = config.replace(param_dtype=config.compute_dtype)
    decode = functools.partial(decode_slots, gen_config, steps=steps, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                               stop_tokens=stop_tokens, pad_id=pad_id, groups=row_devices(layout),
                               group_size=group_size)

    def program(params, state, rng, temperature, top_p, floor):
        _TRACES["decode"] += 1
        # gathered once per chunk: the loop reads gathered weights
        return decode(gathered(layout, params), state, rng, temperature, top_p, floor)

    return _jit(program, layout, config.num_layers, 1, 4, (1,))


@functools.lru_cache(maxsize=None)
def fused_program(config: ModelConfig, slots: int, entries: int, prompt_len: int, max_new_tokens: int, steps: int,
                   greedy: bool, top_k: int, use_top_p: bool, stop_tokens: tuple[int, ...], pad_id: int,
                   layout: Layout | None = None, group_size: int = 0, select: bool = False):
    """(params, policy, tokens [U,P], mask [U,P], fill [U], entry [S], dest [S], request [S],
    completion [S], limit [S], rng, temperature, top_p, floor) -> (state, token [S], logprob [S],
    done [S], tokens int32[S, K], logprobs float32[S, K], emitted bool[S, K]): a run whose
    completions all fit the slots at once, in one program: an empty state (`init_program`), the
    U prompts prefilled and the slots started (`prefill_program`), then the drain
    (`chunk_program` of K = `steps` steps). The same computations as those three programs
    called in turn, without the host between them. params: as the caller gave them, prepared
    in the program (`prepare_params`: policy `policy` (int32) of params stacked over policies with
    `select`, cast to the compute dtype), then gathered as `layout` says (`make_layout` with
    `select`)."""
    gen_config = config.replace(param_dtype=config.compute_dtype)
    groups = row_devices(layout)
    start = functools.partial(_start_slots, groups=groups, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                              stop_tokens=stop_tokens)
    decode = functools.partial(decode_slots, gen_config, steps=steps, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                               stop_tokens=stop_tokens, pad_id=pad_id, groups=groups, group_size=group_size,
                               aligned=True)

    def program(params, policy, tokens, mask, fill, entry, dest, request, completion, limit, rng, temperature, top_p,
                floor):
        _TRACES["fused"] += 1
        # once: the prefill and the decode loop read the policy's weights, cast and gathered
        params = gathered(layout, prepare_params(config, params, policy if select else None))
        state = empty_state(config, slots, entries, prompt_len, max_new_tokens)
        if layout is not None:
            state = jax.lax.with_sharding_constraint(state, state_shardings(layout, config.num_layers))
        state = _fill_entries(gen_config, params, state, tokens, mask, fill)
        state, token, logprob, done = start(state, entry, dest, request, completion, limit, rng, temperature, top_p)
        state, toks, lps, emitted = decode(params, state, rng, temperature, top_p, floor)
        return state, token, logprob, done, toks, lps, emitted

    return _jit(program, layout, config.num_layers, None, 7, ())


@functools.lru_cache(maxsize=None)
def shrink_program(slots: int, layout: Layout | None = None, num_layers: int = 0):
    """(state [S', ...] -> state [slots, ...]): slots `index` int32[slots] of the state, those
    with keep False marked done (padding slots); the pool is kept as it is. The tail of a run,
    once the queue is empty, decodes its last few rows with fewer slots."""

    def program(state, index, keep):
        _TRACES["shrink"] += 1
        slots_only = jax.tree.map(lambda a: a[index], state.replace(pool=None))
        return slots_only.replace(done=slots_only.done | ~keep, pool=state.pool)

    return _jit(program, layout, num_layers, 0, 1, ())
