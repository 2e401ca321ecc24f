"""One policy group's learning from a step's sample records: the body `Trainer.rl_step` runs per group.

    records -> `learner_batch` (packed `LearnerBatch`) -> the policies with samples
            -> `score_batch` (old / reference log-probs, the method's advantages) -> the update

`learn` returns the update's metrics under the names the trainer logs and the step's figures
(seconds scoring and updating, real tokens and slots of the packed rows); it writes the group's
updated state back. Nothing here branches on a method's or a plan's name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np

from jmarl.train.learner import GroupFns, active_policies, learner_batch, merge, restrict, score_batch
from jmarl.train.packing import policy_token_utilization, shape_of, token_utilization
from jmarl.train.policies import PolicyGroup
from jmarl.train.step import FIRST_UPDATE_METRICS
from jmarl.workflows.base import SampleRecord


@dataclass(frozen=True)
class Learned:
    """What one group's `learn` reports: metrics (train/..., learner/...), and the figures the
    step sums over groups: seconds scoring (old / reference log-probs, advantages) and
    updating, real tokens and token slots of its packed rows, and whether it updated at all."""

    metrics: dict[str, float]
    score_seconds: float = 0.0
    update_seconds: float = 0.0
    real_tokens: int = 0
    token_slots: int = 0
    updated: bool = False


@dataclass(frozen=True)
class LearnSettings:
    """The step-invariant settings of `learn`: the update's micro-batches (`parts`), the plan's
    bound on a policy's samples per step (`min_rows`, 0: none), packed rows per micro-batch
    (`rows_per_part`), the mesh's policy-axis size (`policy_multiple`), whether old log-probs
    are recomputed (`recompute`), every policy's name, and the prefix of the update's metrics
    ("train/" or "train/<group>/")."""

    parts: int
    min_rows: int
    rows_per_part: int
    policy_multiple: int
    recompute: bool
    policy_names: Sequence[str]
    prefix: str


def learn(group: PolicyGroup, fns: GroupFns, records: Sequence[SampleRecord], method_state: Any,
          settings: LearnSettings, known: set[tuple[int, int]]) -> Learned:
    """Updates `group` on its policies' records (the rest are ignored): packs them (a packed
    shape of `known`, the group's earlier steps, where it costs little more; the new shape is
    added to it), cuts a stacked group to the policies with samples (`active_policies`), scores
    and updates them, and writes their state back. An empty group is left as it was."""
    names = settings.policy_names
    batch, counts = learner_batch(group, records, settings.parts, settings.min_rows, settings.rows_per_part,
                                  known=known)
    if not any(counts):
        return Learned({})
    packed = shape_of(batch, settings.parts)
    known.add((packed.rows, packed.width))
    metrics: dict[str, float] = {}
    t0 = time.perf_counter()
    active = active_policies(counts, group.stacked, settings.policy_multiple)
    view, batch = (group, batch) if active is None else restrict(group, batch, active)
    real, slots = token_utilization(batch)
    if len(names) > 1:
        for pid, (p_real, p_slots) in zip(view.policy_ids, policy_token_utilization(batch, view.stacked)):
            metrics[f"learner/{names[pid]}/token_utilization"] = p_real / max(p_slots, 1)
    cross = bool(np.any(batch.source_policy != batch.learner))
    batch = score_batch(view, fns, batch, method_state, recompute=settings.recompute, cross=cross)
    batch = jax.block_until_ready(batch)
    t1 = time.perf_counter()
    state, m = fns.update(view.state, group.base, batch)
    if active is None:
        group.state = state
    else:
        merge(group, active, state)
    m = jax.device_get(m)
    t2 = time.perf_counter()
    metrics.update(routing_mismatch_metrics(m, view.policy_ids, counts, group.policy_ids, names))
    for k, v in m.items():
        metrics[settings.prefix + k] = float(np.mean(v))
        if k in FIRST_UPDATE_METRICS:  # per policy: the learner against its own sampler
            for pid, x in zip(view.policy_ids, np.reshape(v, -1)):
                metrics[f"train/{names[pid]}/{k}"] = float(x)
    return Learned(metrics, t1 - t0, t2 - t1, real, slots, True)


def routing_mismatch_metrics(m: dict[str, Any], updated: Sequence[int], counts: Sequence[int],
                             policy_ids: Sequence[int], names: Sequence[str]) -> dict[str, float]:
    """learner/<policy>/routing_mismatch of an update's metrics `m` (routing replay; its
    "routing_mismatch" entry is removed from m): one value per updated policy (`updated`: the
    policy ids on the update's policy axis, or the one policy of an unstacked group) that had
    samples (`counts[i]` of `policy_ids[i]`); {} without replay."""
    values = m.pop("routing_mismatch", None)
    if values is None:
        return {}
    had = {pid for pid, c in zip(policy_ids, counts) if c}
    values = np.asarray(values).reshape(len(updated), -1)  # [policies, ...] (one row when unstacked)
    return {f"learner/{names[pid]}/routing_mismatch": float(np.mean(v)) for pid, v in zip(updated, values) if pid in had}
