"""Per-agent adaptive memory for JoyAgents-R1: admission, eviction, scoring and retrieval.

JoyAgents-R1 (Han et al., arXiv 2506.19846) describes its memory only in words and publishes
no formula or code; every rule below is jmarl's own realisation of that description.

A `Memory` is an immutable value: per agent name a tuple of `MemoryEntry`s (query, strategy
text, reward, group mean at admission, step added, uses), plus its `MemoryOptions`. Every
update (`admit`, `evict`, `mark_used`, `update_memory`) returns a new value.

Rules (defaults in `MemoryOptions`):
- Group statistics: mu = mean and sigma = std with `ddof` (default 1, as the group advantage
  in docs/algorithms.md) of the G rewards of one node group (the G alternatives sampled at one
  agent node by the `node_wise` plan).
- Admission: a sample with reward > mu + z * sigma (z = 1.96, the normal 97.5% quantile; strict)
  adds (query, its completion text as the strategy) to its agent's memory. Nothing is admitted
  from a group with sigma = 0 or with fewer than 2 (or at most `ddof`) members. Note that one
  sample's z-score within G samples is at most (G - 1) / sqrt(G) (ddof 1), so z = 1.96 needs
  G >= 6 to ever admit or evict (`min_group_size_for_memory`; `check_group_size` warns with a
  `MemoryGroupSizeWarning` when the run's group size is smaller).
- Eviction: a sample with reward < mu - z * sigma evicts the entries that were retrieved into
  its prompt (every sample of a node group shares the prompt, so a low outlier blames all the
  entries shown at that node).
- Score: `time_weight * exp(-(now - step) / tau) + reward_weight * (reward - baseline)`,
  weights 1 and 1, tau = 10 steps; `baseline` is the group mean at admission. When an agent's
  memory exceeds `capacity`, the lowest-scoring entries are dropped (ties: the older first).
- Retrieval: cosine similarity of character n-gram counts (n = 3, lower-cased, whitespace
  collapsed; deterministic, no model) between the node's query and each entry's query; the
  top `top_m` entries with similarity > `min_similarity`, most similar first (ties: larger
  reward - baseline, then lower id). The `node_wise` plan shows them to the agent through the
  env state: `dataclasses.replace(state, memory_context={..., agent: strings})`.
- Per step (`update_memory`, a pure function the trainer calls after each plan): uses += 1 for
  every entry retrieved into a node group's prompt, then eviction, then admission, over every
  node group of the step (those dropped by top-K selection included).

The threshold and score math (`memory_thresholds`, `admission_mask`, `eviction_mask`,
`entry_score`) is host-side NumPy in this module, next to the store that uses it.
Memory is saved with checkpoints as an inspectable JSON file (`save`/`load`); the trainer also
keeps it in the checkpoint metadata and writes `output_dir/memory.json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from jmarl.errors import JmarlError
from jmarl.workflows.base import PlanResult
from jmarl.workflows.episodes import expert_demonstrations

_FORMAT = "jmarl.memory"
_VERSION = 1


@dataclass(frozen=True)
class MemoryOptions:
    """Memory rules: capacity (entries per agent), top_m (entries retrieved into a prompt), z
    (threshold in group standard deviations), ddof (of sigma), tau (time-decay constant in
    steps), time_weight/reward_weight (score weights), ngram (characters per n-gram of the
    similarity), min_similarity (retrieved entries must be more similar than this)."""

    capacity: int = 64
    top_m: int = 3
    z: float = 1.96
    ddof: int = 1
    tau: float = 10.0
    time_weight: float = 1.0
    reward_weight: float = 1.0
    ngram: int = 3
    min_similarity: float = 0.0

    def __post_init__(self) -> None:
        for name, low in (("capacity", 1), ("top_m", 0), ("ngram", 1), ("ddof", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise JmarlError(f"memory: {name} must be an int >= {low}, got {value!r}")
        if self.tau <= 0:
            raise JmarlError(f"memory: tau must be > 0, got {self.tau}")
        if self.z < 0 or self.time_weight < 0 or self.reward_weight < 0:
            raise JmarlError("memory: z, time_weight and reward_weight must be >= 0")


@dataclass(frozen=True)
class MemoryEntry:
    """One remembered strategy: id (unique within the memory), the query it answered, the
    strategy text, its reward, the mean reward of its group when admitted (baseline), the
    training step it was added at, and how many node prompts it has been retrieved into."""

    id: int
    query: str
    strategy: str
    reward: float
    baseline: float
    step: int
    uses: int = 0


@dataclass(frozen=True)
class Memory:
    """Every agent's memory: banks = ((agent name, entries), ...), sorted by agent name."""

    options: MemoryOptions = field(default_factory=MemoryOptions)
    banks: tuple[tuple[str, tuple[MemoryEntry, ...]], ...] = ()
    next_id: int = 0

    def entries(self, agent: str) -> tuple[MemoryEntry, ...]:
        """The entries of `agent` (empty if it has none)."""
        return dict(self.banks).get(agent, ())

    def to_json(self) -> str:
        """The memory as an indented, human-readable JSON string."""
        data = {
            "format": _FORMAT,
            "version": _VERSION,
            "options": dataclasses.asdict(self.options),
            "next_id": self.next_id,
            "agents": {a: [dataclasses.asdict(e) for e in es] for a, es in self.banks},
        }
        return json.dumps(data, indent=2, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> "Memory":
        """The memory written by `to_json`."""
        try:
            data = json.loads(text)
            if data.get("format") != _FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, not {_FORMAT!r}")
            options = MemoryOptions(**data["options"])
            banks = {
                str(agent): tuple(_entry(e) for e in entries)
                for agent, entries in data["agents"].items()
            }
            return _with_banks(cls(options=options, next_id=int(data["next_id"])), banks)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise JmarlError(
                f"malformed memory JSON ({err}); expected the file written by Memory.save"
            ) from None


def _entry(data: dict[str, Any]) -> MemoryEntry:
    return MemoryEntry(
        id=int(data["id"]),
        query=str(data["query"]),
        strategy=str(data["strategy"]),
        reward=float(data["reward"]),
        baseline=float(data["baseline"]),
        step=int(data["step"]),
        uses=int(data.get("uses", 0)),
    )


def _with_banks(memory: Memory, banks: dict[str, tuple[MemoryEntry, ...]], **changes) -> Memory:
    """`memory` with its banks replaced (empty banks dropped, sorted by agent name)."""
    items = tuple(sorted((a, es) for a, es in banks.items() if es))
    return dataclasses.replace(memory, banks=items, **changes)


def save(memory: Memory, path: str | os.PathLike) -> None:
    """Writes `memory` to `path` as indented JSON (creates the parent directory)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(memory.to_json() + "\n")


def load(path: str | os.PathLike) -> Memory:
    """The memory saved at `path` by `save`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise JmarlError(f"memory file not found: {path}")
    with open(path, encoding="utf-8") as f:
        return Memory.from_json(f.read())


# ---------------------------------------------------------------- threshold and score math


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


def check_group_size(options: MemoryOptions, group_size: int) -> None:
    """Warns (`MemoryGroupSizeWarning`) when node groups of `group_size` alternatives can never
    admit or evict anything under `options` (z, ddof): training still works, the memory stays
    empty. For the learner side to call when the memory is on."""
    need = min_group_size_for_memory(options.z, options.ddof)
    if group_size < need:
        warnings.warn(
            f"JoyAgents-R1 memory: the group size G = {group_size} is too small for the memory: "
            f"one sample of a group of G is at most (G - 1) / sqrt(G) standard deviations (ddof "
            f"{options.ddof}) from the mean, so with z = {options.z} nothing could ever be "
            f"admitted or evicted; set workflow.group_size >= {need}, lower the memory's z, or "
            "turn the memory off",
            MemoryGroupSizeWarning,
            stacklevel=2,
        )


def _group_stats(
    rewards: Any, groups: Any, num_groups: int, ddof: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rewards f64[N], segment int[N] (rows outside 0..num_groups-1 -> num_groups), and per
    segment f64[num_groups + 1]: count, mean, std with `ddof` (NaN where count <= ddof), and
    whether the group can have outliers (>= 2 members, sigma defined, max > min)).

    Rewards are rounded to float32 first (the precision rewards have on the device), so totals
    that differ only by float64 rounding noise count as equal rather than as a huge z-score."""
    r = np.asarray(rewards, np.float32).astype(np.float64).reshape(-1)
    g = np.asarray(groups).reshape(-1).astype(np.int64)
    if r.shape != g.shape:
        raise JmarlError(f"memory: {r.size} rewards but {g.size} group ids")
    valid = (g >= 0) & (g < num_groups)
    seg = np.where(valid, g, num_groups)
    n_seg = num_groups + 1
    count = np.bincount(seg, weights=valid.astype(np.float64), minlength=n_seg)
    total = np.bincount(seg, weights=np.where(valid, r, 0.0), minlength=n_seg)
    mean = total / np.maximum(count, 1.0)
    sq_dev = np.bincount(seg, weights=np.where(valid, (r - mean[seg]) ** 2, 0.0), minlength=n_seg)
    defined = count > ddof
    std = np.full(n_seg, np.nan)
    std[defined] = np.sqrt(sq_dev[defined] / (count[defined] - ddof))
    high = np.full(n_seg, -np.inf)
    low = np.full(n_seg, np.inf)
    np.maximum.at(high, seg[valid], r[valid])
    np.minimum.at(low, seg[valid], r[valid])
    spread = defined & (count >= 2) & (high > low)
    spread[num_groups] = False  # rows outside every group
    return r, seg, count, mean, std, spread


def memory_thresholds(
    rewards: Any, groups: Any, *, num_groups: int, z: float = 1.96, ddof: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (upper, lower) thresholds f64[N] = mu_g +- z * sigma_g of the sample's group
    (rewards f[N], group ids int[N] in 0..num_groups-1; sigma with `ddof`). A row outside every
    group, or in a group with at most `ddof` members (no sigma), gets (inf, -inf)."""
    _, seg, _, mean, std, _ = _group_stats(rewards, groups, num_groups, ddof)
    mu, sigma = mean[seg], std[seg]
    known = np.isfinite(sigma) & (seg < num_groups)
    upper = np.where(known, mu + z * np.where(known, sigma, 0.0), np.inf)
    lower = np.where(known, mu - z * np.where(known, sigma, 0.0), -np.inf)
    return upper, lower


def admission_mask(
    rewards: Any, groups: Any, *, num_groups: int, z: float = 1.96, ddof: int = 1
) -> np.ndarray:
    """bool[N]: samples whose reward is above mu + z * sigma of their group (admitted to the
    memory); only in groups with >= 2 members, a defined sigma and max > min."""
    r, seg, _, _, _, spread = _group_stats(rewards, groups, num_groups, ddof)
    upper, _ = memory_thresholds(r, groups, num_groups=num_groups, z=z, ddof=ddof)
    return spread[seg] & (r > upper)


def eviction_mask(
    rewards: Any, groups: Any, *, num_groups: int, z: float = 1.96, ddof: int = 1
) -> np.ndarray:
    """bool[N]: samples whose reward is below mu - z * sigma of their group (the entries
    retrieved into their prompt are evicted); same groups as `admission_mask`."""
    r, seg, _, _, _, spread = _group_stats(rewards, groups, num_groups, ddof)
    _, lower = memory_thresholds(r, groups, num_groups=num_groups, z=z, ddof=ddof)
    return spread[seg] & (r < lower)


def entry_score(
    age: Any,
    reward_gap: Any,
    *,
    tau: float = 10.0,
    time_weight: float = 1.0,
    reward_weight: float = 1.0,
) -> np.ndarray:
    """Entry score f64[E] = time_weight * exp(-age / tau) + reward_weight * reward_gap, for
    ages f[E] in steps and reward gaps f[E] (the entry's reward minus its group mean)."""
    age = np.asarray(age, np.float64)
    return time_weight * np.exp(-age / tau) + reward_weight * np.asarray(reward_gap, np.float64)


# ---------------------------------------------------------------- scoring and retrieval


def entry_scores(memory: Memory, agent: str, now: int) -> np.ndarray:
    """f64[E] per entry of `agent`: time_weight * exp(-(now - step) / tau)
    + reward_weight * (reward - baseline) (`entry_score`)."""
    opts = memory.options
    es = memory.entries(agent)
    if not es:
        return np.zeros((0,), np.float64)
    age = np.array([now - e.step for e in es], np.float64)
    gap = np.array([e.reward - e.baseline for e in es], np.float64)
    return entry_score(
        age, gap, tau=opts.tau, time_weight=opts.time_weight, reward_weight=opts.reward_weight
    )


def ngram_counts(text: str, n: int = 3) -> Counter:
    """Counts of the character n-grams of `text` lower-cased with whitespace runs collapsed
    (a text shorter than n is its own single gram)."""
    norm = re.sub(r"\s+", " ", text.lower()).strip()
    if not norm:
        return Counter()
    if len(norm) < n:
        return Counter([norm])
    return Counter(norm[i : i + n] for i in range(len(norm) - n + 1))


def similarity(a: str, b: str, n: int = 3) -> float:
    """Cosine similarity in [0, 1] of the character n-gram counts of a and b (0 if one is empty)."""
    ca, cb = ngram_counts(a, n), ngram_counts(b, n)
    if not ca or not cb:
        return 0.0
    dot = sum(count * cb[gram] for gram, count in ca.items())
    norm = math.sqrt(sum(c * c for c in ca.values()) * sum(c * c for c in cb.values()))
    return dot / norm


def retrieve(memory: Memory, agent: str, query: str) -> tuple[MemoryEntry, ...]:
    """The up to `top_m` entries of `agent` most similar to `query` (similarity >
    `min_similarity`), most similar first; ties: larger reward - baseline, then lower id."""
    opts = memory.options
    scored = [(similarity(query, e.query, opts.ngram), e) for e in memory.entries(agent)]
    scored = [(s, e) for s, e in scored if s > opts.min_similarity]
    scored.sort(key=lambda se: (-se[0], -(se[1].reward - se[1].baseline), se[1].id))
    return tuple(e for _, e in scored[: opts.top_m])


def format_entry(entry: MemoryEntry, query_limit: int = 120, strategy_limit: int = 300) -> str:
    """The line an entry shows in a prompt: "query: ... | strategy: ..." (whitespace collapsed,
    each part clipped to its limit with "...")."""
    query, strategy = _clip(entry.query, query_limit), _clip(entry.strategy, strategy_limit)
    return f"query: {query} | strategy: {strategy}"


def _clip(text: str, limit: int) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def with_memory_context(state: Any, agent: str, texts: Sequence[str]) -> Any:
    """`state` with `memory_context[agent] = texts` if the state has a `memory_context` field
    (the other agents' entries kept); the state itself otherwise."""
    if not dataclasses.is_dataclass(state) or "memory_context" not in {
        f.name for f in dataclasses.fields(state)
    }:
        return state
    context = dict(getattr(state, "memory_context") or {})
    context[agent] = tuple(texts)
    return dataclasses.replace(state, memory_context=context)


# ---------------------------------------------------------------- immutable updates


def admit(
    memory: Memory,
    agent: str,
    query: str,
    strategy: str,
    *,
    reward: float,
    baseline: float,
    step: int,
) -> Memory:
    """A new memory with (query, strategy) added to `agent`'s entries (no-op if that exact pair
    is already there); past `capacity` the lowest-scoring entries at `step` are dropped (ties:
    the older first), which may be the new entry itself."""
    es = memory.entries(agent)
    if any(e.query == query and e.strategy == strategy for e in es):
        return memory
    new = MemoryEntry(memory.next_id, query, strategy, float(reward), float(baseline), int(step))
    es = es + (new,)
    banks = dict(memory.banks)
    banks[agent] = es
    grown = _with_banks(memory, banks, next_id=memory.next_id + 1)
    if len(es) <= memory.options.capacity:
        return grown
    score = entry_scores(grown, agent, step)
    ids = np.array([e.id for e in es])
    order = np.lexsort((ids, score))  # worst first: lowest score, then the older (lower id)
    drop = set(ids[order[: len(es) - memory.options.capacity]].tolist())
    banks[agent] = tuple(e for e in es if e.id not in drop)
    return _with_banks(memory, banks, next_id=memory.next_id + 1)


def evict(memory: Memory, agent: str, ids: Iterable[int]) -> Memory:
    """A new memory without `agent`'s entries whose id is in `ids` (unknown ids are ignored:
    an entry may already have been evicted this step)."""
    drop = {int(i) for i in ids}
    banks = dict(memory.banks)
    banks[agent] = tuple(e for e in memory.entries(agent) if e.id not in drop)
    return _with_banks(memory, banks)


def mark_used(memory: Memory, agent: str, ids: Iterable[int]) -> Memory:
    """A new memory with `uses` of `agent`'s entries increased once per occurrence in `ids`."""
    counts = Counter(int(i) for i in ids)
    banks = dict(memory.banks)
    banks[agent] = tuple(
        dataclasses.replace(e, uses=e.uses + counts[e.id]) if counts[e.id] else e
        for e in memory.entries(agent)
    )
    return _with_banks(memory, banks)


def group_thresholds(rewards: Sequence[float], z: float, ddof: int) -> tuple[float, float]:
    """(mu + z * sigma, mu - z * sigma) of one group's rewards f[G] (`memory_thresholds`);
    (inf, -inf) if sigma is 0 or undefined."""
    r = np.asarray(rewards, np.float64).reshape(-1)
    if r.size <= ddof or r.size < 2 or r.max() == r.min():
        return math.inf, -math.inf
    upper, lower = memory_thresholds(r, np.zeros(r.shape, np.int64), num_groups=1, z=z, ddof=ddof)
    return float(upper[0]), float(lower[0])


def _outliers(groups: Sequence[Any], z: float, ddof: int) -> tuple[np.ndarray, np.ndarray]:
    """(admit, evict) bool[sum of group sizes] over every node group's rewards, concatenated
    (`admission_mask` / `eviction_mask`, one call each for the whole step; a group too small
    for its ddof has no sigma: it neither admits nor evicts)."""
    rewards = np.concatenate([np.asarray(g.rewards, np.float64).reshape(-1) for g in groups])
    ids = np.concatenate([np.full(len(g.rewards), i, np.int64) for i, g in enumerate(groups)])
    n = len(groups)
    up = admission_mask(rewards, ids, num_groups=n, z=z, ddof=ddof)
    down = eviction_mask(rewards, ids, num_groups=n, z=z, ddof=ddof)
    return up, down


def update_memory(memory: Memory, plan_result: PlanResult, step: int) -> Memory:
    """The memory after one `node_wise` step: uses, eviction, then admission (module docstring).

    Reads `plan_result.stats.node_groups` (a `node_wise.NodeWiseStats`: every `NodeGroup` of
    the step: agent_name, query, texts, rewards f[G], memory_ids of the entries retrieved into
    its prompt).
    """
    # read by field name: node_wise imports this module, so its NodeWiseStats cannot be imported here
    groups = getattr(plan_result.stats, "node_groups", None)
    if groups is None:
        raise JmarlError(
            "update_memory needs the node groups of a node_wise plan result "
            f"(NodeWiseStats.node_groups); this result's stats are {type(plan_result.stats).__name__}"
        )
    opts = memory.options
    for g in groups:
        memory = mark_used(memory, g.agent_name, g.memory_ids)
    if not groups:
        return memory
    admitted, evicting = _outliers(groups, opts.z, opts.ddof)
    starts = np.cumsum([0] + [len(g.rewards) for g in groups])
    for i, g in enumerate(groups):
        if evicting[starts[i] : starts[i + 1]].any():
            memory = evict(memory, g.agent_name, g.memory_ids)
    for i, g in enumerate(groups):
        mu = float(np.mean(g.rewards))
        for text, r, up in zip(g.texts, g.rewards, admitted[starts[i] : starts[i + 1]]):
            if up:
                memory = admit(
                    memory, g.agent_name, g.query, text, reward=r, baseline=mu, step=step
                )
    return memory


def demonstration_memory(env: Any, seeds: Sequence[int], options: MemoryOptions | None = None) -> Memory:
    """A memory of expert strategies: for every agent step of one expert episode per seed
    (`expert_demonstrations`), an entry of that agent with the step's prompt as its query and the
    expert's text as its strategy (reward 1, baseline 0, step 0); `options` default
    `MemoryOptions()`, whose capacity may drop the earliest entries."""
    memory = Memory(options or MemoryOptions())
    for agent, prompt, text in expert_demonstrations(env, seeds, range(len(env.agents))):
        memory = admit(memory, env.agents[agent], prompt, text, reward=1.0, baseline=0.0, step=0)
    return memory


# ---------------------------------------------------------------- evaluating with a memory


@dataclass(frozen=True)
class MemoryPromptEnv:
    """`env` whose prompts carry each agent's retrieved memory entries, exactly as the
    `node_wise` plan shows them in training (query: the prompt without memory); every other
    attribute and method is `env`'s. Lets any plan (e.g. the trainer's evaluation) act with a
    learned memory, read-only."""

    env: Any
    memory: Memory

    def observe(self, state: Any, agent: str) -> str:
        """The agent's prompt with its retrieved entries injected (`with_memory_context`)."""
        query = self.env.observe(with_memory_context(state, agent, ()), agent)
        entries = retrieve(self.memory, agent, query)
        return self.env.observe(with_memory_context(state, agent, [format_entry(e) for e in entries]), agent)

    def __getattr__(self, name: str) -> Any:
        if name in ("env", "memory"):  # not set yet (copy / unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.env, name)

