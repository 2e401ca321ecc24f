"""Continuous-batching generation engine: S slots, a pool of shared prompt caches, a queue, a KV budget.

Device part (pure, jitted, static shapes):
- the prompt pool holds Q entries, each one prompt's keys/values ([Q, ...] rows of P tokens, P
  the prompt bucket of the call), its mask, length and next-token logits. The completions of
  one request read its entry in place: a GRPO group's or a tree node's K completions share one
  copy of their prompt's cache, as the static sampler's group layout does;
- the engine state holds S slots, each with its own KV-cache row for its generated tokens only
  (capacity G = max(N - 1, 1), N = max_new_tokens), its pool entry, write index, RoPE position,
  last token, request/completion ids and length limit;
- the prefill program prefills U prompts into U pool entries (U rounded up to a power of two,
  one program per U; at most `prefill_prompts`, whose keys/values fit a quarter of the budget:
  a larger refill runs several calls) and starts the R admitted completions in their slots from their entries'
  logits, sampling each slot's first token; completions of requests already in the pool are
  started by the start program alone (a request admitted over several refills is prefilled once);
- `decode_chunk` runs up to K decode steps for all S slots (a `lax.while_loop` that also stops
  as soon as every slot is done). Each layer's attention reads the slot's pool entry (gathered
  one layer at a time, `jmarl.models.kv_cache.take_rows`) followed by the slot's own cache.

Host part (`run`): between chunks the finished slots are harvested and refilled from the queue;
a pool entry is taken when a request's first completion is admitted and given back when its last
completion ends. With no entry free, the queue waits (`EngineStats.entry_waits`).

Exactness and reproducibility: every sampled token's log-prob is under softmax(logits / T)
before truncation (as the static sampler reports it, equal to re-scoring with
`jmarl.models.token_logprobs`). The draw of token t of completion j of request r is entry t of
uniform(fold_in(fold_in(rng, r), j), (N,)), made when the completion's slot is filled: the
outputs depend on the seed only, not on which slot or chunk served a completion, so runs with
different slot counts give the same completions.

The budget (bytes per device): a slot costs `slot_bytes` (layers x 2 x kv_heads x head_dim x G x
dtype bytes), a pool entry `entry_bytes` (the same for P tokens, plus its float32 logits). With
requests of n completions each, Q = `entries_for`(S, n) = min(S, ceil(2 S / n)): room for twice
the requests the slots can serve at once. The engine runs S = the largest power of two whose
slots and entries fit `kv_budget_bytes` (no more than the rows asked for, rounded up to a
power of two). A call whose single slot and entry do not fit is refused.

On a mesh (`EngineSpec.mesh`): the slot axis of the slots' cache and of every per-slot field,
and the entry axis of the pool, are sharded like activation rows (the mesh axes of an unstacked
"batch" in `jmarl.sharding.ShardingRules`, default data, fsdp and policy; S and Q multiples of
their product D, the budget being per device), the caches' key/value heads like "kv_heads"
(tensor). The host keeps every slot on the device of the entry it reads: slots d S/D .. and
entries d Q/D .. lie on device d, a request's completions on another device take an entry
there (its prompt prefilled again), so each device gathers only from its own part of the pool.
The parameters stay as the caller placed them; FSDP-sharded weights are gathered (already in
the compute dtype) once at the top of each prefill / decode-chunk program, so the decode loop
reads gathered weights instead of gathering them at every step. The programs are jitted with the
state's shardings in and out (and the state donated), so the caches stay sharded between calls.
"""

from __future__ import annotations

import collections
import functools
import heapq
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmarl.errors import JmarlError
from jmarl.models.config import ModelConfig
from jmarl.models.decode import decode_step, prefill
from jmarl.models.kv_cache import KVCache, empty_cache, take_rows
from jmarl.models.model import CACHE_KEY_AXES, Params
from jmarl.models.sampler import generation_params, sample_token, select_policy
from jmarl.rollouts import DEFAULT_LENGTH_BUCKETS, bucket_length, next_pow2
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules
from jmarl.sharding.specs import row_axes

DEFAULT_CHUNK_STEPS = 8
CPU_DEFAULT_KV_BUDGET = 1 << 30  # 1 GiB when the device reports no memory limit (CPU)
DEVICE_KV_FRACTION = 0.25  # of the device's memory limit, when it reports one
PREFILL_BUDGET_SHARE = 4  # one prefill call's prompts hold at most 1/4 of the KV budget in keys/values


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


def kv_bytes(config: ModelConfig, tokens: int) -> int:
    """KV-cache bytes of one row of `tokens` tokens: layers x 2 x kv_heads x head_dim x tokens x dtype."""
    itemsize = jnp.dtype(config.compute_dtype).itemsize
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * int(tokens) * itemsize


def generated_capacity(max_new_tokens: int) -> int:
    """G: the cache positions of a slot's own tokens (the last sampled token is never written)."""
    return max(int(max_new_tokens) - 1, 1)


def slot_bytes(config: ModelConfig, max_new_tokens: int) -> int:
    """Bytes of one slot: the KV cache of its G generated tokens."""
    return kv_bytes(config, generated_capacity(max_new_tokens))


