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
  one layer at a time, `jmarl.models.kv_cache.take_rows`) followed by the slot's own cache; while
  every request asks the same G completions and each request's busy slots are the G
  consecutive slots i G .. i G + G - 1 reading entry i (counted per device), the slots read their
  prompts in groups instead, in place, with the static sampler's group attention (no gather);
- a run whose completions all fit the slots at once (nothing queued after the first admission,
  its prompts within one prefill call) is one fused program: state, prefill, start and drain,
  with the policy's parameters selected and cast inside it (no separate cast program). It
  stops where the drain would (the run's end, or its tail's shrink point), and the general
  programs decode what is left.

Host part (`run`, or `start` then `EngineRun.result`): between chunks the finished slots are
harvested (vectorised over the slots) and refilled from the queue; a pool entry is taken when a
request's first completion is admitted and given back when its last completion ends. With no
entry free, the queue waits (`EngineStats.entry_waits`). A refill's outputs are fetched together
with the next chunk's (one host sync per chunk). `start` returns once the first program is
dispatched, so a caller's host work overlaps it.

Exactness and reproducibility: every sampled token's log-prob is under softmax(logits / T)
before truncation (as the static sampler reports it, equal to re-scoring with
`jmarl.models.token_logprobs`). The draw of token t of completion j of request r is entry t of
uniform(fold_in(fold_in(rng, r), j), (N,)), made when the completion's slot is filled: the
outputs depend on the seed only, not on which slot or chunk served a completion, so runs with
different slot counts give the same completions (up to the rounding of the attention's two
forms, grouped and gathered, and of the fused and the separate programs: about 1e-6 in the
log-probs, which can move a sampled token whose draw lies that close to a boundary of its CDF).

The budget (bytes per device): a slot costs `slot_bytes` (layers x 2 x kv_heads x head_dim x G x
dtype bytes), a pool entry `entry_bytes` (the same for P tokens, plus its float32 logits); both
caches are windowed (`jmarl.models.kv_cache`): a sliding-window layer counts min(G, W) and
min(P, W) tokens, the window it keeps (its slot's ring, its entry's last prompt slots). With
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
from jmarl.models.decode import Ring, decode_step, prefill, ring_mask, window_block_mask
from jmarl.models.kv_cache import KVCache, empty_cache, layer_capacities, take_rows, window_capacity
from jmarl.models.model import CACHE_KEY_AXES, Params
from jmarl.models.sampler import generation_params, policy_axes, sample_token, select_policy
from jmarl.padding import DEFAULT_LENGTH_BUCKETS, bucket_length, next_pow2
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules
from jmarl.sharding.specs import row_axes
from jmarl.sharding import mesh_context

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


def kv_bytes(config: ModelConfig, tokens: int, windowed: bool = False) -> int:
    """KV-cache bytes of one row of `tokens` tokens: 2 x kv_heads x head_dim x dtype bytes x the
    slots of each layer, `tokens` (layers x `tokens` in all) or with `windowed` min(tokens, W)
    on the sliding-window layers (`jmarl.models.kv_cache.layer_capacities`)."""
    itemsize = jnp.dtype(config.compute_dtype).itemsize
    return 2 * config.num_kv_heads * config.head_dim * itemsize * sum(layer_capacities(config, tokens, windowed))


def generated_capacity(max_new_tokens: int) -> int:
    """G: the cache positions of a slot's own tokens (the last sampled token is never written)."""
    return max(int(max_new_tokens) - 1, 1)


def slot_bytes(config: ModelConfig, max_new_tokens: int) -> int:
    """Bytes of one slot: the KV cache of its G generated tokens (windowed: at most W of them
    on the sliding-window layers)."""
    return kv_bytes(config, generated_capacity(max_new_tokens), windowed=True)


