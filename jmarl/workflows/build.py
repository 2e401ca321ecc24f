"""From a plan's sample records to a `Rollouts` batch (host side, NumPy).

Row i of the batch is record i: tokens = prompt tokens followed by completion tokens,
right-padded with `pad_id` to T = `bucket_length(max prompt + completion length)`; loss_mask
is True exactly on the completion tokens; behavior_logprobs holds each completion token's
log-prob at that token's position (0 elsewhere); reward/group/env/turn/agent/policy/
source_policy come from the record; source_seq_logprob is the record's when it carries one
(a cross sample, whose behavior_logprobs are the unknown 0s) and else the mean of its
completion log-probs. Group ids are renumbered contiguously from 0 in order of
first appearance (the identity on a plan's full output), so a filtered list still builds a
valid batch. The samples of one learner policy are `select(rollouts, rollouts.policy == p)`.
When some completion carries its recorded experts (routing replay), routing [N, T, W] holds
each token's, flattened, in the widest dtype and width of the batch (`rollouts.as_routing`),
the marker `no_route` elsewhere; None when none does.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jmarl.errors import JmarlError
from jmarl.rollouts import Rollouts, make_rollouts
from jmarl.padding import DEFAULT_LENGTH_BUCKETS, as_routing, bucket_length, no_route
from jmarl.workflows.base import SampleRecord


def build_rollouts(
    records: Sequence[SampleRecord],
    *,
    pad_id: int = 0,
    buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
) -> Rollouts:
    """N records -> `Rollouts` with tokens int32[N, T], T the bucketed longest sequence."""
    if not records:
        raise JmarlError("build_rollouts got no sample records; the plan produced no samples")
    prompts = [_flat(r.completion.prompt_tokens, np.int32) for r in records]
    completions = [_flat(r.completion.completion_tokens, np.int32) for r in records]
    logprobs = [_flat(r.completion.logprobs, np.float32) for r in records]
    for i, (c, lp) in enumerate(zip(completions, logprobs)):
        if c.shape != lp.shape:
            raise JmarlError(
                f"record {i}: {c.size} completion tokens but {lp.size} log-probs; the sampler "
                "must return one behaviour log-prob per completion token"
            )
    _check_groups_within_one_policy(records)

    n = len(records)
    lengths = np.array([p.size + c.size for p, c in zip(prompts, completions)])
    t = bucket_length(int(lengths.max()), buckets)
    tokens = np.full((n, t), pad_id, np.int32)
    loss_mask = np.zeros((n, t), bool)
    behavior = np.zeros((n, t), np.float32)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
        tokens[i, : p.size] = p
        tokens[i, p.size : p.size + c.size] = c
        loss_mask[i, p.size : p.size + c.size] = True
        behavior[i, p.size : p.size + c.size] = lp
    attention_mask = np.arange(t)[None, :] < lengths[:, None]

    routing = _routing(records, prompts, completions, t)

    renumber: dict[int, int] = {}
    group = np.array([renumber.setdefault(r.group, len(renumber)) for r in records], np.int32)

    def field(name: str, dtype) -> np.ndarray:
        return np.array([getattr(r, name) for r in records], dtype)

    return make_rollouts(
        tokens,
        loss_mask,
        attention_mask,
        field("reward", np.float32),
        group,
        behavior_logprobs=behavior,
        env=field("env", np.int32),
        turn=field("turn", np.int32),
        agent=field("agent", np.int32),
        policy=field("policy", np.int32),
        source_policy=field("source_policy", np.int32),
        source_seq_logprob=np.array(
            [
                _mean(lp) if r.source_seq_logprob is None else r.source_seq_logprob
                for r, lp in zip(records, logprobs)
            ],
            np.float32,
        ),
        routing=routing,
    )


def _routing(records: Sequence[SampleRecord], prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray],
             t: int) -> np.ndarray | None:
    """[N, T, W] recorded expert ids of the records' tokens (prompt then completion, each
    token's [S, k] flattened), or None when no completion carries any."""
    given = [r.completion.routing for r in records]
    if all(g is None for g in given):
        return None
    flat = []
    for i, (g, p, c) in enumerate(zip(given, prompts, completions)):
        if g is None:
            flat.append(None)
            continue
        g = np.asarray(g)
        if g.shape[0] != p.size + c.size:
            raise JmarlError(f"record {i}: routing for {g.shape[0]} tokens but {p.size} prompt + {c.size} "
                             "completion tokens; the sampler records one routing per token")
        row = np.full((t,) + g.shape[1:], no_route(g.dtype), g.dtype)  # no record past the sequence
        row[: g.shape[0]] = g
        flat.append(row.reshape(t, -1))
    return np.stack(as_routing(flat, [(t,)] * len(flat)))


def _mean(x: np.ndarray) -> float:
    """Mean of x (0 for an empty completion, as `make_rollouts` does)."""
    return float(x.mean()) if x.size else 0.0


def _flat(x, dtype) -> np.ndarray:
    """x as a 1-D array of dtype."""
    return np.asarray(x, dtype).reshape(-1)


def _check_groups_within_one_policy(records: Sequence[SampleRecord]) -> None:
    """A GRPO group is normalised within one learner policy; mixing policies is a plan bug."""
    policy_of_group: dict[int, int] = {}
    for r in records:
        if policy_of_group.setdefault(r.group, r.policy) != r.policy:
            raise JmarlError(
                f"group {r.group} holds samples for policies {policy_of_group[r.group]} and "
                f"{r.policy}; a group must belong to one learner policy"
            )
