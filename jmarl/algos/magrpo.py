"""MAGRPO (Liu et al., arXiv 2508.04652; CoMLRL): cooperative agents, one joint reward.

Each agent samples G completions from its own prompt; joint actions combine one completion per
agent ("aligned": the g-th of every agent, G joint actions; "cross": the Cartesian product, G^n
joint actions). The reward is given per joint action; a completion's return aggregates the
returns of every joint action it appears in (sum, as CoMLRL, or mean). In multi-turn episodes
every joint action spawns a child node and its return is r_t + gamma * mean(children returns).
Group = the G sibling completions of one agent at one node. Advantage = (return - baseline)
(mean: MAGRPO, none: MAREINFORCE, max: MAReMax, loo: MARLOO), divided by the group std by
default. Loss: on-policy -A * sum_t lp over completion tokens (ratio "none", `seq_sum`), KL
optional; padding after EOS is masked (CoMLRL sums it, which is a bug).

Sampling defaults of the paper (for the sampler / trainer config, not this dataclass): lr 5e-6,
temperature 0.6, top_p 0.6, top_k 50.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jmarl.algos import _checks
from jmarl.algos.advantages import filter_groups
from jmarl.algos.grpo import advantages, validate_policy_fields
from jmarl.algos.losses import policy_loss
from jmarl.errors import JmarlError

JOINT_MODES = ("aligned", "cross")
JOINT_AGGREGATES = ("sum", "mean")


__all__ = [
    "MAGRPOConfig",
    "Config",
    "joint_action_index",
    "completion_returns",
    "tree_returns",
    "advantages",  # GRPO's group advantage over MAGRPO's groups (one per agent per node)
    "keep_mask",
    "loss",
]


@dataclass(frozen=True)
class MAGRPOConfig:
    """MAGRPO defaults: G=4, aligned joint actions, sum aggregation, gamma 1.0, mean baseline, std-normalised, seq_sum."""

    num_generations: int = 4
    num_turns: int = 1
    joint_mode: str = "aligned"
    joint_aggregate: str = "sum"
    gamma: float = 1.0
    early_stop_reward: float | None = None
    baseline: str = "mean"
    normalize: str = "std"
    ddof: int = 1
    eps: float = 1e-6
    aggregation: str = "seq_sum"
    kl_coef: float = 0.0
    kl_kind: str = "k3"

    def __post_init__(self) -> None:
        validate_policy_fields(self)
        _checks.check_int(self, "num_generations", low=2)
        _checks.check_int(self, "num_turns", low=1)
        _checks.check_choice(self, "joint_mode", JOINT_MODES)
        _checks.check_choice(self, "joint_aggregate", JOINT_AGGREGATES)
        _checks.check_range(self, "gamma", low=0.0, high=1.0)
        _checks.check_range(self, "early_stop_reward", allow_none=True)


Config = MAGRPOConfig


def joint_action_index(num_agents: int, num_generations: int, mode: str = "aligned") -> np.ndarray:
    """Which completion of each agent forms each joint action: int32[J, num_agents].

    Entry [j, k] is the index in [0, G) of agent k's completion in joint action j. "aligned":
    J = G, joint action g takes every agent's g-th completion. "cross": J = G^n in row-major
    order (agent 0 varies slowest). Static structure, built on the host.
    """
    if mode not in JOINT_MODES:
        raise JmarlError(f"joint mode {mode!r} is not supported; choose one of {JOINT_MODES}")
    if num_agents < 1 or num_generations < 1:
        raise JmarlError(
            f"joint actions need num_agents >= 1 and num_generations >= 1, got {num_agents}, {num_generations}"
        )
    if mode == "aligned":
        return np.repeat(np.arange(num_generations, dtype=np.int32)[:, None], num_agents, axis=1)
    grid = np.unravel_index(np.arange(num_generations**num_agents), (num_generations,) * num_agents)
    return np.stack(grid, axis=-1).astype(np.int32)


def completion_returns(
    joint_returns: jax.Array, joint_index: jax.Array, *, num_generations: int, aggregate: str = "sum"
) -> jax.Array:
    """Per-completion returns f32[..., n, G] from joint-action returns f32[..., J] and index int[J, n].

    Completion (k, g) gets the sum (or mean) of the returns of the joint actions j with
    joint_index[j, k] == g. Leading axes (nodes, tasks) are batched.
    """
    if aggregate not in JOINT_AGGREGATES:
        raise JmarlError(f"joint aggregate {aggregate!r} is not supported; choose one of {JOINT_AGGREGATES}")
    member = (jnp.asarray(joint_index)[..., None] == jnp.arange(num_generations)).astype(jnp.float32)
    total = jnp.einsum("...j,jng->...ng", jnp.asarray(joint_returns, jnp.float32), member)
    if aggregate == "sum":
        return total
    return total / jnp.maximum(jnp.sum(member, axis=0), 1.0)


def tree_returns(rewards: jax.Array, parent: jax.Array, *, gamma: float, max_depth: int) -> jax.Array:
    """Returns f32[M] of the M joint actions of a turn tree, from rewards f32[M] and parent int[M].

    parent[j] is the joint action (at the previous turn) whose child node joint action j was
    taken at, or -1 at the root turn. Return = r_j + gamma * mean(returns of j's children);
    a joint action without children (last turn, or an early-stopped branch) returns r_j.
    `max_depth` is the number of turns below the root turn (num_turns - 1); it bounds the
    static number of bottom-up sweeps.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    parent = jnp.asarray(parent, jnp.int32)
    m = rewards.shape[0]
    is_child = parent >= 0
    seg = jnp.where(is_child, parent, m)
    num_children = jax.ops.segment_sum(is_child.astype(jnp.float32), seg, num_segments=m + 1)[:m]

    def sweep(_, returns):
        child_sum = jax.ops.segment_sum(jnp.where(is_child, returns, 0.0), seg, num_segments=m + 1)[:m]
        child_mean = jnp.where(num_children > 0, child_sum / jnp.maximum(num_children, 1.0), 0.0)
        return rewards + gamma * child_mean

    return jax.lax.fori_loop(0, max_depth, sweep, rewards)


def keep_mask(cfg: MAGRPOConfig, rewards: jax.Array, groups: jax.Array, *, num_groups: int) -> jax.Array:
    """bool[N]: every non-padding sample (MAGRPO has no group filter)."""
    return filter_groups(rewards, groups, num_groups=num_groups)


def loss(
    cfg: MAGRPOConfig,
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    ref_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """On-policy -A * sum_t lp (mean over sequences) + optional KL: log-probs f32[N, T], advantages f32[N].

    `old_logprobs` only feeds the approx_kl metric (MAGRPO takes one step per batch).
    """
    return policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        ratio="none",
        aggregation=cfg.aggregation,
        ref_logprobs=ref_logprobs,
        kl_coef=cfg.kl_coef,
        kl_kind=cfg.kl_kind,
    )
