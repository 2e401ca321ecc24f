"""Algorithm core: one `Method` value per learning rule, and the pure functions they are built of.

Shared blocks live in `advantages` (group statistics, advantages, filters) and `losses`
(ratios, the clipped surrogate, KL, aggregation); `method` defines the `Method` value, the loss
settings every method shares (`LossConfig`, `GroupPolicyConfig`) and the registry. Every method
module (`grpo`, `dr_grpo`, `dapo`, `gspo`, `magrpo`, `at_grpo`, `hacpo`, `joyagents`) builds
its `METHOD`; `get_method(name)` takes a registered name or `package.module:NAME`.
"""

from __future__ import annotations

from jmarl.algos import at_grpo, dapo, dr_grpo, grpo, gspo, hacpo, joyagents, magrpo
from jmarl.algos.advantages import GroupStats, filter_groups, group_advantages, group_stats, top_k_groups
from jmarl.algos.losses import (
    aggregate_loss,
    clipped_surrogate,
    importance_ratio,
    kl_penalty,
    masked_seq_mean,
    masked_token_mean,
    policy_loss,
)
from jmarl.algos.method import (
    GroupPolicyConfig,
    LossConfig,
    Method,
    MethodContext,
    group_policy_advantages,
    group_policy_keep_mask,
    group_policy_loss,
    group_policy_method,
    load_method,
)

METHODS: dict[str, Method] = {
    m.METHOD.name: m.METHOD for m in (grpo, dr_grpo, dapo, gspo, magrpo, at_grpo, hacpo, joyagents)
}


def get_method(name: str) -> Method:
    """The method `name`: one of METHODS, or `package.module:NAME` naming your own `Method`;
    JmarlError naming the choices otherwise."""
    return load_method(name, METHODS)


__all__ = [
    "at_grpo",
    "dapo",
    "dr_grpo",
    "grpo",
    "gspo",
    "hacpo",
    "joyagents",
    "magrpo",
    "METHODS",
    "GroupPolicyConfig",
    "GroupStats",
    "LossConfig",
    "Method",
    "MethodContext",
    "aggregate_loss",
    "clipped_surrogate",
    "filter_groups",
    "get_method",
    "group_advantages",
    "group_policy_advantages",
    "group_policy_keep_mask",
    "group_policy_loss",
    "group_policy_method",
    "group_stats",
    "importance_ratio",
    "kl_penalty",
    "load_method",
    "masked_seq_mean",
    "masked_token_mean",
    "policy_loss",
    "top_k_groups",
]
