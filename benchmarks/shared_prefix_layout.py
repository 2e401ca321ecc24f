"""The learner's previous batch layout, kept as the packing benchmark's baseline
(`benchmarks.packing`): each distinct prompt once, continuations that point at it, padded.

A GRPO group's G samples share their prompt, so the learner runs each distinct prompt through
the model once per micro-batch and each sample's completion against it
(`benchmarks.shared_prefix_model.prefix_token_logprobs`): the same log-probs and gradients as the plain [N, T]
forward, with the prompt's share of the work divided by G.

Host side (NumPy). A sample's prompt is its real tokens before its first loss token (all of
them when it has none); its continuation is the rest of its real tokens. Output fields:

    prefix_tokens, prefix_mask  [parts * U, P]  distinct prompts, left-padded; micro-batch m
                                                (rows [m * N/parts, (m+1) * N/parts)) owns
                                                prefixes [m * U, (m+1) * U)
    prefix_rows                 int32[N]        the prefix of each sample (an index into the
                                                whole array; modulo U inside its micro-batch)
    tokens, attention_mask      [N, C]          continuations, right-padded
    any other [N, T] field      [N, C]          (loss_mask, behavior_logprobs) cut the same way

U (distinct prompts per micro-batch, padded with empty prompts), P and C are rounded up (a power
of two; length buckets) so that steps reuse a few compiled programs. [N] fields pass through.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np

from benchmarks.shared_prefix_model import prefix_token_logprobs
from jmarl.errors import JmarlError
from jmarl.models.config import ModelConfig
from jmarl.models.model import Params
from jmarl.padding import DEFAULT_LENGTH_BUCKETS, bucket_length, next_pow2
from jmarl.train.packing import split_prompts


def to_shared_prefix(
    batches: Sequence[dict[str, np.ndarray]], parts: int = 1, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS
) -> list[dict[str, np.ndarray]]:
    """Plain batches (tokens/attention_mask/loss_mask [N, T], N a multiple of `parts`) -> the
    shared-prefix layout of the module docstring, with U, P and C common to all of them (so the
    results stack, e.g. one per policy of a stacked group)."""
    splits, distinct = [], []
    for b in batches:
        n = b["tokens"].shape[0]
        if n % parts:
            raise JmarlError(f"batch of {n} samples does not split into {parts} micro-batches")
        s = split_prompts(b["tokens"], b["attention_mask"], b["loss_mask"])
        per_part = n // parts
        keys = []  # per micro-batch: prompt bytes -> local prefix index
        for m in range(parts):
            seen: dict[bytes, int] = {}
            for prompt, _ in s[m * per_part:(m + 1) * per_part]:
                seen.setdefault(prompt.tobytes(), len(seen))
            keys.append(seen)
        splits.append(s)
        distinct.append(keys)
    u = next_pow2(max(len(seen) for keys in distinct for seen in keys))
    longest_prompt = max((p.size for s in splits for p, _ in s), default=0)
    longest_rest = max((c.size for s in splits for _, c in s), default=0)
    p_len = bucket_length(max(longest_prompt, 1), buckets)
    c_len = bucket_length(max(longest_rest, 1), buckets)

    out = []
    for b, s, keys in zip(batches, splits, distinct):
        n, t = b["tokens"].shape
        per_part = n // parts
        prefix_tokens = np.zeros((parts * u, p_len), np.int32)
        prefix_mask = np.zeros((parts * u, p_len), bool)
        rows = np.zeros((n,), np.int32)
        gather = np.zeros((n, c_len), np.int64)  # column of the [N, T] row each slot reads
        valid = np.zeros((n, c_len), bool)
        for i, (prompt, rest) in enumerate(s):
            m = i // per_part
            local = keys[m][prompt.tobytes()]
            rows[i] = m * u + local
            if prompt.size:
                prefix_tokens[rows[i], p_len - prompt.size:] = prompt
                prefix_mask[rows[i], p_len - prompt.size:] = True
            gather[i, :rest.size] = rest
            valid[i, :rest.size] = True
        converted = {"prefix_tokens": prefix_tokens, "prefix_mask": prefix_mask, "prefix_rows": rows}
        for k, x in b.items():
            x = np.asarray(x)
            if x.shape == (n, t):
                cut = np.take_along_axis(x, gather, axis=1)
                converted[k] = np.where(valid, cut, np.zeros((), x.dtype))
            else:
                converted[k] = x
        converted["attention_mask"] = valid
        out.append(converted)
    return out


def shared_prefix_logprobs(config: ModelConfig, params: Params, batch: Any, temperature: float | jax.Array = 1.0) -> jax.Array:
    """float32[N, C]: the continuation token log-probs of a shared-prefix (micro-)batch, a dict
    (prefix_tokens, prefix_mask, prefix_rows, tokens, attention_mask; prefix_rows are taken
    modulo the number of prefixes it holds)."""
    get = batch.__getitem__ if isinstance(batch, Mapping) else lambda name: getattr(batch, name)
    prefix = get("prefix_tokens")
    rows = get("prefix_rows") % prefix.shape[0]
    return prefix_token_logprobs(
        config, params, prefix, get("prefix_mask"), rows, get("tokens"), get("attention_mask"), temperature
    )