def entry_bytes(config: ModelConfig, prompt_len: int) -> int:
    """Bytes of one pool entry: the KV cache of a prompt of `prompt_len` tokens (windowed: its
    last W on the sliding-window layers) and its float32 next-token logits."""
    return kv_bytes(config, prompt_len, windowed=True) + 4 * config.vocab_size


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
                rules: ShardingRules = DEFAULT_RULES, select: bool = False) -> Layout | None:
    """The engine's layout on `mesh` (None without a mesh of several devices) by `rules`: the
    slot axis on the mesh axes of an unstacked "batch" of size > 1 (default data, fsdp and the
    spare policy axis: a run decodes one policy, whose weights are gathered over the slot axes
    like FSDP shards; S is rounded up to their product, so none is dropped), the cache's heads on those of "kv_heads"
    that divide num_kv_heads (default tensor). `params` (the generation parameters, placed)
    give the gathered shardings of the weights; with `select`, params stacked over policies
    whose one policy a program selects (`select_policy`): the gathered shardings are those of
    the selected slices (a stacked leaf's spec without its policy entry)."""
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
    stacked = [False] * len(leaves)
    if select:
        stacked = [a == 0 for a in jax.tree.leaves(policy_axes(config, params), is_leaf=lambda a: a is None)]

    def gathered(leaf, policy_axis: bool):
        sh = getattr(leaf, "sharding", None)
        if not isinstance(sh, NamedSharding) or sh.mesh != mesh:
            return None
        return NamedSharding(mesh, _without(P(*sh.spec[1:]) if policy_axis else sh.spec, rows))

    return Layout(mesh, rows, heads, treedef, tuple(gathered(leaf, s) for leaf, s in zip(leaves, stacked)))


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


def _empty_state(config: ModelConfig, slots: int, entries: int, prompt_len: int, max_new_tokens: int) -> EngineState:
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
def _init_program(config: ModelConfig, slots: int, entries: int, prompt_len: int, max_new_tokens: int,
                  layout: Layout | None = None):
    def program():
        _TRACES["init"] += 1
        return _empty_state(config, slots, entries, prompt_len, max_new_tokens)

    return _jit(program, layout, config.num_layers, None, 1, ())


def _choose(logits, rng, uniform, temperature, top_p, *, greedy, top_k, use_top_p):
    return sample_token(logits, rng, temperature, top_p, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                        uniform=None if greedy else uniform)


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


