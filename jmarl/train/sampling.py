"""The model-backed `Sampler`: prompts -> chat template -> tokens -> jitted KV-cache sampler.

Requests of all policies in one `PolicyGroup` (one architecture) go to the device in one call:
a stacked group generates [P, B, S] prompts with `generate_stacked`, so a whole multi-agent
turn is one program. Batch sizes are rounded up to a power of two and prompt lengths to a
length bucket, so varied turns reuse a handful of compiled programs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmarl import models
from jmarl.models import model as model_lib
from jmarl.models import sampler as sampler_lib
from jmarl.rollouts import DEFAULT_LENGTH_BUCKETS, bucket_length, next_pow2
from jmarl.train.policies import PolicyGroup, PolicySet
from jmarl.workflows.base import Completion


@dataclass(frozen=True)
class SamplingSettings:
    """Generation settings; temperature 0 is greedy."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_len: int = 512
    max_rows_per_call: int | None = None  # None: one device call per policy group


def encode_prompt(tokenizer, prompt: str, max_len: int) -> list[int]:
    """The chat-templated prompt's token ids, keeping the last `max_len` tokens."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = tokenizer.encode(text)
    return ids[-max_len:]


def left_pad(rows: Sequence[Sequence[int]], batch: int, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """int32[batch, length] tokens and bool mask, each row right-aligned (left padding)."""
    tokens = np.full((batch, length), pad_id, np.int32)
    mask = np.zeros((batch, length), bool)
    for i, r in enumerate(rows):
        if r:
            tokens[i, length - len(r):] = r
            mask[i, length - len(r):] = True
    return tokens, mask


class ModelSampler:
    """Implements `jmarl.workflows.Sampler` over a `PolicySet` with the jitted sampler."""

    def __init__(self, policies: PolicySet, settings: SamplingSettings, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS):
        self.policies = policies
        self.settings = settings
        self.buckets = tuple(buckets)
        self.new_tokens = 0
        self.mesh = None  # the run's mesh (set by the trainer): generation rows sharded over it

    def sample(self, requests: Sequence[tuple[int, str]], n: int, rng: jax.Array) -> list[list[Completion]]:
        """For each (policy id, prompt) request, n completions."""
        out: list[list[Completion]] = [[] for _ in requests]
        for gi, group in enumerate(self.policies.groups):
            idx = [i for i, (p, _) in enumerate(requests) if p in group.policy_ids]
            if idx:
                key = jax.random.fold_in(rng, gi)
                chunks = split_calls(len(idx), n, self.settings.max_rows_per_call)
                for c, (start, stop) in enumerate(chunks):
                    chunk_key = key if len(chunks) == 1 else jax.random.fold_in(key, c)
                    part = idx[start:stop]
                    for i, comps in zip(part, self._sample_group(group, [requests[i] for i in part], n, chunk_key)):
                        out[i] = comps
        return out

    def _sample_group(self, group: PolicyGroup, requests: Sequence[tuple[int, str]], n: int, rng: jax.Array) -> list[list[Completion]]:
        tok = group.tokenizer
        s = self.settings
        prompts = [encode_prompt(tok, text, s.max_prompt_len) for _, text in requests]
        length = bucket_length(max(len(p) for p in prompts), self.buckets)
        kwargs = dict(
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop_tokens=(tok.eos_id,),
            pad_id=tok.pad_id,
        )
        # rows[k] = (request index, prompt ids); each request repeated n times
        if group.stacked:
            per_policy: list[list[int]] = [[] for _ in group.policy_ids]
            for r, (p, _) in enumerate(requests):
                per_policy[group.index(p)].extend([r] * n)
            batch = next_pow2(max(len(rows) for rows in per_policy))
            active = [pi for pi, rows in enumerate(per_policy) if rows]
            if len(active) == 1:  # one policy asked (a tree node's agent): decode its rows only
                only = active[0]
                toks, masks = left_pad([prompts[r] for r in per_policy[only]], batch, length, tok.pad_id)
                gen = jax.device_get(models.generate(
                    group.model_config, group.full_params(), toks, masks, rng, mesh=self.mesh, policy=only, **kwargs))
                located = [(r, None, j) for j, r in enumerate(per_policy[only])]
                pick = lambda a, pi, j: a[j]  # noqa: E731
            else:
                toks, masks = zip(*(left_pad([prompts[r] for r in rows], batch, length, tok.pad_id) for rows in per_policy))
                gen = models.generate_stacked(
                    group.model_config, group.full_params(), np.stack(toks), np.stack(masks), rng, mesh=self.mesh, **kwargs
                )
                gen = jax.device_get(gen)
                located = [(r, pi, j) for pi, rows in enumerate(per_policy) for j, r in enumerate(rows)]
                pick = lambda a, pi, j: a[pi, j]  # noqa: E731
        else:
            rows = [r for r in range(len(requests)) for _ in range(n)]
            batch = next_pow2(len(rows))
            toks, masks = left_pad([prompts[r] for r in rows], batch, length, tok.pad_id)
            gen = jax.device_get(
                models.generate(group.model_config, group.full_params(), toks, masks, rng, mesh=self.mesh, **kwargs))
            located = [(r, None, j) for j, r in enumerate(rows)]
            pick = lambda a, pi, j: a[j]  # noqa: E731

        out: list[list[Completion]] = [[] for _ in requests]
        for r, pi, j in located:
            length_j = int(pick(gen.lengths, pi, j))
            comp = np.asarray(pick(gen.tokens, pi, j)[:length_j], np.int32)
            self.new_tokens += length_j
            out[r].append(
                Completion(
                    text=tok.decode(comp.tolist()),
                    prompt_tokens=np.asarray(prompts[r], np.int32),
                    completion_tokens=comp,
                    logprobs=np.asarray(pick(gen.logprobs, pi, j)[:length_j], np.float32),
                )
            )
        return out

    # ---- the program of one call, for the memory planner

    def generation_program(
        self, group: PolicyGroup, rows: Sequence[int], share: int, params: Any = None
    ) -> tuple[Callable, tuple]:
        """(jitted program, abstract arguments) of one `sample` call that gives `rows[i]` rows to
        the i-th policy of `group`, as requests asking n = `share` completions of distinct
        prompts of settings.max_prompt_len tokens (blocks of `share` consecutive rows share a
        prompt). The layout is decided by the sampler's own host code (`left_align`,
        `contiguous_group_size`, `unique_prompts`) on such prompts, then the KV-cache capacity
        and program settings follow `jmarl.models.sampler._run`: [(P,) B, S] prompts with
        B = next_pow2(max(rows)), S the prompt's length bucket. `params`: what to lower with
        (default: the shapes of the group's `full_params`). Nothing is allocated on a device.
        """
        s = self.settings
        tok = group.tokenizer
        prompt_len = max(1, s.max_prompt_len)
        if s.max_rows_per_call is not None:  # `sample` splits larger requests into calls of at most this
            cap = max(s.max_rows_per_call // max(share, 1), 1) * max(share, 1)
            rows = [min(r, cap) for r in rows]
        batch = next_pow2(max(max(rows), 1))
        active = [i for i, n in enumerate(rows) if n]
        only = active[0] if group.stacked and len(active) == 1 else None  # `_sample_group`'s one-policy call
        stacked = group.stacked and only is None
        length = bucket_length(prompt_len, self.buckets)
        blocks = [
            synthetic_prompts(n, share, prompt_len, batch, length, tok.pad_id, group.model_config.vocab_size, offset=i)
            for i, n in enumerate(rows)
        ]
        if only is not None:
            blocks = [blocks[only]]
        tokens = np.stack([b[0] for b in blocks]) if stacked else blocks[0][0]
        mask = np.stack([b[1] for b in blocks]) if stacked else blocks[0][1]
        length = bucket_length(max(int(mask.sum(axis=-1).max(initial=0)), 1), DEFAULT_LENGTH_BUCKETS)
        tokens, mask = sampler_lib.left_align(tokens, mask, length, tok.pad_id)
        batch_shape = tokens.shape[:-1]
        size = sampler_lib.contiguous_group_size(tokens, mask)
        if size > 1:
            tokens, mask, prompt_rows = tokens[..., ::size, :], mask[..., ::size, :], None
            capacity = max(int(s.max_new_tokens) - 1, 1)
        else:
            tokens, mask, prompt_rows = sampler_lib.unique_prompts(tokens, mask)
            capacity = length + int(s.max_new_tokens) - 1
        greedy = float(s.temperature) == 0.0
        program = sampler_lib._program(
            group.model_config, stacked, int(s.max_new_tokens), greedy, int(s.top_k), float(s.top_p) < 1.0,
            (int(tok.eos_id),), int(tok.pad_id), size,
            sampler_lib.first_phase_slots(capacity - (0 if size > 1 else length)), only is not None,
        )
        if params is None:
            params = full_params_shapes(group)
        cache = jax.eval_shape(lambda: model_lib.empty_cache(group.model_config, batch_shape, capacity))
        prompt_sh: tuple = (None, None, None)
        if self.mesh is not None and self.mesh.size > 1:  # as `jmarl.models.sampler._run` places them
            cache_sh, prompt_sh = sampler_lib.generation_shardings(
                group.model_config, self.mesh, stacked, batch_shape, capacity, (tokens, mask, prompt_rows))
            cache = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), cache, cache_sh)

        def shape(x, sh=None):
            return None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

        args = (
            params, cache, shape(tokens, prompt_sh[0]), shape(mask, prompt_sh[1]), shape(prompt_rows, prompt_sh[2]),
            jax.eval_shape(lambda: jax.random.key(0)), jax.ShapeDtypeStruct((), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.float32),
        ) + (() if only is None else (jax.ShapeDtypeStruct((), jnp.int32),))
        return program, args


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