def entry_bytes(config: ModelConfig, prompt_len: int) -> int:
    """Bytes of one pool entry: the KV cache of a prompt of `prompt_len` tokens and its float32
    next-token logits."""
    return kv_bytes(config, prompt_len) + 4 * config.vocab_size


def entries_for(slots: int, share: int) -> int:
    """Q for `slots` slots when every request asks `share` completions: min(slots, ceil(2 x slots
    / share)), room for twice the requests the slots serve at once (a request whose siblings
    ended keeps its entry while its last completion decodes)."""
    return max(1, min(int(slots), -(-2 * int(slots) // max(int(share), 1))))


def engine_bytes(config: ModelConfig, slots: int, entries: int, prompt_len: int, max_new_tokens: int) -> int:
    """Bytes of `slots` slots and `entries` pool entries."""
    return slots * slot_bytes(config, max_new_tokens) + entries * entry_bytes(config, prompt_len)


def default_kv_budget(device: Any = None) -> int:
    """Bytes per device for the KV cache when `sampling.kv_budget_bytes` is None: a quarter of
    the device's memory limit when it reports one (accelerators), else 1 GiB (CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    limit = stats.get("bytes_limit")
    return int(limit * DEVICE_KV_FRACTION) if limit else CPU_DEFAULT_KV_BUDGET


def slots_for_budget(config: ModelConfig, prompt_len: int, max_new_tokens: int, budget: int, rows: int,
                     share: int = 1) -> tuple[int, int]:
    """(S, Q): S the largest power of two whose slots and `entries_for`(S, share) entries fit
    `budget` bytes, and no more than next_pow2(rows). Raises JmarlError when not even one slot
    and one entry fit."""
    need = engine_bytes(config, 1, 1, prompt_len, max_new_tokens)
    if need > budget:
        raise JmarlError(
            f"one generation row needs {need} bytes of KV cache ({prompt_len} prompt tokens, {max_new_tokens} new "
            f"tokens) but sampling.kv_budget_bytes is {budget}: raise sampling.kv_budget_bytes or lower "
            "sampling.max_prompt_len / sampling.max_new_tokens"
        )
    slots, most = 1, next_pow2(max(int(rows), 1))
    while slots < most and engine_bytes(config, 2 * slots, entries_for(2 * slots, share), prompt_len,
                                        max_new_tokens) <= budget:
        slots *= 2
    return slots, entries_for(slots, share)


# ---------------------------------------------------------------------------------- mesh layout
@dataclass(frozen=True)
class Layout:
    """How the engine lies on a mesh: `rows` the mesh axes of the slot axis (default data, fsdp,
    policy: those of size > 1), `heads` the mesh axis (or axes) of the cache's key/value heads ("tensor"
    or None), `gather` one NamedSharding (or None: left as it is) per parameter leaf (treedef
    `params_def`): the leaf's own sharding without the row axes (FSDP shards: the weights one
    program call reads, gathered once)."""

    mesh: Any
    rows: tuple[str, ...]
    heads: str | tuple[str, ...] | None
    params_def: Any = None
    gather: tuple = ()

    @property
    def row_devices(self) -> int:
        sizes = dict(self.mesh.shape)
        return int(np.prod([sizes[a] for a in self.rows])) if self.rows else 1

    def row_spec(self) -> P:
        return P(None if not self.rows else self.rows[0] if len(self.rows) == 1 else self.rows)

    def cache_spec(self) -> P:
        return P(*self.row_spec(), self.heads) if self.heads else self.row_spec()

    def state_shardings(self, num_layers: int) -> EngineState:
        """NamedSharding per field of an EngineState: slots and pool entries over `rows`, the
        caches' heads over `heads`."""
        row = NamedSharding(self.mesh, self.row_spec())
        cache = NamedSharding(self.mesh, self.cache_spec())
        caches = KVCache(keys=(cache,) * num_layers, values=(cache,) * num_layers)
        return EngineState(
            cache=caches, entry=row, prompt_len=row, token=row, count=row, limit=row, request=row, completion=row,
            done=row, uniforms=row, pool=PromptPool(cache=caches, mask=row, length=row, logits=row),
        )


def _without(spec: P, dropped: tuple[str, ...]) -> P:
    """`spec` with the mesh axes `dropped` taken out of every entry."""
    out = []
    for entry in spec:
        axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
        axes = [a for a in axes if a not in dropped]
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return P(*out)


def make_layout(config: ModelConfig, mesh: Any, params: Params | None = None,
                rules: ShardingRules = DEFAULT_RULES) -> Layout | None:
    """The engine's layout on `mesh` (None without a mesh of several devices) by `rules`: the
    slot axis on the mesh axes of an unstacked "batch" of size > 1 (default data, fsdp and the
    spare policy axis: a run decodes one policy, whose weights are gathered over the slot axes
    like FSDP shards; S is rounded up to their product, so none is dropped), the cache's heads on those of "kv_heads"
    that divide num_kv_heads (default tensor). `params` (the generation parameters, placed)
    give the gathered shardings of the weights."""
    if mesh is None or mesh.size <= 1:
        return None
    sizes = dict(mesh.shape)
    # the engine serves one policy per run, so a stacked run's "policy" devices split its slots too
    rows = row_axes(mesh, stacked=False, rules=rules)
    heads_spec = rules.spec(CACHE_KEY_AXES[1:2], (config.num_kv_heads,), sizes)
    heads = heads_spec[0] if len(heads_spec) else None
    if params is None:
        return Layout(mesh, rows, heads)
    leaves, treedef = jax.tree.flatten(params)

    def gathered(leaf):
        sh = getattr(leaf, "sharding", None)
        if not isinstance(sh, NamedSharding) or sh.mesh != mesh:
            return None
        return NamedSharding(mesh, _without(sh.spec, rows))

    return Layout(mesh, rows, heads, treedef, tuple(gathered(leaf) for leaf in leaves))


def _gathered(layout: Layout | None, params: Params) -> Params:
    """params constrained to their fsdp-gathered shardings (inside a program: one gather per call)."""
    if layout is None or not layout.gather:
        return params
    leaves, treedef = jax.tree.flatten(params)
    leaves = [x if sh is None else jax.lax.with_sharding_constraint(x, sh) for x, sh in zip(leaves, layout.gather)]
    return jax.tree.unflatten(treedef, leaves)


def _jit(program, layout: Layout | None, num_layers: int, state_arg: int | None, outputs: int, donate: tuple):
    """jax.jit of `program`; with a layout, the state argument `state_arg` and output 0 (the
    state) carry the layout's shardings (the other outputs follow XLA's propagation)."""
    if layout is None:
        return jax.jit(program, donate_argnums=donate)
    state_sh = layout.state_shardings(num_layers)
    kwargs: dict[str, Any] = dict(donate_argnums=donate)
    if state_arg is not None:
        import inspect

        nargs = len(inspect.signature(program).parameters)
        kwargs["in_shardings"] = tuple(state_sh if i == state_arg else None for i in range(nargs))
    kwargs["out_shardings"] = state_sh if outputs == 1 else (state_sh,) + (None,) * (outputs - 1)
    return jax.jit(program, **kwargs)


# ---------------------------------------------------------------------------------- device part
def _row_uniforms(rng: jax.Array, request: jax.Array, completion: jax.Array, steps: int) -> jax.Array:
    """float32[R, steps]: the draws of tokens 0 .. steps-1 of completion (request, completion) of
    each row: uniform(fold_in(fold_in(rng, request), completion), (steps,)). Made once per slot
    fill, so a decode step only reads its column."""

    def one(r, j):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(rng, r), j), (steps,), jnp.float32)

    return jax.vmap(one)(request, completion)