def _leading_rows(buffer: jax.Array, groups: int, rows: int) -> jax.Array:
    """buffer [Q, ...] in `groups` equal parts (one per device) -> [groups * rows, ...]: the
    first `rows` rows of each part, in order (a slice of each device's own part)."""
    q = buffer.shape[0]
    parts = buffer.reshape((groups, q // groups) + buffer.shape[1:])[:, :rows]
    return parts.reshape((groups * rows,) + buffer.shape[1:])


def _decode(gen_config: ModelConfig, params: Params, state: EngineState, rng, temperature, top_p, floor, *,
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
    its tokens, or in its ring, no longer read) and reads draw i + 1, instead of a write and a read at each row's own count.

    Sliding-window layers (windowed caches, `_empty_state`): a slot writes its generated token j
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
        token, logprob = _choose(logits, rng, uniform, temperature, top_p,
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
                   stop_tokens: tuple[int, ...], pad_id: int, layout: Layout | None = None, group_size: int = 0):
    """(params, state, rng, temperature, top_p, floor) -> (state, tokens int32[S, K], logprobs
    float32[S, K], emitted bool[S, K]): `_decode` of up to K = `steps` steps; `floor` (int32,
    traced) the busy slots at which the loop stops early when more are busy at its start (0:
    none), `group_size` its prompt layout (0: a gather per slot)."""
    gen_config = config.replace(param_dtype=config.compute_dtype)
    decode = functools.partial(_decode, gen_config, steps=steps, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                               stop_tokens=stop_tokens, pad_id=pad_id, groups=_groups(layout), group_size=group_size)

    def program(params, state, rng, temperature, top_p, floor):
        _TRACES["decode"] += 1
        # gathered once per chunk: the loop reads gathered weights
        return decode(_gathered(layout, params), state, rng, temperature, top_p, floor)

    return _jit(program, layout, config.num_layers, 1, 4, (1,))


@functools.lru_cache(maxsize=None)
def _fused_program(config: ModelConfig, slots: int, entries: int, prompt_len: int, max_new_tokens: int, steps: int,
                   greedy: bool, top_k: int, use_top_p: bool, stop_tokens: tuple[int, ...], pad_id: int,
                   layout: Layout | None = None, group_size: int = 0, select: bool = False):
    """(params, policy, tokens [U,P], mask [U,P], fill [U], entry [S], dest [S], request [S],
    completion [S], limit [S], rng, temperature, top_p, floor) -> (state, token [S], logprob [S],
    done [S], tokens int32[S, K], logprobs float32[S, K], emitted bool[S, K]): a run whose
    completions all fit the slots at once, in one program: an empty state (`_init_program`), the
    U prompts prefilled and the slots started (`_prefill_program`), then the drain
    (`_chunk_program` of K = `steps` steps). The same computations as those three programs
    called in turn, without the host between them. params: as the caller gave them, prepared
    in the program (`_prepare`: policy `policy` (int32) of params stacked over policies with
    `select`, cast to the compute dtype), then gathered as `layout` says (`make_layout` with
    `select`)."""
    gen_config = config.replace(param_dtype=config.compute_dtype)
    groups = _groups(layout)
    start = functools.partial(_start_slots, groups=groups, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                              stop_tokens=stop_tokens)
    decode = functools.partial(_decode, gen_config, steps=steps, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                               stop_tokens=stop_tokens, pad_id=pad_id, groups=groups, group_size=group_size,
                               aligned=True)

    def program(params, policy, tokens, mask, fill, entry, dest, request, completion, limit, rng, temperature, top_p,
                floor):
        _TRACES["fused"] += 1
        # once: the prefill and the decode loop read the policy's weights, cast and gathered
        params = _gathered(layout, _prepare(config, params, policy if select else None))
        state = _empty_state(config, slots, entries, prompt_len, max_new_tokens)
        if layout is not None:
            state = jax.lax.with_sharding_constraint(state, layout.state_shardings(config.num_layers))
        state = _fill_entries(gen_config, params, state, tokens, mask, fill)
        state, token, logprob, done = start(state, entry, dest, request, completion, limit, rng, temperature, top_p)
        state, toks, lps, emitted = decode(params, state, rng, temperature, top_p, floor)
        return state, token, logprob, done, toks, lps, emitted

    return _jit(program, layout, config.num_layers, None, 7, ())


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
    chunks: int = 0  # decode calls that ran at least one step (a fused run's drain included)
    grouped_chunks: int = 0  # of them, those whose slots read their prompts in groups (`_decode`'s group_size)
    fused: int = 0  # runs served by one program (`_fused_program`): every completion fit the slots at once
    prefills: int = 0  # prefill calls (a fused run's included)
    prompts_prefilled: int = 0  # pool entries filled (a request served on several devices: once per device)
    requests: int = 0
    queue_wait_chunks: int = 0  # sum over requests of the chunks run before its first completion started
    entry_waits: int = 0  # refills that left slots free because no pool entry was
    slots: int = 0  # S of the last run
    entries: int = 0  # Q of the last run
    slots_per_device: int = 0  # slots each device holds (the cache's shard along the slot axis), largest seen

    def add(self, other: "EngineStats") -> None:
        for name in ("rows", "slot_steps", "busy_slot_steps", "chunks", "grouped_chunks", "fused", "prefills",
                     "prompts_prefilled", "requests", "queue_wait_chunks", "entry_waits"):
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
                       bucket of the longest one (`jmarl.padding.bucket_length`).
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


def group_size(config: ModelConfig, counts: Sequence[int]) -> int:
    """G of the grouped prompt layout (`_decode`): the completions per request when every
    request asks the same number, else 0 (a gather per slot). 0 for models with sliding-window
    layers: the slots of a group sit at different positions (one that stopped keeps its last),
    so each sees its own window of the shared prompt (`decode.window_block_mask`, per row),
    whereas the group attention takes one prompt mask per group."""
    if any(config.sliding_layers()) or not counts or min(counts) != max(counts):
        return 0
    return int(counts[0])


class _Book:
    """The host's bookkeeping of one run. Slot i and pool entry e lie on devices i // (S/D) and
    e // (Q/D); the free slots and entries of each device are heaps (the lowest index is taken
    first). Per slot: request int32[S] (-1: free), completion, entry int32[S], and its tokens so
    far, tokens int32[S, N], logprobs float32[S, N], length int32[S]."""

    def __init__(self, slots: int, entries: int, devices: int, max_new_tokens: int, counts: Sequence[int],
                 stats: EngineStats) -> None:
        self.s, self.devices = slots, devices
        self.per_slots, self.per_entries = slots // devices, entries // devices
        self.free_slots = [list(range(d * self.per_slots, (d + 1) * self.per_slots)) for d in range(devices)]
        self.free_entries = [list(range(d * self.per_entries, (d + 1) * self.per_entries)) for d in range(devices)]
        self.entry_of: dict[tuple[int, int], int] = {}  # (request, device) -> its pool entry there
        self.readers = np.zeros(entries, np.int32)  # slots reading each entry
        self.left = list(counts)  # completions of each request not admitted yet
        self.started = np.zeros(len(counts), bool)  # requests with a completion admitted
        self.request = np.full(slots, -1, np.int32)
        self.completion = np.zeros(slots, np.int32)
        self.entry = np.zeros(slots, np.int32)
        self.tokens = np.zeros((slots, max_new_tokens), np.int32)
        self.logprobs = np.zeros((slots, max_new_tokens), np.float32)
        self.length = np.zeros(slots, np.int32)
        self.result: list[list[tuple[np.ndarray, np.ndarray]]] = [[None] * c for c in counts]  # type: ignore[misc]
        self.stats = stats

    def busy(self) -> bool:
        return bool((self.request >= 0).any())

    def admit(self, units: collections.deque) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Moves queued completions (request, completion) into free slots: (int32[R, 4] of
        (request, completion, slot, entry), [(entry, request)] of the entries to prefill). A
        completion goes to a device where its request has an entry, else to the device with the
        most free slots that has a free entry; with none, the queue waits (`entry_waits`)."""
        admitted: list[tuple[int, int, int, int]] = []
        fills: list[tuple[int, int]] = []
        devices, free_slots, free_entries = range(self.devices), self.free_slots, self.free_entries
        while units:
            r, j = units[0]
            open_ = [d for d in devices if free_slots[d]]
            if not open_:
                break
            have = [d for d in open_ if (r, d) in self.entry_of]
            if not have:
                fresh = [d for d in open_ if free_entries[d]]
                if not fresh:
                    self.stats.entry_waits += 1
                    break
                d = max(fresh, key=lambda d: len(free_slots[d]))
                self.entry_of[(r, d)] = heapq.heappop(free_entries[d])
                fills.append((self.entry_of[(r, d)], r))
            else:
                d = max(have, key=lambda d: len(free_slots[d]))
            # the request's next completions all go to d while it has free slots, unless another
            # device with a free slot holds its entry too (then each completion picks again)
            take = 1 if len(have) > 1 else min(self.left[r], len(free_slots[d]))
            e = self.entry_of[(r, d)]
            slots = [heapq.heappop(free_slots[d]) for _ in range(take)]
            for _ in range(take):
                units.popleft()
            self.left[r] -= take
            self.readers[e] += take
            admitted += [(r, j + k, slot, e) for k, slot in enumerate(slots)]
            self._release(r)
        out = np.asarray(admitted, np.int32).reshape(-1, 4)
        new = out[:, 0][~self.started[out[:, 0]]]
        self.stats.queue_wait_chunks += self.stats.chunks * len(np.unique(new))
        self.started[new] = True
        self.request[out[:, 2]], self.completion[out[:, 2]], self.entry[out[:, 2]] = out[:, 0], out[:, 1], out[:, 3]
        self.length[out[:, 2]] = 0
        return out, fills

    def _release(self, r: int) -> None:
        """Gives back request r's entries that no slot reads, once all its completions are admitted."""
        if self.left[r]:
            return
        for d in range(self.devices):
            e = self.entry_of.get((r, d))
            if e is not None and self.readers[e] == 0:
                del self.entry_of[(r, d)]
                heapq.heappush(self.free_entries[d], e)

    def group_size(self, group: int) -> int:
        """`group` if every busy slot i reads its device's entry (i mod S/D) // group (so that
        `_decode` may read the prompts in groups) and the device's slots fit its entries that
        way, else 0."""
        if not group or self.per_slots % group or self.per_slots // group > self.per_entries:
            return 0
        owned = np.flatnonzero(self.request >= 0)
        want = (owned % self.per_slots) // group
        return group if np.array_equal(want, self.entry[owned] % self.per_entries) else 0

    def started_slots(self, admitted: np.ndarray, token: np.ndarray, logprob: np.ndarray, done: np.ndarray) -> None:
        """Records the first token of each admitted row (token/logprob/done [>= R], row i the
        slot admitted[i, 2]) and ends the rows done already."""
        slots, rows = admitted[:, 2], len(admitted)
        self.tokens[slots, 0], self.logprobs[slots, 0], self.length[slots] = token[:rows], logprob[:rows], 1
        self.finish(slots[done[:rows]])

    def decoded(self, tokens: np.ndarray, logprobs: np.ndarray, emitted: np.ndarray, done: np.ndarray) -> None:
        """Appends a decode call's outputs (tokens/logprobs/emitted [S, K], emitted True on a
        prefix of each slot's K steps) to the slots' tokens and ends the slots now done (bool[S])."""
        rows, cols = np.nonzero(emitted)
        at = self.length[rows] + cols
        self.tokens[rows, at], self.logprobs[rows, at] = tokens[rows, cols], logprobs[rows, cols]
        self.length += emitted.sum(axis=1, dtype=np.int32)
        self.finish(np.flatnonzero(done & (self.request >= 0)))

    def finish(self, slots: np.ndarray) -> None:
        """Stores the completions of `slots` and frees them (and the entries no slot reads)."""
        tokens, logprobs = self.tokens[slots], self.logprobs[slots]  # copies: the slots' buffers are reused
        requests, completions, lengths = (a[slots].tolist() for a in (self.request, self.completion, self.length))
        self.request[slots] = -1
        np.subtract.at(self.readers, self.entry[slots], 1)
        for i, slot in enumerate(slots.tolist()):
            n = lengths[i]
            self.result[requests[i]][completions[i]] = (tokens[i, :n], logprobs[i, :n])
            heapq.heappush(self.free_slots[slot // self.per_slots], slot)
        for r in set(requests):
            self._release(r)
        self.stats.rows += len(slots)

    def shrink(self, enabled: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """The tail: when `enabled` (the queue empty) and at most a quarter of the slots are busy,
        (index int32[S'], keep bool[S']) of a smaller state, S' / D = next_pow2 of the busiest
        device's busy slots: each device's busy slots, in order, then padding (its first slot,
        keep False); the bookkeeping moves with them. None when the state stays."""
        busy = (self.request >= 0).reshape(self.devices, self.per_slots)
        total = int(busy.sum())
        smaller = next_pow2(max(int(busy.sum(axis=1).max()), 1))
        if not (enabled and total and total * 4 <= self.s and smaller < self.per_slots):
            return None
        index, keep = [], []
        for d, row in enumerate(busy):
            mine = (np.flatnonzero(row) + d * self.per_slots).tolist()
            index += mine + [d * self.per_slots] * (smaller - len(mine))
            keep += [True] * len(mine) + [False] * (smaller - len(mine))
        index_arr, keep_arr = np.asarray(index, np.int32), np.asarray(keep)
        self.request = np.where(keep_arr, self.request[index_arr], -1).astype(np.int32)
        for name in ("completion", "entry", "tokens", "logprobs", "length"):
            setattr(self, name, getattr(self, name)[index_arr])
        self.per_slots, self.s = smaller, smaller * self.devices
        counts = busy.sum(axis=1)
        self.free_slots = [[d * smaller + i for i in range(int(c), smaller)] for d, c in enumerate(counts)]
        return index_arr, keep_arr


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
    as placed (see the module docstring).

    A run whose completions all fit the slots at once (and whose prompts one prefill call
    holds) runs as one program (`_fused_program`) until its tail can shrink (or it ends); other
    runs alternate refills (prefill / start programs) and decode chunks. A decode call's outputs
    are fetched together with those of the refill before it (one host sync per chunk).
    `start(...).result()`: see `start` to overlap host work with the first program."""
    return start(config, params, prompts, n, rng, spec, limits=limits, policy=policy).result()


class EngineRun:
    """A run begun by `start`: its first device program is dispatched (asynchronously).
    `block_until_ready()` does the rest of its device work (the host drives refills and decode
    chunks) and lets go of its device state (KV caches and prompt pool); `result()` then gives its
    `EngineResult`. `jax.block_until_ready` on a run (a leaf) calls its `block_until_ready`."""

    def __init__(self, steps: Any) -> None:
        self._steps = steps
        self._result: EngineResult | None = None

    def block_until_ready(self) -> "EngineRun":
        if self._result is None:
            try:
                next(self._steps)
            except StopIteration as end:
                self._result = end.value
            else:
                raise AssertionError("an engine run yields once, after its first dispatch")
        return self

    def result(self) -> EngineResult:
        return self.block_until_ready()._result  # type: ignore[return-value]


def check_no_routing_replay(config: ModelConfig) -> None:
    """The engine does not record the experts its tokens run (routing replay, `ModelConfig.
    replays_routing`): a JmarlError saying what to change for such a config."""
    if config.replays_routing:
        raise JmarlError(
            "the continuous engine does not record each token's experts, which routing replay needs "
            "(model.routing_replay: replay); sample with sampling.engine: static, or set model.routing_replay: off")


def start(
    config: ModelConfig,
    params: Params,
    prompts: Sequence[Sequence[int]],
    n: int | Sequence[int],
    rng: jax.Array,
    spec: EngineSpec,
    *,
    limits: Sequence[int] | None = None,
    policy: int | None = None,
) -> EngineRun:
    """`run`, returning once its first device program is dispatched (arguments checked, slots
    planned, the first completions admitted): the caller's host work until
    `EngineRun.block_until_ready()` / `result()` overlaps that program (a fused run: all of its
    device work). Errors in the arguments are raised here."""
    steps = _run_steps(config, params, prompts, n, rng, spec, limits, policy)
    next(steps)
    return EngineRun(steps)


def _run_steps(config: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], n: int | Sequence[int],
               rng: jax.Array, spec: EngineSpec, limits: Sequence[int] | None, policy: int | None):
    """`run` as a generator: yields once, after the first device program is dispatched (or
    before any, for a run of no completions), and returns the EngineResult."""
    from jmarl.models.sampler import _check_options, left_align

    max_new_tokens, temperature, top_p, top_k = spec.max_new_tokens, spec.temperature, spec.top_p, spec.top_k
    pad_id, chunk_steps, shrink, mesh = spec.pad_id, spec.chunk_steps, spec.shrink, spec.mesh
    _check_options(max_new_tokens, temperature, top_p, top_k)
    check_no_routing_replay(config)
    counts = [int(n)] * len(prompts) if isinstance(n, (int, np.integer)) else [int(c) for c in n]
    if len(counts) != len(prompts):
        raise JmarlError(f"n has {len(counts)} entries for {len(prompts)} prompts")
    big_n = int(max_new_tokens)
    limits_arr = np.full(len(prompts), big_n, np.int32) if limits is None else np.minimum(
        np.asarray(limits, np.int32), big_n)
    if (limits_arr < 1).any():
        raise JmarlError("every request's limit must be >= 1")
    stats = EngineStats(requests=len(prompts))
    units = collections.deque((r, j) for r, c in enumerate(counts) for j in range(c))
    if not units:
        yield
        return EngineResult([[] for _ in counts], stats)
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
    longest = max(lengths)
    raw = np.full((len(prompts), longest), pad_id, np.int32)
    raw_mask = np.arange(longest)[None, :] >= (longest - np.asarray(lengths))[:, None]
    for r, ids in enumerate(prompts):
        raw[r, longest - len(ids):] = ids
    tokens_all, mask_all = left_align(raw, raw_mask, p_len, pad_id)
    if tokens_all.min() < 0 or tokens_all.max() >= config.vocab_size:
        raise JmarlError(f"prompt token ids must be in [0, {config.vocab_size}), the model's vocabulary")

    select = policy is not None
    policy_arg = np.int32(0 if policy is None else policy)
    if layout is not None:  # leaves not on the mesh (e.g. single-device parameters): replicated on it
        replicated = NamedSharding(layout.mesh, P())
        params = jax.tree.map(
            lambda x: x if isinstance(x.sharding, NamedSharding) and x.sharding.mesh == layout.mesh
            else jax.device_put(x, replicated), params)
    sampling = spec.program_sampling()
    # once the queue is empty no slot can be refilled: the drain runs until the run ends, or
    # until few enough slots are busy for the state to shrink
    drain_steps = max(int(chunk_steps), big_n)
    temp = np.float32(1.0 if spec.greedy else temperature)
    tp = np.float32(top_p)
    group = group_size(config, counts)
    book = _Book(s, q, devices, big_n, counts, stats)
    state = None
    first = True
    general: list[tuple[Params, Layout | None]] = []  # (prepared parameters, their layout), made on first use

    def prepared() -> tuple[Params, Layout | None]:
        """The parameters of the refill and decode-chunk programs: the policy's, cast once
        (`_prepare_program`), with the layout of their shardings."""
        if not general:
            prepare = _prepare_program(config, select)
            gen = prepare(params, policy_arg) if select else prepare(params)
            general.append((gen, None if layout is None else make_layout(config, layout.mesh, gen)))
        return general[0]

    def context() -> Any:
        """The mesh context of the programs (entered per dispatch: never across the `yield`)."""
        return mesh_context(None if layout is None else layout.mesh)

    def prompt_args(part: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [U, P], mask [U, P], entries [U]) of the prompts to prefill, U = next_pow2(len(part))."""
        u = next_pow2(len(part))
        reqs = np.asarray([r for _, r in part], np.int32)
        return (_pad(tokens_all[reqs], u, pad_id), _pad(mask_all[reqs], u, False),
                _pad(np.asarray([e for e, _ in part], np.int32), u, q))

    while units or book.busy():
        admitted, fills = book.admit(units)
        with context():
            started = decoded = None
            # the busy slots at which a drain stops, so that the tail can shrink (0: none)
            floor = np.int32(book.s // 4 if not units and shrink and book.per_slots > 1 else 0)
            if len(admitted):
                reqs, width = admitted[:, 0], book.s  # padded to the slots; dest S (out of range): dropped
                slots_args = (_pad(admitted[:, 3], width, 0), _pad(admitted[:, 2], width, width), _pad(reqs, width, 0),
                              _pad(admitted[:, 1], width, 0), _pad(limits_arr[reqs], width, 1), rng, temp, tp)
                if state is None and not units and len(fills) <= max_prefill:  # the whole run fits: one program
                    grouped = book.group_size(group)
                    fused_fn = _fused_program(config, s, q, p_len, big_n, drain_steps, *sampling, int(pad_id),
                                              make_layout(config, mesh, params, select=select), grouped, select)
                    state, *out = fused_fn(params, policy_arg, *prompt_args(fills), *slots_args, floor)
                    started, decoded = out[:3], out[3:]
                    stats.fused += 1
                    stats.grouped_chunks += bool(grouped)
                    stats.prefills += 1
                else:
                    if state is None:
                        state = _init_program(config, s, q, p_len, big_n, layout)()
                    if fills:  # new prompts: prefilled into their entries (at most max_prefill per call), then
                        # the slots started by the last call
                        gen_params, gen_layout = prepared()
                        prefill_fn = _prefill_program(config, *sampling, gen_layout)
                        parts = [fills[i:i + max_prefill] for i in range(0, len(fills), max_prefill)]
                        zeros = np.zeros(width, np.int32)
                        # starts nothing: every slot's dest out of range, dropped
                        idle = (zeros, np.full(width, width, np.int32), zeros, zeros, np.ones(width, np.int32), rng,
                                temp, tp)
                        for k, part in enumerate(parts):
                            state, *started = prefill_fn(gen_params, state, *prompt_args(part),
                                                         *(slots_args if k == len(parts) - 1 else idle))
                        stats.prefills += len(parts)
                    else:
                        state, *started = _start_program(config, *sampling, layout)(state, *slots_args)
                stats.prompts_prefilled += len(fills)
            if decoded is None and book.busy():
                gen_params, gen_layout = prepared()
                grouped = book.group_size(group)
                chunk_fn = _chunk_program(config, int(chunk_steps) if units else drain_steps, *sampling, int(pad_id),
                                          gen_layout, grouped)
                state, *decoded = chunk_fn(gen_params, state, rng, temp, tp, floor)
                stats.grouped_chunks += bool(grouped)
        if decoded is None:
            continue
        if first:  # the caller's host work may run while this program does (`start`)
            first = False
            yield
        with context():
            keys0 = state.cache.keys[0]
            stats.slots_per_device = max(stats.slots_per_device, int(keys0.sharding.shard_shape(keys0.shape)[0]))
            started, (toks, lps, emitted, done) = jax.device_get((started, (*decoded, state.done)))
            if started is not None:
                book.started_slots(admitted, *started)
            steps = int(emitted.any(axis=0).sum())
            if steps:
                stats.chunks += 1
            stats.slot_steps += book.s * steps
            stats.busy_slot_steps += int(emitted.sum())
            book.decoded(toks, lps, emitted, done)
            moved = book.shrink(shrink and not units)
            if moved is not None:  # the busy slots of each device move to a smaller state on the same device
                state = _shrink_program(book.s, layout, config.num_layers)(state, *moved)
    if first:  # not reached (the first admission dispatches a program): `start` expects one yield
        yield
    return EngineResult(book.result, stats)


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
    (the start-only program is the prefill's second half; a run whose completions fit the
    slots at once runs `_fused_program` instead, whose state, cast weights and temporaries take no
    more than the prefill with its arguments). `params`: arrays or ShapeDtypeStructs (with their
    shardings), stacked [P, ...] with `select` (one policy's slice generated). Nothing is
    allocated; the parameter preparation (cast to the compute dtype) is compiled to learn its
    output shardings."""
    check_no_routing_replay(config)
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
                                         int(spec.pad_id), layout, 0), decode_args),
    ]
