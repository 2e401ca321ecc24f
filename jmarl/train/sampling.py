"""The model-backed `Sampler`: prompts -> chat template -> tokens -> jitted KV-cache sampler.

Two engines (`jmarl.config.SamplingConfig.engine`, the run's `sampling` section):
- static: requests of all policies in one `PolicyGroup` (one architecture) go to the device in
  one call: a stacked group generates [P, B, S] prompts with `generate_stacked`, so a whole
  multi-agent turn is one program. Batch sizes are rounded up to a power of two and prompt
  lengths to a length bucket, so varied turns reuse a handful of compiled programs;
- continuous: `jmarl.models.generation.engine`: slots capped by the KV budget, a queue, refills
  between decode chunks; one engine run per asked policy of a group (each run decodes that
  policy's rows only, so no policy's rows are padding).

Both take the one `GenerationSpec` the run's `sampling` section gives (`generation_spec`).

`ModelSampler.take_stats()` returns (and resets) the rollout figures since its last call.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jmarl.config import SamplingConfig
from jmarl.models.generation import engine as engine_lib
from jmarl.models.generation import static
from jmarl.models.generation.spec import EngineResult, EngineStats, GenerationSpec
from jmarl.padding import DEFAULT_LENGTH_BUCKETS, bucket_length, row_bucket
from jmarl.train.policies import PolicyGroup, PolicySet
from jmarl.workflows.base import Completion
from jmarl.sharding import row_axes


class PromptTruncatedWarning(UserWarning):
    """Prompts longer than sampling.max_prompt_len were cut (their first tokens dropped)."""


def stop_tokens(sampling: SamplingConfig, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a completion: the tokenizer's EOS and the end-of-turn ids of its chat
    template (`stop_ids`), none under `sampling.ignore_eos`."""
    return () if sampling.ignore_eos else tuple(int(i) for i in getattr(tokenizer, "stop_ids", (tokenizer.eos_id,)))


def generation_spec(sampling: SamplingConfig, tokenizer: Any, mesh: Any = None,
                    buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS) -> GenerationSpec:
    """The generation settings of a run's `sampling` section, for whichever engine it names:
    its sampling options, `stop_tokens` and the tokenizer's pad id, on `mesh` with the sampler's
    prompt-length `buckets`; for the continuous engine also the KV budget (`kv_budget()`),
    `engine_chunk_steps` and `max_rows_per_call` (the most slots); slots, entries and prefill
    calls as the budget allows."""
    return GenerationSpec(
        max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, stop_tokens=stop_tokens(sampling, tokenizer), pad_id=tokenizer.pad_id,
        kv_budget_bytes=sampling.kv_budget(), max_slots=sampling.max_rows_per_call,
        chunk_steps=sampling.engine_chunk_steps, buckets=buckets, mesh=mesh,
    )


def _chat_text(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)


def encode_prompt(tokenizer, prompt: str, max_len: int) -> list[int]:
    """The chat-templated prompt's token ids, keeping the last `max_len` tokens."""
    return keep_last([tokenizer.encode(_chat_text(tokenizer, prompt))], max_len)[0]


def encode_prompts_full(tokenizer, prompts: Sequence[str]) -> list[Sequence[int]]:
    """Each prompt's chat-templated token ids, uncut (int32 arrays from the tokenizer's
    `encode_batch` when it has one, else lists)."""
    texts = [_chat_text(tokenizer, p) for p in prompts]
    batch = getattr(tokenizer, "encode_batch", None)
    return batch(texts) if batch is not None else [tokenizer.encode(t) for t in texts]


def keep_last(encoded: Sequence[Sequence[int]], max_len: int) -> list[Sequence[int]]:
    """Each id sequence cut to its last `max_len` ids (a prompt keeps its end: the question and
    the generation prompt; what comes first is lost first)."""
    return [ids if len(ids) <= max_len else ids[-max_len:] for ids in encoded]


def encode_prompts(tokenizer, prompts: Sequence[str], max_len: int) -> list[Sequence[int]]:
    """`encode_prompt` of each prompt: `encode_prompts_full` cut by `keep_last`."""
    return keep_last(encode_prompts_full(tokenizer, prompts), max_len)


