"""Dr.GRPO (single-agent baseline): GRPO without std normalisation, loss summed over tokens and
divided by N * T_max (`seq_mean_token_sum_norm`; set `norm_length` to the generation budget)."""

from dataclasses import dataclass

from jmarl.algos.grpo import GRPOConfig, advantages, keep_mask, loss

__all__ = ["DrGRPOConfig", "Config", "advantages", "keep_mask", "loss"]


@dataclass(frozen=True)
class DrGRPOConfig(GRPOConfig):
    """Dr.GRPO defaults: normalize "none", aggregation "seq_mean_token_sum_norm", clip 0.2/0.2."""

    normalize: str = "none"
    aggregation: str = "seq_mean_token_sum_norm"


Config = DrGRPOConfig
