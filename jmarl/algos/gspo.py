"""GSPO (single-agent baseline): sequence-level ratio exp(mean_t(lp - lp_old)) clipped to
[1 - 3e-4, 1 + 4e-4], `seq_mean_token_mean`. ratio="sequence_token" gives GSPO-token."""

from dataclasses import dataclass

from jmarl.algos.method import GroupPolicyConfig, group_policy_method


@dataclass(frozen=True)
class GSPOConfig(GroupPolicyConfig):
    """GSPO defaults: ratio "sequence", clip 3e-4/4e-4, aggregation "seq_mean_token_mean"."""

    ratio: str = "sequence"
    clip_low: float = 3e-4
    clip_high: float = 4e-4


Config = GSPOConfig
METHOD = group_policy_method("gspo", GSPOConfig, multi_agent=False)
