"""The model-backed `Sampler`: prompts -> chat template -> tokens -> jitted KV-cache sampler.

Requests of all policies in one `PolicyGroup` (one architecture) go to the device in one call:
a stacked group generates [P, B, S] prompts with `generate_stacked`, so a whole multi-agent
turn is one program. Batch sizes are rounded up to a power of two and prompt lengths to a
length bucket, so varied turns reuse a handful of compiled programs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np

from jmarl import models
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

    def sample(self, requests: Sequence[tuple[int, str]], n: int, rng: jax.Array) -> list[list[Completion]]:
        """For each (policy id, prompt) request, n completions."""
        out: list[list[Completion]] = [[] for _ in requests]
        for gi, group in enumerate(self.policies.groups):
            idx = [i for i, (p, _) in enumerate(requests) if p in group.policy_ids]
            if idx:
                key = jax.random.fold_in(rng, gi)
                for i, comps in zip(idx, self._sample_group(group, [requests[i] for i in idx], n, key)):
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
            toks, masks = zip(*(left_pad([prompts[r] for r in rows], batch, length, tok.pad_id) for rows in per_policy))
            gen = models.generate_stacked(
                group.model_config, group.full_params(), np.stack(toks), np.stack(masks), rng, **kwargs
            )
            gen = jax.device_get(gen)
            located = [(r, pi, j) for pi, rows in enumerate(per_policy) for j, r in enumerate(rows)]
            pick = lambda a, pi, j: a[pi, j]  # noqa: E731
        else:
            rows = [r for r in range(len(requests)) for _ in range(n)]
            batch = next_pow2(len(rows))
            toks, masks = left_pad([prompts[r] for r in rows], batch, length, tok.pad_id)
            gen = jax.device_get(models.generate(group.model_config, group.full_params(), toks, masks, rng, **kwargs))
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
