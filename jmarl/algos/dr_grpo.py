"""Dr.GRPO (single-agent baseline): GRPO without std normalisation, the loss summed over tokens
and divided by N x a constant completion budget (`seq_mean_token_sum_norm`; the budget is
`norm_length`, by default the run's sampling.max_new_tokens, as TRL divides by its
max_completion_length: the normaliser never depends on padding)."""

from dataclasses import dataclass

from jmarl.algos.method import GroupPolicyConfig, group_policy_method


@dataclass(frozen=True)
class DrGRPOConfig(GroupPolicyConfig):
    """Dr.GRPO defaults: normalize "none", aggregation "seq_mean_token_sum_norm", clip 0.2/0.2."""

    normalize: str = "none"
    aggregation: str = "seq_mean_token_sum_norm"


Config = DrGRPOConfig
METHOD = group_policy_method("dr_grpo", DrGRPOConfig, multi_agent=False)
