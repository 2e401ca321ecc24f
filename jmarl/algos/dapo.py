"""DAPO (single-agent baseline): GRPO with clip-higher (0.2/0.28), token-level loss mean and
dynamic sampling (groups with zero reward variance are dropped from the loss)."""

from dataclasses import dataclass

from jmarl.algos.method import GroupPolicyConfig, group_policy_method


@dataclass(frozen=True)
class DAPOConfig(GroupPolicyConfig):
    """DAPO defaults: clip 0.2/0.28, aggregation "token_mean", drop_zero_variance, no KL."""

    clip_high: float = 0.28
    aggregation: str = "token_mean"
    drop_zero_variance: bool = True


Config = DAPOConfig
METHOD = group_policy_method("dapo", DAPOConfig, multi_agent=False)
