"""JoyAgents-R1 (Han et al., arXiv 2506.19846): hierarchical agents, node-wise sampling, memory.

The paper publishes only the recipe; everything below is jmarl's own realization of it.
- Node-wise Monte Carlo sampling (the workflow): one base trajectory; at each agent node G
  alternatives while every other node keeps its base action. Each node is a group whose
  rewards are the final outcomes, R = R_accuracy + R_format - cost_weight * R_cost
  (`total_reward`).
- Marginal-benefit selection (`keep_mask`): only the top-K node groups by reward variance
  (default K=2) produce gradients; their agents are the ones updated this step.
- Advantage and loss: GRPO blocks (std-normalised mean baseline, token ratio clip 0.2/0.2,
  `seq_mean_token_mean`, no KL).
- Adaptive memory: this module holds its math only: thresholds mu +- z sigma of a node group
  (`memory_thresholds`), which samples are admitted (`admission_mask`: reward above mu + 1.96
  sigma) or evict the entries retrieved for them (`eviction_mask`: below mu - 1.96 sigma), and
  the entry score time_weight * exp(-decay * age) + reward_weight * (reward - group mean)
  (`entry_score`). The store itself (entries, retrieval, capacity, JSON) is the host-side
  `jmarl.workflows.memory`, which calls these functions.
- Group size: sigma uses `ddof` (default 1), and one sample of a group of G is at most
  (G - 1) / sqrt(G) sigmas from the mean, so with z = 1.96 nothing is ever admitted or
  evicted for G <= 5. The default G is therefore 8 (as HACPO's), and `JoyAgentsConfig` warns
  (`MemoryGroupSizeWarning`, at config time) when the memory is on (`use_memory`) and G is too
  small for its z (`min_group_size_for_memory`): training still works, the memory stays empty.
"""

import math
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jmarl.algos import _checks
from jmarl.algos.advantages import _segments, _stats, top_k_groups
from jmarl.algos.grpo import advantages, loss, validate_policy_fields
from jmarl.errors import JmarlError

__all__ = [
    "JoyAgentsConfig",
    "Config",
    "total_reward",
    "memory_thresholds",
    "admission_mask",
    "eviction_mask",
    "entry_score",
    "min_group_size_for_memory",
    "MemoryGroupSizeWarning",
    "advantages",
    "keep_mask",
    "loss",
]


@dataclass(frozen=True)
class JoyAgentsConfig:
    """JoyAgents-R1 defaults (jmarl's realization): G=8, top-2 groups, memory z 1.96, score weights 1/1, GRPO loss.

    use_memory: whether agents keep, retrieve and update a memory (the trainer's switch).
    memory_decay: time decay per step of an entry's score (the memory store's tau = 1 / decay).
    """

    num_generations: int = 8
    top_k_groups: int = 2
    cost_weight: float = 1.0
    memory_z: float = 1.96
    memory_time_weight: float = 1.0
    memory_reward_weight: float = 1.0
    memory_decay: float = 0.1
    memory_top_m: int = 3
    memory_capacity: int = 64
    use_memory: bool = True
    baseline: str = "mean"
    normalize: str = "std"
    ddof: int = 1
    eps: float = 1e-6
    ratio: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    aggregation: str = "seq_mean_token_mean"
    norm_length: int | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"

    def __post_init__(self) -> None:
        validate_policy_fields(self)
        _checks.check_int(self, "top_k_groups", low=1)
        _checks.check_range(self, "cost_weight", low=0.0)
        _checks.check_range(self, "memory_z", low=0.0)
        _checks.check_range(self, "memory_time_weight", low=0.0)
        _checks.check_range(self, "memory_reward_weight", low=0.0)
        _checks.check_range(self, "memory_decay", low=0.0)
        _checks.check_int(self, "memory_top_m", low=0)
        _checks.check_int(self, "memory_capacity", low=1)
        _checks.check_bool(self, "use_memory")
        need = min_group_size_for_memory(self.memory_z, self.ddof)
        if self.use_memory and self.num_generations < need:
            warnings.warn(
                f"JoyAgents-R1: num_generations (the group size G) = {self.num_generations} is too small for the memory: "
                f"one sample of a group of G is at most (G - 1) / sqrt(G) standard deviations (ddof "
                f"{self.ddof}) from the mean, so with memory_z = {self.memory_z} nothing could ever be "
                f"admitted or evicted; set workflow.group_size >= {need}, lower algo.options.memory_z, or "
                "turn the memory off with algo.options.use_memory=false",
                MemoryGroupSizeWarning,
                stacklevel=3,
            )


