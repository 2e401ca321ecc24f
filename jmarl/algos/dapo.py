"""DAPO (single-agent baseline): GRPO with clip-higher (0.2/0.28), token-level loss mean, dynamic
sampling (groups with zero reward variance are dropped from the loss) and, as an option, the
paper's soft overlong punishment (reward shaping by completion length)."""

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jmarl.algos import _checks
from jmarl.algos.method import GroupPolicyConfig, group_policy_advantages, group_policy_method
from jmarl.batch import LearnerBatch
from jmarl.errors import JmarlError


@dataclass(frozen=True)
class DAPOConfig(GroupPolicyConfig):
    """DAPO defaults: clip 0.2/0.28, aggregation "token_mean", drop_zero_variance, no KL.

    overlong_buffer: L_cache, the last tokens of the completion budget in which a completion's
    reward is lowered linearly with its length (`overlong_penalty`); 0 (the default, as TRL's
    DAPO loss) turns the shaping off; the paper uses 4,096 of 20,480. overlong_factor: the
    penalty at the full budget (verl's penalty_factor). overlong_limit: L_max, the completion
    budget (None: the run's sampling.max_new_tokens; called directly, the batch's completion
    width C).
    """

    clip_high: float = 0.28
    aggregation: str = "token_mean"
    drop_zero_variance: bool = True
    overlong_buffer: int = 0
    overlong_factor: float = 1.0
    overlong_limit: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _checks.check_int(self, "overlong_buffer", low=0)
        _checks.check_range(self, "overlong_factor", low=0.0)
        _checks.check_int(self, "overlong_limit", low=1, allow_none=True)
        if self.overlong_buffer and self.overlong_limit is not None and self.overlong_buffer > self.overlong_limit:
            raise JmarlError(f"DAPOConfig.overlong_buffer = {self.overlong_buffer} is more than overlong_limit "
                             f"({self.overlong_limit}, the completion budget); lower it")


def overlong_penalty(lengths: jax.Array, limit: int, buffer: int, factor: float = 1.0) -> jax.Array:
    """f32[N]: DAPO's soft overlong punishment of completions of `lengths` int[N] tokens under a
    budget of `limit` tokens whose last `buffer` tokens are the punishment interval:

        0                                         length <= limit - buffer
        factor * ((limit - buffer) - length) / buffer   limit - buffer < length <= limit
        -factor                                   length > limit

    (the paper's R_length, eq. 13, scaled by verl's penalty_factor; TRL's
    `get_soft_overlong_punishment` at factor 1). buffer 0: zeros."""
    lengths = jnp.asarray(lengths, jnp.float32)
    if buffer <= 0:
        return jnp.zeros_like(lengths)
    inside = ((limit - buffer) - lengths) / buffer
    return factor * jnp.clip(inside, -1.0, 0.0)


def dapo_advantages(cfg: DAPOConfig, batch: LearnerBatch, state=None) -> jax.Array:
    """Group-relative advantages f32[N] of the reward plus `overlong_penalty` of each sample's
    completion length (its loss-mask tokens) when `cfg.overlong_buffer` > 0. Dynamic sampling
    (`keep_mask`) still reads the unshaped reward: a group is dropped when its task rewards are all
    equal, as verl's DAPO recipe filters on accuracy."""
    if not cfg.overlong_buffer:
        return group_policy_advantages(cfg, batch, state)
    limit = cfg.overlong_limit if cfg.overlong_limit is not None else batch.loss_mask.shape[-1]
    penalty = overlong_penalty(jnp.sum(batch.loss_mask, axis=-1), limit, cfg.overlong_buffer, cfg.overlong_factor)
    return group_policy_advantages(cfg, batch.replace(reward=batch.reward + penalty), state)


Config = DAPOConfig
METHOD = dataclasses.replace(group_policy_method("dapo", DAPOConfig, multi_agent=False), advantages=dapo_advantages)
