"""Algorithm core: advantages, losses and one module per method, as pure jittable functions.

Shared blocks live in `advantages` and `losses`; every method module (`grpo`, `dr_grpo`,
`dapo`, `gspo`, `magrpo`, `at_grpo`, `hacpo`, `joyagents`) exposes the same interface:
`Config` (a frozen dataclass with the paper defaults), `advantages(cfg, rewards, groups, *,
num_groups, ...)`, `keep_mask(cfg, rewards, groups, *, num_groups)` and
`loss(cfg, logprobs, old_logprobs, advantages, loss_mask, *, ref_logprobs=None, ...)`.
"""

from __future__ import annotations

from types import ModuleType

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
from jmarl.errors import JmarlError

METHODS: dict[str, ModuleType] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "dapo": dapo,
    "gspo": gspo,
    "magrpo": magrpo,
    "at_grpo": at_grpo,
    "hacpo": hacpo,
    "joyagents": joyagents,
}

CONFIGS: dict[str, type] = {name: module.Config for name, module in METHODS.items()}


def get_method(name: str) -> ModuleType:
    """The method module for `name` (one of METHODS), or JmarlError naming the choices."""
    try:
        return METHODS[name]
    except KeyError:
        raise JmarlError(f"unknown algorithm {name!r}; choose one of {', '.join(sorted(METHODS))}") from None


__all__ = [
    "at_grpo",
    "dapo",
    "dr_grpo",
    "grpo",
    "gspo",
    "hacpo",
    "joyagents",
    "magrpo",
    "CONFIGS",
    "METHODS",
    "GroupStats",
    "aggregate_loss",
    "clipped_surrogate",
    "filter_groups",
    "get_method",
    "group_advantages",
    "group_stats",
    "importance_ratio",
    "kl_penalty",
    "masked_seq_mean",
    "masked_token_mean",
    "policy_loss",
    "top_k_groups",
]
