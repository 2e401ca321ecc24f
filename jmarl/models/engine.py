"""Continuous-batching generation engine: S slots, a queue, a KV-cache budget.

Device part (pure, jitted, static shapes):
- the engine state holds S slots, each with its own KV-cache row of capacity C = P + N - 1
  (P the prompt bucket of the call, N = max_new_tokens; the same capacity as the static
  sampler's `jmarl.models.sampler`) and its own write index, RoPE position, prompt mask, last
  token, request/completion ids and length limit;
- `prefill_slots` prefills U distinct prompts once and writes each prompt's keys/values into the
  R slots that continue it (a request asking n completions prefills its prompt once and copies
  the prompt's cache into its n slots), sampling each slot's first token. U is rounded up to a
  power of two and the R slot entries padded to S (extra entries target slot S and are dropped
  by the scatter), so one program is compiled per U;
- `decode_chunk` runs up to K decode steps for all S slots (a `lax.while_loop` that also stops
  as soon as every slot is done) and returns the tokens, log-probs and emitted flags of the chunk.

Host part (`run`): between chunks the finished slots are harvested and refilled from the queue.

Exactness and reproducibility: every sampled token's log-prob is under softmax(logits / T)
before truncation (as the static sampler reports it, equal to re-scoring with
`jmarl.models.token_logprobs`). The draw of token t of completion j of request r is entry t of
uniform(fold_in(fold_in(rng, r), j), (N,)), made when the completion's slot is filled: the
outputs depend on the seed only, not on which slot or chunk served a completion, so runs with
different slot counts give the same completions.

The budget: a slot's cache costs layers x 2 x kv_heads x head_dim x C x dtype bytes; the engine
runs S = the largest power of two whose slots fit `kv_budget_bytes` (no more than the rows asked
for, rounded up to a power of two). A call whose single slot does not fit is refused.

On a mesh (`run(..., mesh=...)`): the slot axis of the KV cache and of every per-slot field is
sharded like activation rows (the mesh axes of "activation_batch" in `jmarl.sharding.ShardingRules`,
default data, fsdp; S rounded up to a multiple of their product, the budget being per device:
S/(data x fsdp) slots must fit it), the cache's key/value heads like "kv_heads" (tensor); each
device holds and decodes only its slots. The parameters stay as the caller placed them;
FSDP-sharded weights are gathered (already in the compute dtype) once at the top of each
prefill / decode-chunk program, so the decode loop reads gathered weights instead of gathering
them at every step. The programs are jitted with the state's shardings in and out (and the
state donated), so the cache stays sharded between calls.
"""

from __future__ import annotations

import collections
import functools
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
from jmarl.models.model import BATCH_AXES, CACHE_KEY_AXES, KVCache, Params, decode_step, empty_cache, prefill
from jmarl.models.sampler import generation_params, sample_token, select_policy
from jmarl.rollouts import DEFAULT_LENGTH_BUCKETS, bucket_length, next_pow2
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules

DEFAULT_CHUNK_STEPS = 8
CPU_DEFAULT_KV_BUDGET = 1 << 30  # 1 GiB when the device reports no memory limit (CPU)
DEVICE_KV_FRACTION = 0.25  # of the device's memory limit, when it reports one


@struct.dataclass
class EngineState:
    """The slots on device. cache: [S, ...] rows of capacity C; prompt_mask bool[S, P] (the
    slot's prompt, left-padded); prompt_len, token (the last sampled), count (tokens generated),
    limit (max tokens of this slot), request, completion int32[S]; done bool[S] (free or finished);
    uniforms float32[S, N]: the draws of the slot's N tokens, made when it is filled."""

    cache: KVCache
    prompt_mask: jax.Array
    prompt_len: jax.Array
    token: jax.Array
    count: jax.Array
    limit: jax.Array
    request: jax.Array
    completion: jax.Array
    done: jax.Array
    uniforms: jax.Array


_TRACES = collections.Counter()


def num_traces() -> dict[str, int]:
    """How many times each engine program has been traced (= compiled) in this process."""
    return dict(_TRACES)


def slot_bytes(config: ModelConfig, capacity: int) -> int:
    """KV-cache bytes of one slot of `capacity` tokens: layers x 2 x kv_heads x head_dim x C x dtype."""
    itemsize = jnp.dtype(config.compute_dtype).itemsize
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * capacity * itemsize


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


