"""DAPO (single-agent baseline): GRPO with clip-higher (0.2/0.28), token-level loss mean and
dynamic sampling (groups with zero reward variance are dropped: see `keep_mask`)."""

from dataclasses import dataclass

from jmarl.algos.grpo import GRPOConfig, advantages, keep_mask, loss

__all__ = ["DAPOConfig", "Config", "advantages", "keep_mask", "loss"]


@dataclass(frozen=True)
class DAPOConfig(GRPOConfig):
    """DAPO defaults: clip 0.2/0.28, aggregation "token_mean", drop_zero_variance, no KL."""

    clip_high: float = 0.28
    aggregation: str = "token_mean"
    drop_zero_variance: bool = True


Config = DAPOConfig
