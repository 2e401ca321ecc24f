"""The continuous-batching engine's host loop: a queue of completions fed into S slots.

`run(config, params, prompts, n, rng, spec)` decodes n[r] completions of each prompt with the
device programs of `jmarl.models.generation.engine_programs`, S slots and Q prompt-pool entries
as `jmarl.models.generation.budget` plans them.

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

A run whose completions all fit the slots at once (and whose prompts one prefill call holds)
runs as one program (`engine_programs.fused_program`) until its tail can shrink (or it ends);
other runs alternate refills (prefill / start programs) and decode chunks.

The engine does not record the experts its tokens run (routing replay needs the static sampler,
`check_no_routing_replay`), and decodes one policy per run (`policy` of params stacked over
policies).
"""

from __future__ import annotations

import collections
import heapq
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmarl.errors import JmarlError
from jmarl.models.config import ModelConfig
from jmarl.models.generation import engine_programs as programs
from jmarl.models.generation.budget import group_size, plan_slots, planned_prefill
from jmarl.models.generation.layout import Layout, make_layout, row_devices
from jmarl.models.generation.spec import EngineResult, EngineStats, GenerationSpec
from jmarl.models.generation.static import left_align
from jmarl.models.model import Params
from jmarl.padding import bucket_length, next_pow2
from jmarl.sharding import mesh_context


def _pad(a: np.ndarray, size: int, fill: Any) -> np.ndarray:
    out = np.full((size,) + a.shape[1:], fill, a.dtype)
    out[: len(a)] = a
    return out


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
        `programs.decode_slots` may read the prompts in groups) and the device's slots fit its entries that
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
    spec: GenerationSpec,
    *,
    limits: Sequence[int] | None = None,
    policy: int | None = None,
) -> EngineResult:
    """n[r] completions (an int: the same for every request) of each prompt (token ids) with
    continuous batching, decoded as `spec` says (`GenerationSpec`: sampling, slots and budget,
    mesh). `params` stacked [P, ...] with `policy` given: that policy's parameters.
    `limits[r]`: at most that many new tokens for request r (<= spec.max_new_tokens; default
    spec.max_new_tokens). Slots and pool entries: see `budget.plan_slots`; on a mesh `params`
    are used as placed (`jmarl.models.generation.layout`). The programs run: see the module
    docstring. `start(...).result()`: see `start` to overlap host work with the first program."""
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
    spec: GenerationSpec,
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
               rng: jax.Array, spec: GenerationSpec, limits: Sequence[int] | None, policy: int | None):
    """`run` as a generator: yields once, after the first device program is dispatched (or
    before any, for a run of no completions), and returns the EngineResult."""
    max_new_tokens, temperature, top_p = spec.max_new_tokens, spec.temperature, spec.top_p
    pad_id, chunk_steps, shrink, mesh = spec.pad_id, spec.chunk_steps, spec.shrink, spec.mesh
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
    devices = row_devices(layout)
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
        (`programs.prepare_program`), with the layout of their shardings."""
        if not general:
            prepare = programs.prepare_program(config, select)
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
                    fused_fn = programs.fused_program(config, s, q, p_len, big_n, drain_steps, *sampling, int(pad_id),
                                              make_layout(config, mesh, params, select=select), grouped, select)
                    state, *out = fused_fn(params, policy_arg, *prompt_args(fills), *slots_args, floor)
                    started, decoded = out[:3], out[3:]
                    stats.fused += 1
                    stats.grouped_chunks += bool(grouped)
                    stats.prefills += 1
                else:
                    if state is None:
                        state = programs.init_program(config, s, q, p_len, big_n, layout)()
                    if fills:  # new prompts: prefilled into their entries (at most max_prefill per call), then
                        # the slots started by the last call
                        gen_params, gen_layout = prepared()
                        prefill_fn = programs.prefill_program(config, *sampling, gen_layout)
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
                        state, *started = programs.start_program(config, *sampling, layout)(state, *slots_args)
                stats.prompts_prefilled += len(fills)
            if decoded is None and book.busy():
                gen_params, gen_layout = prepared()
                grouped = book.group_size(group)
                chunk_len = int(chunk_steps) if units else drain_steps
                chunk_fn = programs.chunk_program(config, chunk_len, *sampling, int(pad_id), gen_layout, grouped)
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
                state = programs.shrink_program(book.s, layout, config.num_layers)(state, *moved)
    if first:  # not reached (the first admission dispatches a program): `start` expects one yield
        yield
    return EngineResult(book.result, stats)


def planned_programs(
    config: ModelConfig,
    params: Any,
    spec: GenerationSpec,
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
    slots at once runs `programs.fused_program` instead, whose state, cast weights and temporaries take no
    more than the prefill with its arguments). `params`: arrays or ShapeDtypeStructs (with their
    shardings), stacked [P, ...] with `select` (one policy's slice generated). Nothing is
    allocated; the parameter preparation (cast to the compute dtype) is compiled to learn its
    output shardings."""
    check_no_routing_replay(config)
    mesh, max_new_tokens = spec.mesh, spec.max_new_tokens
    prepare = programs.prepare_program(config, select)
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
    state = jax.eval_shape(programs.init_program(config, slots, entries, prompt_len, int(max_new_tokens), layout))
    if layout is not None:
        state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state,
                             programs.state_shardings(layout, config.num_layers))
    key = jax.eval_shape(lambda: jax.random.key(0))
    f32 = jax.ShapeDtypeStruct((), jnp.float32)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    u = next_pow2(min(entries, slots, planned_prefill(config, prompt_len, spec)))
    prefill_args = (gen, state, i32(u, prompt_len), jax.ShapeDtypeStruct((u, prompt_len), bool), i32(u)) + (
        i32(slots),) * 5 + (key, f32, f32)
    decode_args = (gen, state, key, f32, f32, i32())
    sampling = spec.program_sampling()
    return [
        ("engine_prefill", programs.prefill_program(config, *sampling, layout), prefill_args),
        ("engine_decode", programs.chunk_program(config, max(int(spec.chunk_steps), int(max_new_tokens)), *sampling,
                                         int(spec.pad_id), layout, 0), decode_args),
    ]