def slots_for_budget(config: ModelConfig, capacity: int, budget: int, rows: int) -> int:
    """S: the largest power of two with S x `slot_bytes` <= budget, and no more than
    next_pow2(rows). Raises JmarlError when not even one slot fits."""
    per_slot = slot_bytes(config, capacity)
    if per_slot > budget:
        raise JmarlError(
            f"one generation row needs {per_slot} bytes of KV cache ({capacity} tokens: prompt bucket + "
            f"max_new_tokens) but sampling.kv_budget_bytes is {budget}: raise sampling.kv_budget_bytes or lower "
            "sampling.max_prompt_len / sampling.max_new_tokens"
        )
    fit = 1 << (int(budget // per_slot).bit_length() - 1)
    return max(1, min(fit, next_pow2(max(rows, 1))))



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
        """NamedSharding per field of an EngineState: slots over `rows`, cache heads over `heads`."""
        row = NamedSharding(self.mesh, self.row_spec())
        cache = NamedSharding(self.mesh, self.cache_spec())
        return EngineState(
            cache=KVCache(keys=(cache,) * num_layers, values=(cache,) * num_layers), prompt_mask=row,
            prompt_len=row, token=row, count=row, limit=row, request=row, completion=row, done=row, uniforms=row,
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
    rows = tuple(a for a in rules.mesh_axes(BATCH_AXES[0], stacked=False) if sizes.get(a, 1) > 1)
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
    return generation_params(config, params, False)


@functools.lru_cache(maxsize=None)
def _prepare_program(config: ModelConfig, select: bool):
    def program(params, policy=None):
        _TRACES["prepare"] += 1
        return _prepare(config, params, policy if select else None)

    return jax.jit(program)


@functools.lru_cache(maxsize=None)
def _init_program(config: ModelConfig, slots: int, prompt_len: int, capacity: int, layout: Layout | None = None):
    def program():
        _TRACES["init"] += 1
        zeros = jnp.zeros((slots,), jnp.int32)
        return EngineState(
            cache=empty_cache(config, (slots,), capacity), prompt_mask=jnp.zeros((slots, prompt_len), bool),
            prompt_len=zeros, token=zeros, count=zeros, limit=zeros, request=zeros, completion=zeros,
            done=jnp.ones((slots,), bool), uniforms=jnp.zeros((slots, capacity - prompt_len + 1), jnp.float32),
        )

    return _jit(program, layout, config.num_layers, None, 1, ())


def _settings(greedy: bool, top_k: int, use_top_p: bool, stop_tokens: tuple[int, ...], pad_id: int):
    return dict(greedy=greedy, top_k=top_k, use_top_p=use_top_p, stop_tokens=stop_tokens, pad_id=pad_id)


def _choose(logits, rng, uniform, temperature, top_p, *, greedy, top_k, use_top_p):
    return sample_token(logits, rng, temperature, top_p, greedy=greedy, top_k=top_k, use_top_p=use_top_p,
                        uniform=None if greedy else uniform)


@functools.lru_cache(maxsize=None)
def _prefill_program(config: ModelConfig, greedy: bool, top_k: int, use_top_p: bool, stop_tokens: tuple[int, ...],
                     pad_id: int, layout: Layout | None = None):
    """(params, state, tokens [U,P], mask [U,P], source [R], dest [R], request [R],
    completion [R], limit [R], rng, temperature, top_p) -> (state, token [R], logprob [R],
    done [R]): slot dest[i] starts completion (request[i], completion[i]) of prompt source[i];
    dest[i] = S (out of range) marks an unused entry (dropped)."""
    gen_config = config.replace(param_dtype=config.compute_dtype)

    def program(params, state, tokens, mask, source, dest, request, completion, limit, rng, temperature, top_p):
        _TRACES["prefill"] += 1
        params = _gathered(layout, params)
        u, p = tokens.shape
        logits, prompt_cache = prefill(gen_config, params, tokens, mask, empty_cache(gen_config, (u,), p))
        logits = logits[source]
        uniforms = _row_uniforms(rng, request, completion, state.uniforms.shape[1])
        token, logprob = _choose(logits, rng, uniforms[:, 0], temperature, top_p, greedy=greedy,
                                 top_k=top_k, use_top_p=use_top_p)
        done = jnp.isin(token, jnp.asarray(stop_tokens, jnp.int32)) | (limit <= 1)

        def put(buf, new):
            return buf.at[dest].set(new, mode="drop")

        cache = state.cache
        keys = tuple(k.at[dest, :, :, :p].set(pk[source].astype(k.dtype), mode="drop")
                     for k, pk in zip(cache.keys, prompt_cache.keys))
        values = tuple(v.at[dest, :, :p, :].set(pv[source].astype(v.dtype), mode="drop")
                       for v, pv in zip(cache.values, prompt_cache.values))
        prompt_mask = mask[source].astype(bool)
        state = EngineState(
            cache=KVCache(keys=keys, values=values),
            prompt_mask=put(state.prompt_mask, prompt_mask),
            prompt_len=put(state.prompt_len, prompt_mask.sum(axis=1).astype(jnp.int32)),
            token=put(state.token, token),
            count=put(state.count, jnp.ones_like(request)),
            limit=put(state.limit, limit),
            request=put(state.request, request),
            completion=put(state.completion, completion),
            done=put(state.done, done),
            uniforms=put(state.uniforms, uniforms),
        )
        return state, token, logprob, done

    return _jit(program, layout, config.num_layers, 1, 4, (1,))


@functools.lru_cache(maxsize=None)
def _chunk_program(config: ModelConfig, steps: int, greedy: bool, top_k: int, use_top_p: bool,
                   stop_tokens: tuple[int, ...], pad_id: int, layout: Layout | None = None):
    """(params, state, rng, temperature, top_p) -> (state, tokens int32[S, K], logprobs
    float32[S, K], emitted bool[S, K]): up to K decode steps of every slot not done (the loop
    ends early once all are)."""
    gen_config = config.replace(param_dtype=config.compute_dtype)

    def program(params, state, rng, temperature, top_p):
        _TRACES["decode"] += 1
        params = _gathered(layout, params)  # once per chunk: the loop below reads gathered weights
        s, p = state.prompt_mask.shape
        gen_slots = state.cache.capacity - p
        layers = [jax.tree.map(lambda a: a[i], params["layers"]) for i in range(config.num_layers)]
        stops = jnp.asarray(stop_tokens, jnp.int32)
        out_tokens = jnp.full((s, steps), pad_id, jnp.int32)
        out_logprobs = jnp.zeros((s, steps), jnp.float32)
        out_emitted = jnp.zeros((s, steps), bool)

        def cond(carry):
            i, st = carry[0], carry[1]
            return (i < steps) & jnp.any(~st.done)

        def body(carry):
            i, st, out_tokens, out_logprobs, out_emitted = carry
            active = ~st.done
            count = st.count
            generated = jnp.arange(gen_slots)[None, :] < count[:, None]
            key_mask = jnp.concatenate([st.prompt_mask, generated], axis=1)
            write = p + jnp.clip(count - 1, 0, gen_slots - 1)
            logits, cache = decode_step(gen_config, params, st.cache, st.token, st.prompt_len + count - 1, write,
                                        key_mask, layers)
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
    """(state [S', ...] -> state [slots, ...]): rows `index` int32[slots] of the state, those
    with keep False marked done (padding rows). The tail of a run, once the queue is empty,
    decodes its last few rows with fewer slots."""

    def program(state, index, keep):
        _TRACES["shrink"] += 1
        state = jax.tree.map(lambda a: a[index], state)
        return state.replace(done=state.done | ~keep)

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
    prompts_prefilled: int = 0  # distinct prompts run through a prefill
    requests: int = 0
    queue_wait_chunks: int = 0  # sum over requests of the chunks run before its first completion started
    slots: int = 0  # S of the last run
    slots_per_device: int = 0  # slots each device holds (the cache's shard along the slot axis), largest seen

    def add(self, other: "EngineStats") -> None:
        for name in ("rows", "slot_steps", "busy_slot_steps", "chunks", "prefills", "prompts_prefilled", "requests",
                     "queue_wait_chunks"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.slots = other.slots
        self.slots_per_device = other.slots_per_device


@dataclass
class EngineResult:
    """completions[r][j] = (tokens int32[L], logprobs float32[L]) of completion j of request r."""

    completions: list[list[tuple[np.ndarray, np.ndarray]]]
    stats: EngineStats = field(default_factory=EngineStats)


def _pow2_pad(a: np.ndarray, size: int, fill: Any) -> np.ndarray:
    out = np.full((size,) + a.shape[1:], fill, a.dtype)
    out[: len(a)] = a
    return out


def run(
    config: ModelConfig,
    params: Params,
    prompts: Sequence[Sequence[int]],
    n: int | Sequence[int],
    rng: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    kv_budget_bytes: int | None = None,
    num_slots: int | None = None,
    max_slots: int | None = None,
    chunk_steps: int = DEFAULT_CHUNK_STEPS,
    limits: Sequence[int] | None = None,
    buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
    policy: int | None = None,
    shrink: bool = True,
    mesh: Any = None,
) -> EngineResult:
    """n[r] completions (an int: the same for every request) of each prompt (token ids) with
    continuous batching. `params` stacked [P, ...] with `policy` given: that policy's parameters.
    `limits[r]`: at most that many new tokens for request r (<= max_new_tokens; default
    max_new_tokens). Slots: `num_slots` if given, else from `kv_budget_bytes` (None: the
    device's default, `default_kv_budget`); see `slots_for_budget`; then at most `max_slots`
    (rounded down to a power of two; `sampling.max_rows_per_call`: rows in flight, the queue
    is not split). `shrink`: once the queue is
    empty and at most a quarter of the slots are busy, the busy rows move to a state of
    next_pow2(busy) slots (the long tail of a run then decodes only a few rows per step).
    `mesh` (a `jax.sharding.Mesh`): the slots are sharded over its batch axes (data, fsdp; S a
    multiple of their product), cache heads over tensor; `params` are used as placed (see the
    module docstring). The budget is then per device."""
    from jmarl.models.sampler import _check_options, left_align

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
    p_len = bucket_length(max(lengths), buckets)
    capacity = p_len + big_n - 1
    layout = make_layout(config, mesh)
    row_devices = 1 if layout is None else layout.row_devices
    if num_slots is None:
        budget = default_kv_budget() if kv_budget_bytes is None else int(kv_budget_bytes)
        slots_for_budget(config, capacity, budget, 1)  # refuses a slot that does not fit one device's budget
        num_slots = slots_for_budget(config, capacity, budget * row_devices, len(units))
    num_slots = cap_slots(int(num_slots), max_slots)
    s = -(-int(num_slots) // row_devices) * row_devices  # a multiple of the devices splitting the slots
    stats.slots = s
    width = max(lengths)
    raw = np.full((len(prompts), width), pad_id, np.int32)
    raw_mask = np.arange(width)[None, :] >= (width - np.asarray(lengths))[:, None]
    for r, ids in enumerate(prompts):
        raw[r, width - len(ids):] = ids
    tokens_all, mask_all = left_align(raw, raw_mask, p_len, pad_id)
    if tokens_all.min() < 0 or tokens_all.max() >= config.vocab_size:
        raise JmarlError(f"prompt token ids must be in [0, {config.vocab_size}), the model's vocabulary")

    greedy = float(temperature) == 0.0
    settings = (bool(greedy), int(top_k), float(top_p) < 1.0, tuple(int(t) for t in stop_tokens), int(pad_id))
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
    prefill_fn = _prefill_program(config, *settings, layout)
    chunk_fn = _chunk_program(config, int(chunk_steps), *settings, layout)
    state = _init_program(config, s, p_len, capacity, layout)()
    context = lambda: mesh_context(None if layout is None else layout.mesh)  # noqa: E731
    temp = jnp.float32(1.0 if greedy else temperature)
    tp = jnp.float32(top_p)

    free = list(range(s))
    owner: list[tuple[int, int] | None] = [None] * s
    pieces: dict[tuple[int, int], tuple[list, list]] = {}
    started: set[int] = set()

    def finish(slot: int) -> None:
        unit = owner[slot]
        toks, lps = pieces.pop(unit)
        result[unit[0]][unit[1]] = (np.concatenate(toks).astype(np.int32), np.concatenate(lps).astype(np.float32))
        owner[slot] = None
        free.append(slot)
        stats.rows += 1

    while units or any(o is not None for o in owner):
        while free and units:  # refill the free slots from the queue
            take = min(len(free), len(units))
            admitted = [units.popleft() for _ in range(take)]
            free.sort()
            dest = np.asarray(free[:take], np.int32)
            del free[:take]
            reqs = np.asarray([u[0] for u in admitted], np.int32)
            distinct, source = np.unique(reqs, return_inverse=True)
            u = next_pow2(len(distinct))
            r_pad = s  # one program per U (the scatter of S entries is cheap next to the prefill)
            for r in distinct.tolist():
                if r not in started:
                    started.add(r)
                    stats.queue_wait_chunks += stats.chunks
            with context():
                state, tok, lp, done = prefill_fn(
                    gen_params, state,
                    _pow2_pad(tokens_all[distinct], u, pad_id), _pow2_pad(mask_all[distinct], u, False),
                    _pow2_pad(source.astype(np.int32), r_pad, 0), _pow2_pad(dest, r_pad, s),
                    _pow2_pad(reqs, r_pad, 0), _pow2_pad(np.asarray([x[1] for x in admitted], np.int32), r_pad, 0),
                    _pow2_pad(limits_arr[reqs], r_pad, 1), rng, temp, tp,
                )
            stats.prefills += 1
            stats.prompts_prefilled += len(distinct)
            tok, lp, done = jax.device_get((tok, lp, done))
            for i, unit in enumerate(admitted):
                slot = int(dest[i])
                owner[slot] = unit
                pieces[unit] = ([tok[i:i + 1]], [lp[i:i + 1]])
                if done[i]:
                    finish(slot)
        if not any(o is not None for o in owner):
            continue
        with context():
            state, toks, lps, emitted = chunk_fn(gen_params, state, rng, temp, tp)
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
        busy = [slot for slot in range(s) if owner[slot] is not None]
        smaller = -(-next_pow2(max(len(busy), 1)) // row_devices) * row_devices  # still a multiple of them
        if shrink and not units and busy and len(busy) * 4 <= s and smaller < s:
            index = np.asarray(busy + [busy[0]] * (smaller - len(busy)), np.int32)
            keep = np.arange(smaller) < len(busy)
            with context():
                state = _shrink_program(smaller, layout, config.num_layers)(state, index, keep)
            owner = [owner[slot] for slot in busy] + [None] * (smaller - len(busy))
            s = smaller
            free = list(range(len(busy), smaller))
    return EngineResult(result, stats)


# ---------------------------------------------------------------------------------- for the memory planner
def cap_slots(slots: int, max_slots: int | None) -> int:
    """`slots`, at most `max_slots` rounded down to a power of two (None: no cap)."""
    return slots if max_slots is None else min(slots, 1 << (max(int(max_slots), 1).bit_length() - 1))


def planned_slots(config: ModelConfig, capacity: int, rows: int, kv_budget_bytes: int | None, mesh: Any = None,
                  max_slots: int | None = None) -> int:
    """S as `run` picks it for a run of `rows` completions of capacity `capacity` on `mesh`."""
    layout = make_layout(config, mesh)
    row_devices = 1 if layout is None else layout.row_devices
    budget = default_kv_budget() if kv_budget_bytes is None else int(kv_budget_bytes)
    slots_for_budget(config, capacity, budget, 1)
    s = cap_slots(slots_for_budget(config, capacity, budget * row_devices, rows), max_slots)
    return -(-s // row_devices) * row_devices


def planned_programs(
    config: ModelConfig,
    params: Any,
    *,
    slots: int,
    prompt_len: int,
    max_new_tokens: int,
    chunk_steps: int = DEFAULT_CHUNK_STEPS,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    select: bool = False,
    mesh: Any = None,
) -> list[tuple[str, Any, tuple]]:
    """[(name, jitted program, abstract arguments)] of the engine's prefill (its largest call:
    every slot filled from distinct prompts, U = next_pow2(slots)) and decode-chunk programs for
    `slots` slots of capacity prompt_len + max_new_tokens - 1, as `run` builds them on `mesh`.
    `params`: arrays or ShapeDtypeStructs (with their shardings), stacked [P, ...] with `select`
    (one policy's slice generated). Nothing is allocated; the parameter preparation (cast to the
    compute dtype) is compiled to learn its output shardings."""
    from jmarl.sharding import mesh_context

    greedy = float(temperature) == 0.0
    settings = (bool(greedy), int(top_k), float(top_p) < 1.0, tuple(int(t) for t in stop_tokens), int(pad_id))
    capacity = prompt_len + int(max_new_tokens) - 1
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
    state = jax.eval_shape(_init_program(config, slots, prompt_len, capacity, layout))
    if layout is not None:
        state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state,
                             layout.state_shardings(config.num_layers))
    key = jax.eval_shape(lambda: jax.random.key(0))
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    u = next_pow2(slots)
    prefill_args = (gen, state, i32(u, prompt_len), jax.ShapeDtypeStruct((u, prompt_len), bool),
                    i32(slots), i32(slots), i32(slots), i32(slots), i32(slots), key, f32, f32)
    decode_args = (gen, state, key, f32, f32)
    return [
        ("engine_prefill", _prefill_program(config, *settings, layout), prefill_args),
        ("engine_decode", _chunk_program(config, int(chunk_steps), *settings, layout), decode_args),
    ]