def _prepare(config: ModelConfig, params: Params, policy: jax.Array | None) -> Params:
    if policy is not None:
        params = select_policy(config, params, policy)
    return generation_params(config, params)


@functools.lru_cache(maxsize=None)
def _prepare_program(config: ModelConfig, select: bool):
    def program(params, policy=None):
        _TRACES["prepare"] += 1
        return _prepare(config, params, policy if select else None)

    return jax.jit(program)


def _groups(layout: Layout | None) -> int:
    """D: the devices the slots (and pool entries) are split over."""
    return 1 if layout is None else layout.row_devices


@functools.lru_cache(maxsize=None)
def _init_program(config: ModelConfig, slots: int, entries: int, prompt_len: int, max_new_tokens: int,
                  layout: Layout | None = None):
    def program():
        _TRACES["init"] += 1
        zeros = jnp.zeros((slots,), jnp.int32)
        pool = PromptPool(
            cache=empty_cache(config, (entries,), prompt_len), mask=jnp.zeros((entries, prompt_len), bool),
            length=jnp.zeros((entries,), jnp.int32), logits=jnp.zeros((entries, config.vocab_size), jnp.float32),
        )
        return EngineState(
            cache=empty_cache(config, (slots,), generated_capacity(max_new_tokens)), entry=zeros, prompt_len=zeros,
            token=zeros, count=zeros, limit=zeros, request=zeros, completion=zeros, done=jnp.ones((slots,), bool),
            uniforms=jnp.zeros((slots, int(max_new_tokens)), jnp.float32), pool=pool,
        )

    return _jit(program, layout, config.num_layers, None, 1, ())


def _choose(logits, rng, uniform, temperature, top_p, *, greedy, top_k, use_top_p):
    return sample_token(logits, rng, temperature, top_p, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                        uniform=None if greedy else uniform)


