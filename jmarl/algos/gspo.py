"""GSPO (single-agent baseline): sequence-level ratio exp(mean_t(lp - lp_old)) clipped to
[1 - 3e-4, 1 + 4e-4], `seq_mean_token_mean`. ratio="sequence_token" gives GSPO-token."""

from dataclasses import dataclass

from jmarl.algos.grpo import GRPOConfig, advantages, keep_mask, loss

__all__ = ["GSPOConfig", "Config", "advantages", "keep_mask", "loss"]


@dataclass(frozen=True)
class GSPOConfig(GRPOConfig):
    """GSPO defaults: ratio "sequence", clip 3e-4/4e-4, aggregation "seq_mean_token_mean"."""

    ratio: str = "sequence"
    clip_low: float = 3e-4
    clip_high: float = 4e-4


Config = GSPOConfig
