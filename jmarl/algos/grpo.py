"""GRPO (single-agent baseline): group-normalised advantages + token-ratio clipped surrogate.

The GRPO family's settings and functions are `jmarl.algos.method.GroupPolicyConfig` and
`group_policy_*`; the other single-agent presets (`dr_grpo`, `dapo`, `gspo`) and the
multi-agent methods built on GRPO (`at_grpo`, `magrpo`, `joyagents`) change only defaults.
"""

from dataclasses import dataclass

from jmarl.algos.method import GroupPolicyConfig, group_policy_method


@dataclass(frozen=True)
class GRPOConfig(GroupPolicyConfig):
    """GRPO defaults: token ratio, clip 0.2/0.2, std-normalised mean baseline, seq_mean_token_mean, no KL."""


Config = GRPOConfig
METHOD = group_policy_method("grpo", GRPOConfig, multi_agent=False)
