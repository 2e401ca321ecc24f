"""AT-GRPO (Zhao et al., arXiv 2510.11062; PettingLLMs): agent- and turn-wise grouped GRPO.

Tree sampling: at every (env, turn, agent) node K candidates are sampled from one identical
prompt; that node is the GRPO group (`group_ids`). Each candidate is scored on its own copy of
the env state; the chosen one (`choose_candidate`: best, sampled or first) continues the
episode. Reward = local reward + alpha * team reward (`mixed_reward`), either immediate
(default) or return-to-go along the continued path (`returns_to_go`). Advantage: std-normalised
within the group. Loss: PPO clip 0.2/0.2 with dual clip c=3, `token_mean`, no KL.

Paper training defaults (for the trainer config): 1 epoch, grad clip 1.0, AdamW wd 0.01,
lr 1e-6, 128 envs per step, temperature 1.0 train / greedy eval.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jmarl.algos import _checks
from jmarl.algos.grpo import advantages, keep_mask, loss, validate_policy_fields
from jmarl.errors import JmarlError

__all__ = [
    "ATGRPOConfig",
    "Config",
    "group_ids",
    "mixed_reward",
    "returns_to_go",
    "node_rewards",
    "choose_candidate",
    "advantages",
    "keep_mask",
    "loss",
]

TURN_ORDERS = ("sequential", "parallel")
CONTINUE_WITH = ("best", "sampled", "first")
REWARD_MODES = ("immediate", "return_to_go")


@dataclass(frozen=True)
class ATGRPOConfig:
    """AT-GRPO defaults: K=4, 3 turns, alpha 1, immediate reward, clip 0.2/0.2, dual clip 3, token_mean, no KL."""

    num_candidates: int = 4
    num_turns: int = 3
    turn_order: str = "sequential"
    continue_with: str = "best"
    alpha: float = 1.0
    reward_mode: str = "immediate"
    gamma: float = 1.0
    baseline: str = "mean"
    normalize: str = "std"
    ddof: int = 1
    eps: float = 1e-6
    ratio: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0
    aggregation: str = "token_mean"
    norm_length: int | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    drop_zero_variance: bool = False
    drop_low_variance_frac: float = 0.0
    drop_low_mean_frac: float = 0.0

    def __post_init__(self) -> None:
        validate_policy_fields(self)
        _checks.check_int(self, "num_candidates", low=2)
        _checks.check_int(self, "num_turns", low=1)
        _checks.check_choice(self, "turn_order", TURN_ORDERS)
        _checks.check_choice(self, "continue_with", CONTINUE_WITH)
        _checks.check_choice(self, "reward_mode", REWARD_MODES)
        _checks.check_range(self, "alpha", low=0.0)
        _checks.check_range(self, "gamma", low=0.0, high=1.0)


Config = ATGRPOConfig


def group_ids(
    env: jax.Array, turn: jax.Array, agent: jax.Array, *, num_turns: int, num_agents: int
) -> jax.Array:
    """GRPO group id int32[N] of each (env, turn, agent) node: (env * num_turns + turn) * num_agents + agent.

    num_groups = num_envs * num_turns * num_agents. Rows with env < 0, turn outside
    [0, num_turns) or agent outside [0, num_agents) get -1 (padding).
    """
    env, turn, agent = (jnp.asarray(x, jnp.int32) for x in (env, turn, agent))
    valid = (env >= 0) & (turn >= 0) & (turn < num_turns) & (agent >= 0) & (agent < num_agents)
    return jnp.where(valid, (env * num_turns + turn) * num_agents + agent, -1).astype(jnp.int32)


def mixed_reward(local: jax.Array, team: jax.Array, *, alpha: float = 1.0) -> jax.Array:
    """Candidate reward f32[N] = local f32[N] + alpha * team f32[N]."""
    return jnp.asarray(local, jnp.float32) + alpha * jnp.asarray(team, jnp.float32)


def returns_to_go(
    rewards: jax.Array, next_index: jax.Array, *, gamma: float = 1.0, max_steps: int
) -> jax.Array:
    """Return-to-go f32[N]: G_i = r_i + gamma * G_next(i), from rewards f32[N] and next_index int[N].

    next_index[i] is the sample that continues the episode after sample i for the same reward
    stream (the chosen candidate of the agent's next node), or -1 where nothing follows
    (candidates that were not continued, the last turn). `max_steps` (static) is the longest
    chain length minus one.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    next_index = jnp.asarray(next_index, jnp.int32)
    has_next = next_index >= 0
    safe_next = jnp.where(has_next, next_index, 0)

    def step(_, returns):
        return rewards + gamma * jnp.where(has_next, returns[safe_next], 0.0)

    return jax.lax.fori_loop(0, max_steps, step, rewards)


def node_rewards(
    cfg: ATGRPOConfig,
    local: jax.Array,
    team: jax.Array,
    *,
    next_index: jax.Array | None = None,
    max_steps: int | None = None,
) -> jax.Array:
    """The reward f32[N] each candidate is grouped on: local + alpha * team, then the return-to-go
    along `next_index` int[N] (see `returns_to_go`; max_steps defaults to num_turns - 1) when
    `reward_mode` is "return_to_go"."""
    reward = mixed_reward(local, team, alpha=cfg.alpha)
    if cfg.reward_mode == "immediate":
        return reward
    if next_index is None:
        raise JmarlError('reward_mode="return_to_go" needs next_index (the sample that continues each one)')
    steps = cfg.num_turns - 1 if max_steps is None else max_steps
    return returns_to_go(reward, next_index, gamma=cfg.gamma, max_steps=steps)


def choose_candidate(rewards: jax.Array, *, mode: str = "best", key: jax.Array | None = None) -> jax.Array:
    """Index int32[...] of the candidate that continues the episode, from rewards f32[..., K].

    "best": highest reward (the first on ties); "first": 0; "sampled": uniform over the K
    candidates using `key`.
    """
    rewards = jnp.asarray(rewards)
    if mode == "best":
        return jnp.argmax(rewards, axis=-1).astype(jnp.int32)
    if mode == "first":
        return jnp.zeros(rewards.shape[:-1], jnp.int32)
    if mode == "sampled":
        if key is None:
            raise JmarlError("choose_candidate(mode='sampled') needs an RNG key")
        return jax.random.randint(key, rewards.shape[:-1], 0, rewards.shape[-1], dtype=jnp.int32)
    raise JmarlError(f"continue_with={mode!r} is not supported; choose one of {CONTINUE_WITH}")