def left_pad(rows: Sequence[Sequence[int]], batch: int, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """int32[batch, length] tokens and bool mask, each row right-aligned (left padding)."""
    tokens = np.full((batch, length), pad_id, np.int32)
    lengths = np.zeros(batch, np.int64)
    lengths[: len(rows)] = [len(r) for r in rows]
    mask = np.arange(length)[None, :] >= (length - lengths)[:, None]
    if lengths.any():
        tokens[mask] = np.concatenate([np.asarray(r, np.int32).reshape(-1) for r in rows])
    return tokens, mask


class _Call:
    """One sampler call in the pipeline: `dispatch()` starts its device part (asynchronously
    for the static sampler), `generation` is what the device returns, `finish()` the completions."""

    def __init__(self, launch: Callable[[], Any], complete: Callable[[Any], list[list[Completion]]]) -> None:
        self._launch, self._complete = launch, complete
        self.generation: Any = None

    def dispatch(self) -> None:
        self.generation = self._launch()

    def wait(self) -> None:
        """Blocks until the device part is done (its KV cache then freed)."""
        jax.block_until_ready(jax.tree.leaves(self.generation))

    def finish(self) -> list[list[Completion]]:
        return self._complete(self.generation)


class _EngineRuns:
    """The engine runs of one sampler call, one per asked policy, in sequence: the first begun at
    dispatch, each next one once the one before has finished (one engine state alive at a time,
    the memory the planner checks), and a finished run's completions built (`collect(k, result)`)
    while the next one decodes. `jax.block_until_ready` on it finishes every run and collects all
    but the last, whose completions `finish` builds while the sampler's next call decodes."""

    def __init__(self, first: engine_lib.EngineRun, rest: Sequence[Callable[[], engine_lib.EngineRun]],
                 collect: Callable[[int, EngineResult], None]) -> None:
        self._pending: engine_lib.EngineRun | None = first
        self._rest, self._collect = list(rest), collect
        self._results: list[EngineResult] = []

    def block_until_ready(self) -> "_EngineRuns":
        while self._pending is not None:
            result = self._pending.result()
            self._pending = self._rest.pop(0)() if self._rest else None
            self._results.append(result)
            if self._pending is not None:
                self._collect(len(self._results) - 1, result)
        return self

    def finish(self) -> None:
        """Finishes the runs and collects the last one."""
        self.block_until_ready()
        self._collect(len(self._results) - 1, self._results[-1])


class ModelSampler:
    """Implements `jmarl.workflows.Sampler` over a `PolicySet` with the jitted sampler."""

    def __init__(self, policies: PolicySet, settings: SamplingConfig, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
                 mesh: Any = None):
        """mesh: the run's `jax.sharding.Mesh`: generation rows and KV cache sharded over it
        (None: one device)."""
        self.policies = policies
        self.settings = settings
        self.buckets = tuple(buckets)
        self.new_tokens = 0
        self.mesh = mesh
        self.engine_stats = EngineStats()  # the continuous engine's counters, all calls
        self._warned_cut = False
        self._reset_stats()

    def _reset_stats(self) -> None:
        self._stats = {"rows": 0, "decoded_rows": 0, "slot_steps": 0, "busy_slot_steps": 0, "requests": 0,
                       "queue_wait": 0, "entry_waits": 0, "seconds": 0.0, "tokens": 0, "decoded_positions": 0,
                       "prompts": 0, "prompts_cut": 0, "prompt_tokens": 0, "prompt_tokens_max": 0}

    def take_stats(self) -> dict[str, float]:
        """The rollout figures since the last call (then reset): rollout/row_utilization (real
        completion rows / decoded rows), rollout/decode_utilization (new tokens of the real
        completions / token positions decoded: static, each call's rows, padding included, x the
        steps its decode loop ran, i.e. its longest row, as every row keeps its slot until the
        last one stops; continuous, the engine's slot-steps plus one per completion for the first
        token it samples when its slot starts, as `benchmarks.engine` counts them; not 1 by
        construction on the engine, unlike row_utilization), rollout/slot_utilization (busy slot-steps / slot-steps,
        continuous engine only), rollout/queue_wait (mean decode chunks a request waited before
        its first completion started, continuous engine only), rollout/entry_waits (refills that
        left slots free because no prompt-pool entry was: a larger budget or fewer slots would
        help; continuous engine only), rollout/prompt_length_mean and rollout/prompt_length_max
        (chat-templated prompt tokens before any cut), rollout/prompt_truncated_fraction (the share
        of prompts longer than sampling.max_prompt_len, which lost their first tokens),
        time/generate (seconds in sample)."""
        st = self._stats
        out = {"time/generate": float(st["seconds"])}
        if st["prompts"]:
            out["rollout/prompt_length_mean"] = st["prompt_tokens"] / st["prompts"]
            out["rollout/prompt_length_max"] = float(st["prompt_tokens_max"])
            out["rollout/prompt_truncated_fraction"] = st["prompts_cut"] / st["prompts"]
        if st["decoded_rows"]:
            out["rollout/row_utilization"] = st["rows"] / st["decoded_rows"]
        if st["decoded_positions"]:
            out["rollout/decode_utilization"] = st["tokens"] / st["decoded_positions"]
        if st["slot_steps"]:
            out["rollout/slot_utilization"] = st["busy_slot_steps"] / st["slot_steps"]
        if st["requests"]:
            out["rollout/queue_wait"] = st["queue_wait"] / st["requests"]
            out["rollout/entry_waits"] = float(st["entry_waits"])
        self._reset_stats()
        return out

    def sample(self, requests: Sequence[tuple[int, str]], n: int, rng: jax.Array) -> list[list[Completion]]:
        """For each (policy id, prompt) request, n completions."""
        start = time.perf_counter()
        try:
            return self._sample(requests, n, rng)
        finally:
            self._stats["seconds"] += time.perf_counter() - start

    def _sample(self, requests: Sequence[tuple[int, str]], n: int, rng: jax.Array) -> list[list[Completion]]:
        """One device call per policy group (and per `max_rows_per_call` chunk of it), pipelined:
        call k+1's prompts are tokenised and padded while call k decodes, and call k's completions
        are decoded to text while call k+1 decodes. Call k+1 is dispatched only once call k has
        finished, so at most one call's KV cache is alive (the memory the planner checks)."""
        out: list[list[Completion]] = [[] for _ in requests]
        calls = []
        for gi, group in enumerate(self.policies.groups):
            idx = [i for i, (p, _) in enumerate(requests) if p in group.policy_ids]
            if idx:
                key = jax.random.fold_in(rng, gi)
                # the continuous engine keeps one queue and caps the rows in flight instead
                cap = None if self.settings.engine == "continuous" else self.settings.max_rows_per_call
                chunks = split_calls(len(idx), n, cap)
                for c, (start, stop) in enumerate(chunks):
                    chunk_key = key if len(chunks) == 1 else jax.random.fold_in(key, c)
                    calls.append((idx[start:stop], group, chunk_key))
        previous = None
        for part, group, key in calls:
            call = self._prepare_call(group, [requests[i] for i in part], n, key)
            if previous is not None:
                previous[1].wait()
            call.dispatch()
            if previous is not None:
                self._store(out, *previous)
            previous = (part, call)
        if previous is not None:
            self._store(out, *previous)
        return out

    def _store(self, out: list[list[Completion]], part: Sequence[int], call: "_Call") -> None:
        """The finished call's completions into `out` at the request indices `part`."""
        for i, comps in zip(part, call.finish()):
            out[i] = comps

    def _row_devices(self, stacked: bool) -> int:
        """The devices a static call's rows are split over on the run's mesh (1 without one): the
        rows are bucketed to a multiple of them."""
        sizes = {} if self.mesh is None else dict(self.mesh.shape)
        return int(np.prod([sizes[a] for a in row_axes(self.mesh, stacked=stacked)]))

    def _encode(self, tokenizer: Any, texts: Sequence[str]) -> list[Sequence[int]]:
        """The prompts' ids cut to sampling.max_prompt_len (`encode_prompts`), counting their
        lengths and cuts into the rollout figures; the first cut of the run warns once."""
        full = encode_prompts_full(tokenizer, texts)
        limit = self.settings.max_prompt_len
        lengths = [len(ids) for ids in full]
        cut = sum(n > limit for n in lengths)
        st = self._stats
        st["prompts"] += len(lengths)
        st["prompts_cut"] += cut
        st["prompt_tokens"] += sum(lengths)
        st["prompt_tokens_max"] = max(st["prompt_tokens_max"], max(lengths, default=0))
        if cut and not self._warned_cut:
            self._warned_cut = True
            warnings.warn(
                f"{cut} of {len(lengths)} prompts are longer than sampling.max_prompt_len={limit} tokens "
                f"(the longest {max(lengths)}) and lose their first tokens; raise sampling.max_prompt_len "
                "(rollout/prompt_truncated_fraction logs the share each step)", PromptTruncatedWarning, stacklevel=3)
        return keep_last(full, limit)

    def _prepare_call(self, group: PolicyGroup, requests: Sequence[tuple[int, str]], n: int, rng: jax.Array) -> "_Call":
        """Host work of one call (tokenise, pad, lay out rows); `dispatch` then starts the device part."""
        tok = group.tokenizer
        s = self.settings
        prompts = self._encode(tok, [text for _, text in requests])
        if s.engine == "continuous":
            return self._engine_call(group, requests, prompts, n, rng)
        length = bucket_length(max(len(p) for p in prompts), self.buckets)
        spec = generation_spec(s, tok, self.mesh, self.buckets)
        params = group.full_params
        # rows[k] = (request index, prompt ids); each request repeated n times
        if group.stacked:
            per_policy: list[list[int]] = [[] for _ in group.policy_ids]
            for r, (p, _) in enumerate(requests):
                per_policy[group.index(p)].extend([r] * n)
            active = [pi for pi, rows in enumerate(per_policy) if rows]
            batch = row_bucket(max(len(rows) for rows in per_policy), self._row_devices(len(active) > 1))
            if len(active) == 1:  # one policy asked (a tree node's agent): decode its rows only
                only = active[0]
                toks, masks = left_pad([prompts[r] for r in per_policy[only]], batch, length, tok.pad_id)
                launch = lambda: static.generate(  # noqa: E731
                    group.model_config, params(), toks, masks, rng, spec, policy=only)
                located = [(r, None, j) for j, r in enumerate(per_policy[only])]
                decoded = batch
            else:
                toks, masks = zip(*(left_pad([prompts[r] for r in rows], batch, length, tok.pad_id) for rows in per_policy))
                launch = lambda: static.generate_stacked(  # noqa: E731
                    group.model_config, params(), np.stack(toks), np.stack(masks), rng, spec)
                located = [(r, pi, j) for pi, rows in enumerate(per_policy) for j, r in enumerate(rows)]
                decoded = batch * len(per_policy)
        else:
            rows = [r for r in range(len(requests)) for _ in range(n)]
            batch = row_bucket(len(rows), self._row_devices(False))
            toks, masks = left_pad([prompts[r] for r in rows], batch, length, tok.pad_id)
            launch = lambda: static.generate(group.model_config, params(), toks, masks, rng, spec)  # noqa: E731
            located = [(r, None, j) for j, r in enumerate(rows)]
            decoded = batch
        self._stats["decoded_rows"] += decoded
        self._stats["rows"] += len(located)
        return _Call(launch, lambda gen: self._completions(tok, len(requests), prompts, located, jax.device_get(gen)))

    def _completions(self, tok: Any, num_requests: int, prompts: Sequence[Sequence[int]],
                     located: Sequence[tuple[int, int | None, int]], gen: Any) -> list[list[Completion]]:
        """Completions of a finished static call: `located[k]` = (request, policy row or None, row)
        of generated row k; gen's fields [(P,) B, max_new_tokens] on the host."""
        out: list[list[Completion]] = [[] for _ in range(num_requests)]
        prompt_arrays = [np.asarray(p, np.int32) for p in prompts]  # one array per request, shared by its n completions
        lengths = np.asarray(gen.lengths)  # [(P,) B]: every decoded row, padding rows included
        # the decode loop runs until every row of the call (of every policy) has stopped: its longest row
        self._stats["decoded_positions"] += int(lengths.size) * int(lengths.max(initial=0))
        for r, pi, j in located:
            at = j if pi is None else (pi, j)
            length_j = int(gen.lengths[at])
            comp = np.asarray(gen.tokens[at][:length_j], np.int32)
            self.new_tokens += length_j
            self._stats["tokens"] += length_j
            out[r].append(
                Completion(
                    text=tok.decode(comp.tolist()),
                    prompt_tokens=prompt_arrays[r],
                    completion_tokens=comp,
                    logprobs=np.asarray(gen.logprobs[at][:length_j], np.float32),
                    routing=completion_routing(gen, pi, j, len(prompt_arrays[r]), length_j),
                )
            )
        return out

    def _engine_call(self, group: PolicyGroup, requests: Sequence[tuple[int, str]], prompts: list[Sequence[int]],
                     n: int, rng: jax.Array) -> "_Call":
        """The continuous engine: one run per asked policy of the group (stacked groups: with
        that policy's parameters and the key fold_in(rng, its index)), decoding only real rows.
        Dispatch starts the first run (`engine.start`: a run that fits its slots is then all on
        the device); a finished run's completions are built while the next run, or the
        sampler's next call, decodes (`_EngineRuns`)."""
        tok = group.tokenizer
        spec = generation_spec(self.settings, tok, self.mesh, self.buckets)
        if group.stacked:
            by_policy: dict[int, list[int]] = {}
            for r, (p, _) in enumerate(requests):
                by_policy.setdefault(group.index(p), []).append(r)
            runs = [(pi, jax.random.fold_in(rng, pi), idx) for pi, idx in sorted(by_policy.items())]
        else:
            runs = [(None, rng, list(range(len(requests))))]

        def begin(policy: int | None, key: jax.Array, idx: list[int]) -> engine_lib.EngineRun:
            return engine_lib.start(group.model_config, group.full_params(), [prompts[r] for r in idx], n, key, spec,
                                    policy=policy)

        out: list[list[Completion]] = [[] for _ in requests]

        def collect(k: int, result: EngineResult) -> None:
            self._engine_completions(tok, prompts, runs[k][2], result, out)

        def complete(gen: _EngineRuns) -> list[list[Completion]]:
            gen.finish()
            return out

        launch = lambda: _EngineRuns(begin(*runs[0]), [functools.partial(begin, *run) for run in runs[1:]],  # noqa: E731
                                     collect)
        return _Call(launch, complete)

    def _engine_completions(self, tok: Any, prompts: list[Sequence[int]], idx: Sequence[int],
                            result: EngineResult, out: list[list[Completion]]) -> None:
        """A finished engine run's completions into `out` at its requests `idx` (the run's
        request i is the call's request idx[i]), and its counters into the rollout figures."""
        st = result.stats
        self.engine_stats.add(st)
        self._stats["rows"] += st.rows
        self._stats["decoded_rows"] += st.rows  # a slot only ever decodes a real completion
        self._stats["slot_steps"] += st.slot_steps
        self._stats["busy_slot_steps"] += st.busy_slot_steps
        self._stats["requests"] += st.requests
        self._stats["queue_wait"] += st.queue_wait_chunks
        self._stats["entry_waits"] += st.entry_waits
        self._stats["decoded_positions"] += st.slot_steps + st.rows  # + each completion's first token
        for r, comps in zip(idx, result.completions):
            prompt_array = np.asarray(prompts[r], np.int32)  # shared by the request's completions
            for comp, logprobs in comps:
                self.new_tokens += len(comp)
                self._stats["tokens"] += len(comp)
                out[r].append(Completion(
                    text=tok.decode(comp.tolist()), prompt_tokens=prompt_array,
                    completion_tokens=comp, logprobs=logprobs,
                ))

    # ---- the program of one call, for the memory planner

    def generation_program(
        self, group: PolicyGroup, rows: Sequence[int], share: int, params: Any = None
    ) -> tuple[Callable, tuple]:
        """(jitted program, abstract arguments) of one `sample` call that gives `rows[i]` rows to
        the i-th policy of `group`, as requests asking n = `share` completions of distinct
        prompts of settings.max_prompt_len tokens (blocks of `share` consecutive rows share a
        prompt): [(P,) B, S] prompts with B = `row_bucket`(max(rows)), S the prompt's length
        bucket, laid out by the static sampler's own host prep (`static.program_and_args`).
        `params`: what to lower with (default: the shapes of the group's `full_params`). Nothing
        is allocated on a device.
        """
        s = self.settings
        tok = group.tokenizer
        prompt_len = max(1, s.max_prompt_len)
        if s.max_rows_per_call is not None:  # `sample` splits larger requests into calls of at most this
            cap = max(s.max_rows_per_call // max(share, 1), 1) * max(share, 1)
            rows = [min(r, cap) for r in rows]
        active = [i for i, n in enumerate(rows) if n]
        only = active[0] if group.stacked and len(active) == 1 else None  # `_prepare_call`'s one-policy call
        stacked = group.stacked and only is None
        batch = row_bucket(max(max(rows), 1), self._row_devices(stacked))
        length = bucket_length(prompt_len, self.buckets)
        blocks = [
            synthetic_prompts(n, share, prompt_len, batch, length, tok.pad_id, group.model_config.vocab_size, offset=i)
            for i, n in enumerate(rows)
        ]
        if only is not None:
            blocks = [blocks[only]]
        tokens = np.stack([b[0] for b in blocks]) if stacked else blocks[0][0]
        mask = np.stack([b[1] for b in blocks]) if stacked else blocks[0][1]
        if params is None:
            params = full_params_shapes(group)
        spec = generation_spec(s, tok, self.mesh, self.buckets)
        return static.program_and_args(group.model_config, params, tokens, mask, spec, stacked=stacked,
                                       select=only is not None)


def completion_routing(gen: Any, policy: int | None, row: int, prompt_len: int, length: int) -> np.ndarray | None:
    """The recorded experts [prompt_len + length, S, k] of row `row` (of policy row `policy` of
    a stacked call; None: unstacked) of a finished call's host `Generation`: its prompt's last
    `prompt_len` slots (prompts are left-aligned, real tokens last), then its `length`
    generated tokens. None when the call recorded none (no routing replay)."""
    if gen.routing is None:
        return None
    lead = () if policy is None else (policy,)
    prompt = gen.prompt_routing[lead + (int(gen.prompt_row[lead + (row,)]),)]
    slots = prompt.shape[0]
    return np.concatenate([prompt[slots - prompt_len:], gen.routing[lead + (row,)][:length]])


def split_calls(requests: int, n: int, max_rows: int | None) -> list[tuple[int, int]]:
    """[start, stop) ranges of `requests` requests of n rows each, in consecutive calls of at
    most `max_rows` rows (at least one request per call; one call when max_rows is None)."""
    per_call = requests if max_rows is None else max(max_rows // max(n, 1), 1)
    return [(start, min(start + per_call, requests)) for start in range(0, requests, per_call)]


def full_params_shapes(group: PolicyGroup) -> Any:
    """What the sampler runs `group` with (`PolicyGroup.full_params`), made of the group's own
    leaves (arrays or `jax.ShapeDtypeStruct`s, their shardings kept): the state's parameters,
    or for LoRA the base with the adapters attached unmerged (nothing computed; the base's
    leaves are the group's base, so a planner counts them once)."""
    return group.full_params()


def synthetic_prompts(
    rows: int, share: int, prompt_len: int, batch: int, length: int, pad_id: int, vocab: int, offset: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """int32[batch, length] tokens and bool mask (left padding) of `rows` rows in blocks of
    `share` identical prompts of `prompt_len` tokens, every block's prompt distinct (also
    across `offset`s, i.e. policies): the prompts of a sampler call at its largest."""
    ids = np.arange(rows, dtype=np.int64) // max(share, 1) + offset * (rows + 1)
    base = max(vocab - 1, 2)
    prompts = np.empty((rows, prompt_len), np.int32)
    for j in range(prompt_len - 1, -1, -1):  # the block id in base (vocab - 1), digits 1 .. vocab - 1
        prompts[:, j] = 1 + ids % base
        ids = ids // base
    tokens = np.full((batch, length), pad_id, np.int32)
    mask = np.zeros((batch, length), bool)
    tokens[:rows, length - prompt_len:] = prompts
    mask[:rows, length - prompt_len:] = True
    return tokens, mask
