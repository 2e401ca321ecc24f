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
- Adaptive memory (host side, immutable `Memory` values): a (query, strategy) entry is admitted
  when its reward is above mu + 1.96 sigma of its group (`admission_mask`) and entries whose
  retrieval led to rewards below mu - 1.96 sigma are evicted (`eviction_mask`, `evict`).
  Entries are scored by time_weight * exp(-decay * age) + reward_weight * (reward - group mean)
  (`entry_score`); retrieval is by similarity (computed by the caller), top-m into the prompt
  (`retrieve`). When the memory is full the lowest-scoring entries are dropped. sigma uses
  `ddof` (default 1), so a group of G samples can admit only if (G - 1) / sqrt(G) > z (G >= 6).
"""

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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
    "MemoryEntry",
    "Memory",
    "admit",
    "evict",
    "score_entries",
    "retrieve",
    "memory_to_state",
    "memory_from_state",
    "advantages",
    "keep_mask",
    "loss",
]


@dataclass(frozen=True)
class JoyAgentsConfig:
    """JoyAgents-R1 defaults (jmarl's realization): G=4, top-2 groups, memory z 1.96, score weights 1/1, GRPO loss."""

    num_generations: int = 4
    top_k_groups: int = 2
    cost_weight: float = 1.0
    memory_z: float = 1.96
    memory_time_weight: float = 1.0
    memory_reward_weight: float = 1.0
    memory_decay: float = 0.1
    memory_top_m: int = 3
    memory_capacity: int = 64
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


# ---------------------------------------------------------------- memory bookkeeping (host)


@dataclass(frozen=True)
class MemoryEntry:
    """One remembered (query, strategy) with its reward minus its group mean and its admission step."""

    query: str
    strategy: str
    reward_gap: float
    step: int


@dataclass(frozen=True)
class Memory:
    """An agent's memory: an immutable tuple of entries with a capacity."""

    capacity: int = 64
    entries: tuple[MemoryEntry, ...] = ()


def score_entries(memory: Memory, *, step: int, cfg: JoyAgentsConfig = JoyAgentsConfig()) -> np.ndarray:
    """Scores f32[E] of the memory's entries at training step `step`."""
    if not memory.entries:
        return np.zeros((0,), np.float32)
    age = np.asarray([step - e.step for e in memory.entries], np.float32)
    gap = np.asarray([e.reward_gap for e in memory.entries], np.float32)
    score = cfg.memory_time_weight * np.exp(-cfg.memory_decay * age) + cfg.memory_reward_weight * gap
    return score.astype(np.float32)


def admit(
    memory: Memory, candidates: Iterable[MemoryEntry], *, step: int, cfg: JoyAgentsConfig = JoyAgentsConfig()
) -> Memory:
    """A new memory with `candidates` added; past capacity the lowest-scoring entries are dropped
    (ties: the older entry goes first). Order of the kept entries is preserved."""
    entries = memory.entries + tuple(candidates)
    if len(entries) > memory.capacity:
        score = score_entries(Memory(memory.capacity, entries), step=step, cfg=cfg)
        order = np.lexsort((np.arange(len(entries)), -score))  # best first, earlier index on ties
        keep = np.sort(order[: memory.capacity])
        entries = tuple(entries[i] for i in keep)
    return Memory(memory.capacity, entries)


def evict(memory: Memory, indices: Iterable[int]) -> Memory:
    """A new memory without the entries at `indices`."""
    drop = set(int(i) for i in indices)
    if any(i < 0 or i >= len(memory.entries) for i in drop):
        raise JmarlError(
            f"evict got entry indices {sorted(drop)} for a memory of {len(memory.entries)} entries"
        )
    return Memory(memory.capacity, tuple(e for i, e in enumerate(memory.entries) if i not in drop))


def retrieve(similarity: Sequence[float], *, top_m: int) -> np.ndarray:
    """Indices int[min(m, E)] of the most similar entries, most similar first (ties: lower index)."""
    sim = np.asarray(similarity, np.float64)
    return np.lexsort((np.arange(sim.shape[0]), -sim))[:top_m].astype(np.int64)


def memory_to_state(memory: Memory) -> dict[str, Any]:
    """A JSON-serialisable dict of the memory (saved with checkpoints)."""
    return {"capacity": memory.capacity, "entries": [e.__dict__.copy() for e in memory.entries]}


def memory_from_state(state: dict[str, Any]) -> Memory:
    """The memory stored by `memory_to_state`."""
    try:
        entries = tuple(
            MemoryEntry(str(e["query"]), str(e["strategy"]), float(e["reward_gap"]), int(e["step"]))
            for e in state["entries"]
        )
        return Memory(int(state["capacity"]), entries)
    except (KeyError, TypeError, ValueError) as err:
        raise JmarlError(f"malformed JoyAgents memory state ({err}); expected capacity and entries") from err


# ---------------------------------------------------------------- uniform method interface


def keep_mask(cfg: JoyAgentsConfig, rewards: jax.Array, groups: jax.Array, *, num_groups: int) -> jax.Array:
    """bool[N]: samples of the top-K node groups by reward variance (marginal-benefit selection)."""
    keep, _ = top_k_groups(rewards, groups, num_groups=num_groups, k=cfg.top_k_groups, ddof=cfg.ddof)
    return keep