def _fill_entries(gen_config: ModelConfig, params: Params, state: EngineState, tokens, mask, dest) -> EngineState:
    """The state with prompt u (tokens/mask [U,P]) prefilled into pool row dest[u] (dest[u] = Q,
    out of range, marks an unused entry: dropped)."""
    u, p = tokens.shape
    logits, cache = prefill(gen_config, params, tokens, mask, empty_cache(gen_config, (u,), p))
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
    uniforms = _row_uniforms(rng, request, completion, state.uniforms.shape[1])
    token, logprob = _choose(pool.logits[entry], rng, uniforms[:, 0], temperature, top_p, greedy=greedy,
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


@functools.lru_cache(maxsize=None)
def _prefill_program(config: ModelConfig, greedy: bool, top_k: int, use_top_p: bool, stop_tokens: tuple[int, ...],
                     layout: Layout | None = None):
    """(params, state, tokens [U,P], mask [U,P], fill [U], entry [R], dest [R], request [R],
    completion [R], limit [R], rng, temperature, top_p) -> (state, token [R], logprob [R],
    done [R]): prompt u prefilled into pool row fill[u] (`_fill_entries`), then the R slots
    started (`_start_slots`), in one program."""
    gen_config = config.replace(param_dtype=config.compute_dtype)
    start = functools.partial(_start_slots, groups=_groups(layout), greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                              stop_tokens=stop_tokens)

    def program(params, state, tokens, mask, fill, entry, dest, request, completion, limit, rng, temperature, top_p):
        _TRACES["prefill"] += 1
        state = _fill_entries(gen_config, _gathered(layout, params), state, tokens, mask, fill)
        return start(state, entry, dest, request, completion, limit, rng, temperature, top_p)

    return _jit(program, layout, config.num_layers, 1, 4, (1,))


@functools.lru_cache(maxsize=None)
def _start_program(config: ModelConfig, greedy: bool, top_k: int, use_top_p: bool, stop_tokens: tuple[int, ...],
                   layout: Layout | None = None):
    """(state, entry [R], dest [R], request [R], completion [R], limit [R], rng, temperature,
    top_p) -> (state, token [R], logprob [R], done [R]): `_start_slots` alone, for completions of
    requests already in the pool."""
    start = functools.partial(_start_slots, groups=_groups(layout), greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                              stop_tokens=stop_tokens)

    def program(state, entry, dest, request, completion, limit, rng, temperature, top_p):
        _TRACES["start"] += 1
        return start(state, entry, dest, request, completion, limit, rng, temperature, top_p)

    return _jit(program, layout, config.num_layers, 0, 4, (0,))


@functools.lru_cache(maxsize=None)
def _chunk_program(config: ModelConfig, steps: int, greedy: bool, top_k: int, use_top_p: bool,
                   stop_tokens: tuple[int, ...], pad_id: int, layout: Layout | None = None):
    """(params, state, rng, temperature, top_p, floor) -> (state, tokens int32[S, K], logprobs
    float32[S, K], emitted bool[S, K]): up to K decode steps of every slot not done; the loop
    ends early once at most `floor` (int32, traced) slots are busy, after at least one step. A
    slot attends to its pool entry's prompt, then its own tokens."""
    gen_config = config.replace(param_dtype=config.compute_dtype)
    groups = _groups(layout)

    def program(params, state, rng, temperature, top_p, floor):
        _TRACES["decode"] += 1
        params = _gathered(layout, params)  # once per chunk: the loop below reads gathered weights
        s = state.token.shape[0]
        gen_slots = state.cache.capacity
        layers = [jax.tree.map(lambda a: a[i], params["layers"]) for i in range(config.num_layers)]
        stops = jnp.asarray(stop_tokens, jnp.int32)
        pool = state.pool
        prompt_mask = take_rows(pool.mask, state.entry, groups)  # [S, P]; entries do not change in a chunk
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
            key_mask = jnp.concatenate([prompt_mask, generated], axis=1)
            write = jnp.clip(count - 1, 0, gen_slots - 1)
            logits, cache = decode_step(gen_config, params, st.cache, st.token, st.prompt_len + count - 1, write,
                                        key_mask, layers, earlier=pool.cache, earlier_rows=st.entry,
                                        earlier_groups=groups)
            uniform = jnp.take_along_axis(st.uniforms, jnp.minimum(count, st.uniforms.shape[1] - 1)[:, None], axis=1)
            token, logprob = _choose(logits, rng, uniform[:, 0], temperature, top_p,
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

    return _jit(program, layout, config.num_layers, 1, 4, (1,))


@functools.lru_cache(maxsize=None)
def _shrink_program(slots: int, layout: Layout | None = None, num_layers: int = 0):
    """(state [S', ...] -> state [slots, ...]): slots `index` int32[slots] of the state, those
    with keep False marked done (padding slots); the pool is kept as it is. The tail of a run,
    once the queue is empty, decodes its last few rows with fewer slots."""

    def program(state, index, keep):
        _TRACES["shrink"] += 1
        slots_only = jax.tree.map(lambda a: a[index], state.replace(pool=None))
        return slots_only.replace(done=slots_only.done | ~keep, pool=state.pool)

    return _jit(program, layout, num_layers, 0, 1, ())


# ---------------------------------------------------------------------------------- host part
@dataclass
class EngineStats:
    """Counters of one or more engine runs."""

    rows: int = 0  # completions served
    slot_steps: int = 0  # S x decode steps run
    busy_slot_steps: int = 0  # slot-steps of a slot still generating
    chunks: int = 0
    prefills: int = 0  # prefill calls
    prompts_prefilled: int = 0  # pool entries filled (a request served on several devices: once per device)
    requests: int = 0
    queue_wait_chunks: int = 0  # sum over requests of the chunks run before its first completion started
    entry_waits: int = 0  # refills that left slots free because no pool entry was
    slots: int = 0  # S of the last run
    entries: int = 0  # Q of the last run
    slots_per_device: int = 0  # slots each device holds (the cache's shard along the slot axis), largest seen

    def add(self, other: "EngineStats") -> None:
        for name in ("rows", "slot_steps", "busy_slot_steps", "chunks", "prefills", "prompts_prefilled", "requests",
                     "queue_wait_chunks", "entry_waits"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.slots = other.slots
        self.entries = other.entries
        self.slots_per_device = other.slots_per_device


@dataclass
class EngineResult:
    """completions[r][j] = (tokens int32[L], logprobs float32[L]) of completion j of request r."""

    completions: list[list[tuple[np.ndarray, np.ndarray]]]
    stats: EngineStats = field(default_factory=EngineStats)


@dataclass(frozen=True)
class EngineSpec:
    """How the engine decodes: the settings of `run` (and of `planned_slots` /
    `planned_programs`, which size the programs a run compiles) that stay the same from call to
    call. The per-call data (prompts, completions per prompt, key, per-request limits, policy)
    are `run`'s arguments.

    Sampling:
      max_new_tokens   N, the most tokens a completion generates (>= 1; a request's `limits`
                       entry may lower it); also the slots' cache capacity G = max(N - 1, 1).
      temperature      softmax temperature (>= 0; 0: greedy argmax, log-probs under
                       temperature 1). Default 1.0.
      top_p            nucleus mass kept before sampling, in (0, 1] (1: off). Default 1.0.
      top_k            the most likely tokens kept before sampling (0: off). Default 0.
      stop_tokens      token ids that end a completion (the stop token is kept). Default ().
      pad_id           token id of the prompts' left padding and of the decode program's unused
                       output positions. Default 0.
    Capacity:
      kv_budget_bytes  bytes per device for the slots' and the pool's KV caches
                       (`slots_for_budget`; None: `default_kv_budget`, a quarter of the device's
                       memory limit, 1 GiB on CPU). Also caps a prefill call (`prefill_prompts`).
      num_slots        S, slots in all (over the mesh's row devices); None: the most the budget
                       holds (`plan_slots`).
      num_entries      Q, prompt-pool entries in all; None: `entries_for` the slots.
      max_slots        the most slots, rounded down to a power of two (`sampling.max_rows_per_call`:
                       rows in flight; the queue is not split). None: no cap.
      max_prefill      the most prompts one prefill call runs (None: `prefill_prompts` of the
                       budget; a larger refill runs several calls).
      chunk_steps      K, decode steps per program call between two refills of the slots.
                       Default `DEFAULT_CHUNK_STEPS`.
      buckets          prompt-length buckets (tokens): the prompts are left-padded to the
                       bucket of the longest one (`jmarl.rollouts.bucket_length`).
      shrink           once the queue is empty and at most a quarter of the slots are busy,
                       move the busy rows to a state of fewer slots (per device: next_pow2 of
                       its busiest part), so a run's long tail decodes only a few rows per step.
    Placement:
      mesh             a `jax.sharding.Mesh` (None: one device): slots and pool entries are
                       sharded over its batch axes, cache heads over tensor, and the budget is
                       per device (module docstring). Parameters are used as the caller placed
                       them.

    stop_tokens and buckets are kept as tuples of ints (the spec is hashable)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: Sequence[int] = ()
    pad_id: int = 0
    kv_budget_bytes: int | None = None
    num_slots: int | None = None
    num_entries: int | None = None
    max_slots: int | None = None
    max_prefill: int | None = None
    chunk_steps: int = DEFAULT_CHUNK_STEPS
    buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS
    shrink: bool = True
    mesh: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        object.__setattr__(self, "buckets", tuple(int(b) for b in self.buckets))

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0

    def program_sampling(self) -> tuple[bool, int, bool, tuple[int, ...]]:
        """(greedy, top_k, use_top_p, stop_tokens): the sampling settings the programs are
        compiled for (temperature and top_p themselves are traced arguments)."""
        return bool(self.greedy), int(self.top_k), float(self.top_p) < 1.0, self.stop_tokens


def _pad(a: np.ndarray, size: int, fill: Any) -> np.ndarray:
    out = np.full((size,) + a.shape[1:], fill, a.dtype)
    out[: len(a)] = a
    return out


def prefill_prompts(config: ModelConfig, prompt_len: int, kv_budget_bytes: int | None = None) -> int:
    """The most prompts one prefill call runs: the largest power of two whose keys/values
    (`kv_bytes` of `prompt_len` tokens each) fit a quarter of the per-device budget (None:
    `default_kv_budget`), at least 1. A prefill holds its prompts' keys/values for every layer
    until they are stored in the pool, so more prompts at once would put that much more than the
    budget on top of it; a larger refill runs several prefill calls."""
    budget = default_kv_budget() if kv_budget_bytes is None else int(kv_budget_bytes)
    fit = budget // (PREFILL_BUDGET_SHARE * kv_bytes(config, prompt_len))
    return 1 << (max(int(fit), 1).bit_length() - 1)


def planned_prefill(config: ModelConfig, prompt_len: int, spec: EngineSpec) -> int:
    """The most prompts one prefill call of `run` runs: `spec.max_prefill` (at least 1), else
    `prefill_prompts` of the spec's budget."""
    if spec.max_prefill is not None:
        return max(int(spec.max_prefill), 1)
    return prefill_prompts(config, prompt_len, spec.kv_budget_bytes)


def plan_slots(config: ModelConfig, prompt_len: int, max_new_tokens: int, rows: int, share: int, row_devices: int,
               kv_budget_bytes: int | None = None, num_slots: int | None = None, num_entries: int | None = None,
               max_slots: int | None = None) -> tuple[int, int]:
    """(S, Q), slots and pool entries of a run of `rows` completions of requests asking `share`
    each, over `row_devices` devices (both multiples of it): `num_slots` if given, else from
    the per-device `kv_budget_bytes` (None: `default_kv_budget`; see `slots_for_budget`); then
    at most `max_slots` (rounded down to a power of two); Q = `num_entries` if given, else
    `entries_for` the slots of one device."""
    d = int(row_devices)
    if num_slots is None:
        budget = default_kv_budget() if kv_budget_bytes is None else int(kv_budget_bytes)
        per_device, _ = slots_for_budget(config, prompt_len, max_new_tokens, budget, -(-int(rows) // d), share)
        num_slots = per_device * d
    per_device = -(-cap_slots(int(num_slots), max_slots) // d)
    entries = entries_for(per_device, share) if num_entries is None else -(-int(num_entries) // d)
    return per_device * d, max(entries, 1) * d


def run(
    config: ModelConfig,
    params: Params,
    prompts: Sequence[Sequence[int]],
    n: int | Sequence[int],
    rng: jax.Array,
    spec: EngineSpec,
    *,
    limits: Sequence[int] | None = None,
    policy: int | None = None,
) -> EngineResult:
    """n[r] completions (an int: the same for every request) of each prompt (token ids) with
    continuous batching, decoded as `spec` says (`EngineSpec`: sampling, slots and budget,
    mesh). `params` stacked [P, ...] with `policy` given: that policy's parameters.
    `limits[r]`: at most that many new tokens for request r (<= spec.max_new_tokens; default
    spec.max_new_tokens). Slots and pool entries: see `plan_slots`; on a mesh `params` are used
    as placed (see the module docstring)."""
    from jmarl.models.sampler import _check_options, left_align

    max_new_tokens, temperature, top_p, top_k = spec.max_new_tokens, spec.temperature, spec.top_p, spec.top_k
    pad_id, chunk_steps, shrink, mesh = spec.pad_id, spec.chunk_steps, spec.shrink, spec.mesh
    _check_options(max_new_tokens, temperature, top_p, top_k)
    counts = [int(n)] * len(prompts) if isinstance(n, (int, np.integer)) else [int(c) for c in n]
    if len(counts) != len(prompts):
        raise JmarlError(f"n has {len(counts)} entries for {len(prompts)} prompts")
    big_n = int(max_new_tokens)
    limits_arr = np.full(len(prompts), big_n, np.int32) if limits is None else np.minimum(
        np.asarray(limits, np.int32), big_n)
    if (limits_arr < 1).any():
        raise JmarlError("every request's limit must be >= 1")
    result: list[list[tuple[np.ndarray, np.ndarray]]] = [[None] * c for c in counts]  # type: ignore[list-item]
    stats = EngineStats(requests=len(prompts))
    units = collections.deque((r, j) for r, c in enumerate(counts) for j in range(c))
    if not units:
        return EngineResult(result, stats)
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
        raise JmarlError("every prompt needs at least one token")
    p_len = bucket_length(max(lengths), spec.buckets)
    layout = make_layout(config, mesh)
    devices = _groups(layout)
    share = min(c for c in counts if c > 0)
    s, q = plan_slots(config, p_len, big_n, len(units), share, devices, spec.kv_budget_bytes, spec.num_slots,
                      spec.num_entries, spec.max_slots)
    stats.slots, stats.entries = s, q
    max_prefill = planned_prefill(config, p_len, spec)
    width = max(lengths)
    raw = np.full((len(prompts), width), pad_id, np.int32)
    raw_mask = np.arange(width)[None, :] >= (width - np.asarray(lengths))[:, None]
    for r, ids in enumerate(prompts):
        raw[r, width - len(ids):] = ids
    tokens_all, mask_all = left_align(raw, raw_mask, p_len, pad_id)
    if tokens_all.min() < 0 or tokens_all.max() >= config.vocab_size:
        raise JmarlError(f"prompt token ids must be in [0, {config.vocab_size}), the model's vocabulary")

    greedy = spec.greedy
    from jmarl.sharding import mesh_context

    prepare = _prepare_program(config, policy is not None)
    with mesh_context(None if layout is None else layout.mesh):
        gen_params = prepare(params) if policy is None else prepare(params, jnp.int32(policy))
    if layout is not None:  # leaves not on the mesh (e.g. single-device parameters): replicated on it
        replicated = NamedSharding(layout.mesh, P())
        gen_params = jax.tree.map(
            lambda x: x if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == layout.mesh
            else jax.device_put(x, replicated), gen_params)
        layout = make_layout(config, layout.mesh, gen_params)
    sampling = spec.program_sampling()
    prefill_fn = _prefill_program(config, *sampling, layout)
    start_fn = _start_program(config, *sampling, layout)
    chunk_fn = _chunk_program(config, int(chunk_steps), *sampling, int(pad_id), layout)
    # once the queue is empty no slot can be refilled: the drain runs until the run ends, or
    # until few enough slots are busy for the state to shrink
    drain_fn = _chunk_program(config, max(int(chunk_steps), big_n), *sampling, int(pad_id), layout)
    state = _init_program(config, s, q, p_len, big_n, layout)()
    context = lambda: mesh_context(None if layout is None else layout.mesh)  # noqa: E731
    temp = jnp.float32(1.0 if greedy else temperature)
    tp = jnp.float32(top_p)

    # host book-keeping: slot i and entry e lie on devices i // (S/D) and e // (Q/D)
    per_slots, per_entries = s // devices, q // devices
    # free slots and entries of each device, as heaps: the lowest index is taken first
    free_slots = [list(range(d * per_slots, (d + 1) * per_slots)) for d in range(devices)]
    free_entries = [list(range(d * per_entries, (d + 1) * per_entries)) for d in range(devices)]
    entry_of: dict[tuple[int, int], int] = {}  # (request, device) -> its pool entry there
    readers = collections.Counter()  # pool entry -> slots reading it
    left = list(counts)  # completions of each request not admitted yet
    owner: list[tuple[int, int] | None] = [None] * s
    slot_entry: list[int] = [0] * s
    pieces: dict[tuple[int, int], tuple[list, list]] = {}
    started: set[int] = set()

    def release(r: int) -> None:
        """Gives back request r's entries that no slot reads, once all its completions are admitted."""
        if left[r]:
            return
        for d in range(devices):
            e = entry_of.get((r, d))
            if e is not None and readers[e] == 0:
                del entry_of[(r, d)]
                heapq.heappush(free_entries[d], e)

    def finish(slot: int) -> None:
        unit = owner[slot]
        toks, lps = pieces.pop(unit)
        result[unit[0]][unit[1]] = (np.concatenate(toks).astype(np.int32), np.concatenate(lps).astype(np.float32))
        owner[slot] = None
        readers[slot_entry[slot]] -= 1
        release(unit[0])
        heapq.heappush(free_slots[slot // per_slots], slot)
        stats.rows += 1

    def admit() -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
        """Moves queued completions into free slots: ([(request, completion, slot, entry)],
        [(entry, request)] of the entries to prefill). A completion goes to a device where its
        request has an entry, else to the device with the most free slots that has a free entry."""
        admitted, fills = [], []
        while units:
            r, j = units[0]
            open_ = [d for d in range(devices) if free_slots[d]]
            if not open_:
                break
            have = [d for d in open_ if (r, d) in entry_of]
            if not have:
                fresh = [d for d in open_ if free_entries[d]]
                if not fresh:
                    stats.entry_waits += 1
                    break
                d = max(fresh, key=lambda d: len(free_slots[d]))
                entry_of[(r, d)] = heapq.heappop(free_entries[d])
                fills.append((entry_of[(r, d)], r))
            else:
                d = max(have, key=lambda d: len(free_slots[d]))
            e = entry_of[(r, d)]
            slot = heapq.heappop(free_slots[d])
            units.popleft()
            left[r] -= 1
            readers[e] += 1
            admitted.append((r, j, slot, e))
            release(r)
        return admitted, fills

    while units or any(o is not None for o in owner):
        admitted, fills = admit()
        if admitted:
            for r, _, _, _ in admitted:
                if r not in started:
                    started.add(r)
                    stats.queue_wait_chunks += stats.chunks
            reqs = np.asarray([a[0] for a in admitted], np.int32)
            slots_args = (
                _pad(np.asarray([a[3] for a in admitted], np.int32), s, 0),
                _pad(np.asarray([a[2] for a in admitted], np.int32), s, s), _pad(reqs, s, 0),
                _pad(np.asarray([a[1] for a in admitted], np.int32), s, 0), _pad(limits_arr[reqs], s, 1),
                rng, temp, tp,
            )
            with context():
                if fills:  # new prompts: prefilled into their entries (at most max_prefill per call), then
                    # the slots started by the last call
                    parts = [fills[i:i + max_prefill] for i in range(0, len(fills), max_prefill)]
                    idle = (np.zeros(s, np.int32), np.full(s, s, np.int32)) + (np.zeros(s, np.int32),) * 2 + (
                        np.ones(s, np.int32), rng, temp, tp)  # starts nothing (every slot entry dropped)
                    for k, part in enumerate(parts):
                        entries = np.asarray([e for e, _ in part], np.int32)
                        fill_reqs = np.asarray([r for _, r in part], np.int32)
                        u = next_pow2(len(part))
                        state, tok, lp, done = prefill_fn(
                            gen_params, state, _pad(tokens_all[fill_reqs], u, pad_id),
                            _pad(mask_all[fill_reqs], u, False), _pad(entries, u, q),
                            *(slots_args if k == len(parts) - 1 else idle))
                        stats.prefills += 1
                    stats.prompts_prefilled += len(fills)
                else:
                    state, tok, lp, done = start_fn(state, *slots_args)
            tok, lp, done = jax.device_get((tok, lp, done))
            for i, (r, j, slot, e) in enumerate(admitted):
                owner[slot] = (r, j)
                slot_entry[slot] = e
                pieces[(r, j)] = ([tok[i:i + 1]], [lp[i:i + 1]])
                if done[i]:
                    finish(slot)
        if not any(o is not None for o in owner):
            continue
        busy_now = sum(o is not None for o in owner)
        floor = s // 4 if not units and shrink and busy_now > s // 4 and per_slots > 1 else 0
        with context():
            state, toks, lps, emitted = (chunk_fn if units else drain_fn)(gen_params, state, rng, temp, tp,
                                                                         jnp.int32(floor))
        keys0 = state.cache.keys[0]
        stats.slots_per_device = max(stats.slots_per_device, int(keys0.sharding.shard_shape(keys0.shape)[0]))
        toks, lps, emitted, done = jax.device_get((toks, lps, emitted, state.done))
        stats.chunks += 1
        steps = int(emitted.any(axis=0).sum())
        stats.slot_steps += s * steps
        stats.busy_slot_steps += int(emitted.sum())
        for slot in range(s):
            unit = owner[slot]
            if unit is None:
                continue
            keep = emitted[slot]
            if keep.any():
                pieces[unit][0].append(toks[slot][keep])
                pieces[unit][1].append(lps[slot][keep])
            if done[slot]:
                finish(slot)
        # the tail: the busy slots of each device move to a smaller state on the same device
        busy = [[i for i in range(d * per_slots, (d + 1) * per_slots) if owner[i] is not None] for d in range(devices)]
        total = sum(len(b) for b in busy)
        smaller = next_pow2(max(max(len(b) for b in busy), 1))
        if shrink and not units and total and total * 4 <= s and smaller < per_slots:
            index, keep = [], []
            for d, b in enumerate(busy):
                index += b + [d * per_slots] * (smaller - len(b))
                keep += [True] * len(b) + [False] * (smaller - len(b))
            with context():
                state = _shrink_program(smaller * devices, layout, config.num_layers)(
                    state, np.asarray(index, np.int32), np.asarray(keep))
            owner = [owner[i] if k else None for i, k in zip(index, keep)]
            slot_entry = [slot_entry[i] for i in index]
            per_slots, s = smaller, smaller * devices
            free_slots = [[d * smaller + i for i in range(len(b), smaller)] for d, b in enumerate(busy)]
    return EngineResult(result, stats)


# ---------------------------------------------------------------------------------- for the memory planner
def cap_slots(slots: int, max_slots: int | None) -> int:
    """`slots`, at most `max_slots` rounded down to a power of two (None: no cap)."""
    return slots if max_slots is None else min(slots, 1 << (max(int(max_slots), 1).bit_length() - 1))


def planned_slots(config: ModelConfig, prompt_len: int, rows: int, share: int, spec: EngineSpec) -> tuple[int, int]:
    """(S, Q) as `run` with `spec` picks them for a run of `rows` completions, `share` per
    request, of prompts of `prompt_len` tokens (their bucket)."""
    layout = make_layout(config, spec.mesh)
    return plan_slots(config, prompt_len, spec.max_new_tokens, rows, share, _groups(layout), spec.kv_budget_bytes,
                      spec.num_slots, spec.num_entries, spec.max_slots)


def planned_programs(
    config: ModelConfig,
    params: Any,
    spec: EngineSpec,
    *,
    slots: int,
    entries: int,
    prompt_len: int,
    select: bool = False,
) -> list[tuple[str, Any, tuple]]:
    """[(name, jitted program, abstract arguments)] of the engine's prefill (its largest call:
    U = next_pow2(min(entries, slots)) prompts, at most `planned_prefill`, every slot started) and decode
    programs (the drain's, whose output buffers hold max_new_tokens steps, not chunk_steps: the larger of
    the two) for `slots` slots and `entries` pool entries, as `run` with `spec` builds them on its mesh
    (the start-only program is the prefill's second half). `params`: arrays or ShapeDtypeStructs (with their shardings), stacked [P, ...] with
    `select` (one policy's slice generated). Nothing is allocated; the parameter preparation
    (cast to the compute dtype) is compiled to learn its output shardings."""
    from jmarl.sharding import mesh_context

    mesh, max_new_tokens = spec.mesh, spec.max_new_tokens
    prepare = _prepare_program(config, select)
    abstract = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
    args = (abstract(params),) + ((jax.ShapeDtypeStruct((), jnp.int32),) if select else ())
    with mesh_context(mesh):
        compiled = prepare.lower(*args).compile()
    out_sh = compiled.output_shardings
    shapes = jax.eval_shape(prepare, *args)
    layout = make_layout(config, mesh)
    if layout is not None:
        gen = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, out_sh)
        layout = make_layout(config, mesh, gen)
    else:
        gen = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)
    state = jax.eval_shape(_init_program(config, slots, entries, prompt_len, int(max_new_tokens), layout))
    if layout is not None:
        state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state,
                             layout.state_shardings(config.num_layers))
    key = jax.eval_shape(lambda: jax.random.key(0))
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    u = next_pow2(min(entries, slots, planned_prefill(config, prompt_len, spec)))
    prefill_args = (gen, state, i32(u, prompt_len), jax.ShapeDtypeStruct((u, prompt_len), bool), i32(u)) + (
        i32(slots),) * 5 + (key, f32, f32)
    decode_args = (gen, state, key, f32, f32, i32())
    sampling = spec.program_sampling()
    return [
        ("engine_prefill", _prefill_program(config, *sampling, layout), prefill_args),
        ("engine_decode", _chunk_program(config, max(int(spec.chunk_steps), int(max_new_tokens)), *sampling,
                                         int(spec.pad_id), layout), decode_args),
    ]