Config = JoyAgentsConfig


# ---------------------------------------------------------------- per-sample math (device)


def total_reward(
    accuracy: jax.Array, format_reward: jax.Array, cost: jax.Array, *, cost_weight: float = 1.0
) -> jax.Array:
    """R f32[N] = accuracy f32[N] + format_reward f32[N] - cost_weight * cost f32[N]."""
    acc, fmt, cst = (jnp.asarray(x, jnp.float32) for x in (accuracy, format_reward, cost))
    return acc + fmt - cost_weight * cst


def memory_thresholds(
    rewards: jax.Array, groups: jax.Array, *, num_groups: int, z: float = 1.96, ddof: int = 1
) -> tuple[jax.Array, jax.Array]:
    """Per-sample (upper, lower) thresholds f32[N] = mu_g +- z * sigma_g of the sample's group."""
    rewards = jnp.asarray(rewards, jnp.float32)
    seg, valid = _segments(groups, num_groups)
    stats = _stats(rewards, seg, valid, num_groups, ddof)
    mu, sigma = stats.mean[seg], stats.std[seg]
    return mu + z * sigma, mu - z * sigma


class MemoryGroupSizeWarning(UserWarning):
    """The group size G is too small for the memory's z: nothing can be admitted or evicted."""


def min_group_size_for_memory(z: float, ddof: int = 1) -> int:
    """The smallest group size G whose most extreme sample can pass mu +- z * sigma.

    A single outlier among G - 1 equal rewards has |r - mu| / sigma = sqrt((G - 1)(G - ddof) / G)
    ((G - 1) / sqrt(G) with ddof 1, sqrt(G - 1) with ddof 0), the largest z-score any sample of
    G can reach (Samuelson's inequality); admission needs it strictly above z.
    """
    g = max(2, ddof + 1)
    while math.sqrt((g - 1) * (g - ddof) / g) <= z:
        g += 1
    return g


def _informative(rewards: jax.Array, groups: jax.Array, num_groups: int) -> jax.Array:
    seg, valid = _segments(groups, num_groups)
    stats = _stats(jnp.asarray(rewards, jnp.float32), seg, valid, num_groups, 0)
    return valid & (stats.count[seg] >= 2) & (stats.max[seg] > stats.min[seg])


def admission_mask(
    rewards: jax.Array, groups: jax.Array, *, num_groups: int, z: float = 1.96, ddof: int = 1
) -> jax.Array:
    """bool[N]: samples whose reward is above mu + z * sigma of their group (memory admission)."""
    upper, _ = memory_thresholds(rewards, groups, num_groups=num_groups, z=z, ddof=ddof)
    return _informative(rewards, groups, num_groups) & (jnp.asarray(rewards) > upper)


def eviction_mask(
    rewards: jax.Array, groups: jax.Array, *, num_groups: int, z: float = 1.96, ddof: int = 1
) -> jax.Array:
    """bool[N]: samples whose reward is below mu - z * sigma (the entries retrieved for them are evicted)."""
    _, lower = memory_thresholds(rewards, groups, num_groups=num_groups, z=z, ddof=ddof)
    return _informative(rewards, groups, num_groups) & (jnp.asarray(rewards) < lower)


def entry_score(
    age: jax.Array,
    reward_gap: jax.Array,
    *,
    decay: float = 0.1,
    time_weight: float = 1.0,
    reward_weight: float = 1.0,
) -> jax.Array:
    """Entry score f32[E] = time_weight * exp(-decay * age) + reward_weight * reward_gap (age in steps)."""
    age = jnp.asarray(age, jnp.float32)
    return time_weight * jnp.exp(-decay * age) + reward_weight * jnp.asarray(reward_gap, jnp.float32)


# ---------------------------------------------------------------- uniform method interface


def keep_mask(cfg: JoyAgentsConfig, rewards: jax.Array, groups: jax.Array, *, num_groups: int) -> jax.Array:
    """bool[N]: samples of the top-K node groups by reward variance (marginal-benefit selection)."""
    keep, _ = top_k_groups(rewards, groups, num_groups=num_groups, k=cfg.top_k_groups, ddof=cfg.ddof)
    return keep
