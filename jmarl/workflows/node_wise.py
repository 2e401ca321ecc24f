"""`node_wise` (JoyAgents-R1): one base trajectory, G alternatives at each of its agent nodes.

Used by JoyAgents-R1 on hierarchical envs (e.g. Router: the master routes, a sub-agent acts,
the master composes). The paper publishes the recipe only; this realisation is jmarl's own.
The env must be sequential (`parallel=False`); an env with `is_active(state, agent)` (Router)
has its inactive agents skipped: they are not nodes and are never sampled.

Base trajectory. Per task seed one episode with one completion per active (turn, agent) node,
drawn by `options.base_sampler` if given (e.g. the trainer's greedy sampler) else by the plan's
sampler. Turn semantics are those of the env protocol (`end_turn` after each turn, stop at
`env.done` or `max_turns`).

Alternatives. For every base node v, G completions are sampled from v's prompt (one request
with n = G: byte-identical prompts) and each continues its own copy of the state before v
(immutable states). Every other node keeps its base action, except downstream nodes whose
input changed: at each later decision point (turn, agent) the branch observes its prompt; if
the base trajectory has a node at (turn, agent) with that identical prompt, the base action is
reused, otherwise the node is re-run (one completion from the node's policy, drawn like the
base trajectory: by `base_sampler` if given). The reward of an alternative is its episode's total,
`sum over steps of team_weight * team_reward + local_weight * local_reward` (defaults 1, 1;
for Router that is accuracy + format - cost), prefix before v included.

Groups and selection. Each base node's G alternatives form one group. Groups are ranked by
the variance of their rewards (population variance; all groups have G members, so any ddof
ranks the same) and only the top `top_k` (default 2; ties: the earlier node) produce records:
per task (`top_k_scope="task"`, default) or over the whole batch ("batch"). Every group,
dropped ones included, is reported in `stats.node_groups` (`NodeGroup`: rewards, variance,
selected, which downstream nodes were reused or re-run, retrieved memory ids). A record's
`info`: its `node`, the group's `variance`, its `reruns`, the alternative's own `local_reward`,
`team_reward` and `env_info` (the numeric entries of that step's env info).

Memory. With `options.memory` (a `jmarl.workflows.memory.Memory`) every decision point's
agent gets the top-m entries retrieved for its query (by default its prompt observed with an
empty memory context; `query_fn(env, state, agent)` overrides) injected into the state as
`memory_context[agent]` before observing. `update_memory(memory, result, step)` then applies
admission and eviction from the group rewards.

Sample count. Per task with B base nodes: generated = B (base) + G * B (alternatives) + R
(re-runs), with 0 <= R <= G * B * (B - 1) / 2 (an alternative at node i re-runs at most the
B - 1 - i later nodes; more only if it lengthens the episode). Training records: at most
K * G per task. For a master -> routed sub-agent -> master hierarchy B = 3 whatever the number
of sub-agents, so the cost grows linearly, not exponentially, with the agents on the path
(`NodeWiseStats`: num_base, num_alternatives, num_reruns, num_generated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jmarl.errors import JmarlError
from jmarl.workflows.base import (
    Completion,
    EpisodeStats,
    GroupIds,
    PlanResult,
    PlanStats,
    SampleRecord,
    Sampler,
    assert_identical_prompts,
    call_sampler,
    check_agent_policy,
    check_choice,
    input_field,
    resolve_max_turns,
    split_key,
)
from jmarl.workflows.bounds import BoundsContext, PlanBounds
from jmarl.workflows.stepping import numeric_info, step_all
from jmarl.workflows.memory import Memory, format_entry, retrieve, with_memory_context

# (env, state, agent name) -> the text memory entries are matched against
QueryFn = Callable[[Any, Any, str], str]


@dataclass(frozen=True)
class NodeWiseOptions:
    """Options of the `node_wise` plan (see the module docstring).

    group_size: G >= 1 alternatives per node (default 8: the memory's mu + 1.96 sigma
    admission needs G >= 6, see `jmarl.workflows.memory.min_group_size_for_memory` and
    `check_group_size`); top_k: groups that produce records (>= 1); top_k_scope: "task" |
    "batch"; team_weight/local_weight: reward weights; max_turns: cap (None: `env.max_turns`).
    Run inputs (metadata `{"input": True}`): base_sampler: sampler of the base trajectory and
    of re-runs (None: the plan's); memory: retrieved into prompts when given; query_fn: memory
    query (None: the prompt without memory).
    """

    group_size: int = 8
    top_k: int = 2
    top_k_scope: str = "task"
    team_weight: float = 1.0
    local_weight: float = 1.0
    max_turns: int | None = None
    base_sampler: Any = input_field(None)
    memory: Memory | None = input_field(None)
    query_fn: QueryFn | None = input_field(None)

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise JmarlError(f"node_wise: group_size must be >= 1, got {self.group_size}")
        if self.top_k < 1:
            raise JmarlError(f"node_wise: top_k must be >= 1, got {self.top_k}")
        if self.max_turns is not None and self.max_turns < 1:
            raise JmarlError(f"node_wise: max_turns must be >= 1 or None, got {self.max_turns}")
        check_choice("node_wise.top_k_scope", self.top_k_scope, ("task", "batch"))


@dataclass(frozen=True)
class NodeGroup:
    """The G alternatives at one base node (reported whether selected or not).

    task/seed: the task; node: index of the node on the base trajectory; turn, agent (index
    into env.agents), agent_name; prompt and query of the node; memory_ids: entries retrieved
    into the prompt; texts/rewards: the G alternatives and their episode totals; downstream:
    per alternative, ((turn, agent name, "reused" | "rerun"), ...) for the nodes after v;
    mean/variance of the rewards; selected: among the top-K; group: its record group id
    (None if dropped).
    """

    task: int
    seed: int
    node: int
    turn: int
    agent: int
    agent_name: str
    prompt: str
    query: str
    memory_ids: tuple[int, ...]
    texts: tuple[str, ...]
    rewards: tuple[float, ...]
    downstream: tuple[tuple[tuple[int, str, str], ...], ...]
    mean: float
    variance: float
    selected: bool
    group: int | None


@dataclass(frozen=True, kw_only=True)
class NodeWiseStats(PlanStats):
    """The `node_wise` plan's step report (`PlanStats` plus the fields below).

    num_generated: num_base + num_alternatives + num_reruns; num_base: completions of the base
    trajectories (one per active node); num_alternatives: G per base node; num_reruns:
    downstream nodes re-run because an alternative changed their prompt; num_groups: node
    groups (one per base node); num_selected: those among the top-K that produce records;
    node_groups: every `NodeGroup`, dropped ones included (what `memory.update_memory` reads).
    """

    num_base: int
    num_alternatives: int
    num_reruns: int
    num_groups: int
    num_selected: int
    node_groups: tuple[NodeGroup, ...]


@dataclass(frozen=True)
class _Decision:
    """A decision point: the agent about to act, the state it acts on (memory injected), its
    prompt, its memory query and the retrieved entry ids."""

    agent: int
    state: Any
    prompt: str
    query: str
    memory_ids: tuple[int, ...]


@dataclass(frozen=True)
class _Played:
    """A node played on a branch: where (turn, position, state before observing), what was
    observed and done, how (base | alt | reused | rerun) and what it earned."""

    turn: int
    pos: int
    state_at: Any
    total_before: float
    decision: _Decision
    completion: Completion
    kind: str
    local_reward: float
    team_reward: float
    env_info: dict[str, float]


@dataclass
class _Branch:
    """One episode being played (host bookkeeping): the running state, turn and position in
    `turn_order`, the action forced at the next decision (an alternative), the base nodes by
    (turn, agent) (None for a base trajectory), the nodes played and the reward total."""

    task: int
    seed: int
    state: Any
    turn: int
    pos: int
    total: float
    forced: Completion | None = None
    base: dict[tuple[int, int], _Played] | None = None
    nodes: list[_Played] = field(default_factory=list)
    done: bool = False


def node_wise_bounds(options: NodeWiseOptions, ctx: BoundsContext) -> PlanBounds:
    """Rows top_k x G per policy (x E with top_k_scope task), G per prompt; calls: the G
    alternatives of every node (E x T x a x G) and one policy's re-runs (E x T x n x G, one
    prompt each)."""
    e, g, turns, ids = ctx.num_tasks, options.group_size, ctx.turns, ctx.policy_ids
    rows = (e if options.top_k_scope == "task" else 1) * options.top_k * g
    calls = ((tuple(e * turns * ctx.agents_of(p) * g for p in ids), g),)
    calls += tuple((tuple(e * turns * ctx.num_agents * g if q == p else 0 for q in ids), 1) for p in ids)
    return PlanBounds(rows=rows, share=g, aligned=True, calls=calls)


def sample_node_wise(
    env: Any,
    seeds: Sequence[int],
    agent_policy: Sequence[int],
    sampler: Sampler,
    rng: jax.Array,
    options: NodeWiseOptions = NodeWiseOptions(),
) -> PlanResult:
    """Base trajectory + G alternatives per node per seed -> records of the top-K node groups."""
    agent_policy = check_agent_policy(env, agent_policy)
    if env.parallel:
        raise JmarlError(
            f"the node_wise plan needs a sequential env (each agent sees the earlier actions "
            f"of its turn), but env {env.name!r} is parallel; use the tree or joint plan"
        )
    max_turns = resolve_max_turns(env, options.max_turns)
    g = options.group_size
    play = _Player(env, agent_policy, max_turns, options)

    # 1. the base trajectories, all tasks in lock step
    bases = [
        _Branch(task=t, seed=int(s), state=env.reset(int(s)), turn=0, pos=0, total=0.0)
        for t, s in enumerate(seeds)
    ]
    rng, key = split_key(rng)
    base_sampler = sampler if options.base_sampler is None else options.base_sampler
    num_base = play.run(bases, base_sampler, key)

    # 2. G alternatives at every base node: one sampler call
    nodes = [(b, i, node) for b in bases for i, node in enumerate(b.nodes)]
    requests = [(agent_policy[node.decision.agent], node.decision.prompt) for _, _, node in nodes]
    rng, key = split_key(rng)
    alternatives = call_sampler(sampler, requests, g, key)

    # 3. every alternative continues its own branch; changed downstream nodes are re-run
    branches = []
    for (base, _, node), completions in zip(nodes, alternatives):
        by_key = {(n.turn, n.decision.agent): n for n in base.nodes}
        for c in completions:
            branches.append(
                _Branch(task=base.task, seed=base.seed, state=node.state_at, turn=node.turn,
                        pos=node.pos, total=node.total_before, forced=c, base=by_key)
            )
    rng, key = split_key(rng)
    num_reruns = play.run(branches, base_sampler, key)

    groups = _node_groups(env, nodes, branches, g)
    selected = _select(groups, options.top_k, options.top_k_scope)
    groups, records = _records(groups, selected, branches, agent_policy, g)
    assert_identical_prompts(records)
    num_alternatives = g * len(nodes)
    stats = NodeWiseStats(
        num_base=num_base,
        num_alternatives=num_alternatives,
        num_reruns=num_reruns,
        num_generated=num_base + num_alternatives + num_reruns,
        num_groups=len(groups),
        num_selected=len(selected),
        node_groups=tuple(groups),
    )
    episodes = tuple(_episode_stats(env, b) for b in bases)
    return PlanResult(records=tuple(records), episodes=episodes, stats=stats)


class _Player:
    """Plays branches in lock step: one sampler call per round for every branch that needs a
    sampled completion (a base node, or a downstream node whose prompt changed)."""

    def __init__(
        self, env: Any, agent_policy: tuple[int, ...], max_turns: int, options: NodeWiseOptions
    ) -> None:
        self.env = env
        self.agent_policy = agent_policy
        self.max_turns = max_turns
        self.options = options
        self.agent_index = {name: i for i, name in enumerate(env.agents)}

    def run(self, branches: list[_Branch], sampler: Sampler, rng: jax.Array) -> int:
        """Plays every branch to its end (mutating them); returns the completions sampled."""
        sampled = 0
        while True:
            ready = []
            for b in branches:
                if b.done:
                    continue
                decision = self._next_decision(b)
                if decision is None:
                    b.done = True
                else:
                    ready.append((b, decision))
            if not ready:
                return sampled
            actions: list[tuple[Completion | None, str]] = []
            for b, d in ready:
                if b.forced is not None:
                    actions.append((b.forced, "alt"))
                    b.forced = None
                    continue
                base = None if b.base is None else b.base.get((b.turn, d.agent))
                if base is not None and base.decision.prompt == d.prompt:
                    actions.append((base.completion, "reused"))
                else:
                    actions.append((None, "base" if b.base is None else "rerun"))
            need = [i for i, (c, _) in enumerate(actions) if c is None]
            requests = [(self.agent_policy[ready[i][1].agent], ready[i][1].prompt) for i in need]
            rng, key = split_key(rng)
            for i, (c,) in zip(need, call_sampler(sampler, requests, 1, key)):
                actions[i] = (c, actions[i][1])
            sampled += len(need)
            stepped = step_all(
                self.env, [(d.state, self.env.agents[d.agent], c.text) for (_, d), (c, _) in zip(ready, actions)]
            )
            for (b, d), (completion, kind), result in zip(ready, actions, stepped):
                self._apply(b, d, completion, kind, result)

    def _next_decision(self, b: _Branch) -> _Decision | None:
        """Advances `b` to its next active agent (closing finished turns); None at the end."""
        env = self.env
        while True:
            if env.done(b.state):
                return None
            if b.pos == len(env.turn_order):
                b.state, b.turn, b.pos = env.end_turn(b.state), b.turn + 1, 0
                continue
            if b.turn >= self.max_turns:
                return None
            name = env.turn_order[b.pos]
            if not _is_active(env, b.state, name):
                b.pos += 1
                continue
            return self._observe(b.state, name)

    def _observe(self, state: Any, name: str) -> _Decision:
        """The decision of agent `name` in `state`, memory retrieved and injected if enabled."""
        env, opts = self.env, self.options
        if opts.query_fn is not None:
            query = str(opts.query_fn(env, state, name))
        else:
            query = env.observe(with_memory_context(state, name, ()), name)
        ids: tuple[int, ...] = ()
        if opts.memory is not None:
            entries = retrieve(opts.memory, name, query)
            ids = tuple(e.id for e in entries)
            state = with_memory_context(state, name, [format_entry(e) for e in entries])
        return _Decision(self.agent_index[name], state, env.observe(state, name), query, ids)

    def _apply(
        self, b: _Branch, d: _Decision, completion: Completion, kind: str, result: tuple[Any, Any]
    ) -> None:
        """Advances `b` by the step `result` (state, StepResult) of the agent's completion
        (stepped by the caller, with every other branch of the round) and records the node."""
        opts = self.options
        state_at, total_before = b.state, b.total
        b.state, res = result
        b.total += opts.team_weight * float(res.team_reward) + opts.local_weight * float(
            res.local_reward
        )
        b.nodes.append(
            _Played(
                turn=b.turn,
                pos=b.pos,
                state_at=state_at,
                total_before=total_before,
                decision=d,
                completion=completion,
                kind=kind,
                local_reward=float(res.local_reward),
                team_reward=float(res.team_reward),
                env_info=numeric_info(res.info),
            )
        )
        b.pos += 1


def _is_active(env: Any, state: Any, agent: str) -> bool:
    """`env.is_active(state, agent)` where the env defines it (Router), else True."""
    fn = getattr(env, "is_active", None)
    return True if fn is None else bool(fn(state, agent))


def _node_groups(
    env: Any, nodes: list[tuple[_Branch, int, _Played]], branches: list[_Branch], g: int
) -> list[NodeGroup]:
    """One `NodeGroup` per base node from its G finished alternative branches (unselected)."""
    groups = []
    for n, (base, i, node) in enumerate(nodes):
        alts = branches[n * g : (n + 1) * g]
        rewards = tuple(float(b.total) for b in alts)
        downstream = tuple(
            tuple((p.turn, env.agents[p.decision.agent], p.kind) for p in b.nodes[1:])
            for b in alts
        )
        groups.append(
            NodeGroup(
                task=base.task,
                seed=base.seed,
                node=i,
                turn=node.turn,
                agent=node.decision.agent,
                agent_name=env.agents[node.decision.agent],
                prompt=node.decision.prompt,
                query=node.decision.query,
                memory_ids=node.decision.memory_ids,
                texts=tuple(b.nodes[0].completion.text for b in alts),
                rewards=rewards,
                downstream=downstream,
                mean=float(np.mean(rewards)),
                variance=order_free_variance(rewards),
                selected=False,
                group=None,
            )
        )
    return groups


def order_free_variance(rewards: Sequence[float]) -> float:
    """Population variance of `rewards`, sum (n r - S)^2 / n^3 with S and the outer sum by
    `math.fsum` (correctly rounded): the same value in every order of the rewards, so two groups
    holding the same rewards tie exactly and the tie rule, not rounding, decides between them."""
    n = len(rewards)
    if n == 0:
        return 0.0
    total = math.fsum(rewards)
    return math.fsum((n * r - total) ** 2 for r in rewards) / n**3


def _select(groups: list[NodeGroup], top_k: int, scope: str) -> set[int]:
    """Indices of the top-K groups by reward variance (ties: earlier task, then earlier node;
    `order_free_variance` makes equal rewards in any order a tie)."""
    order = sorted(range(len(groups)), key=lambda i: (-groups[i].variance, groups[i].task,
                                                      groups[i].node))
    if scope == "batch":
        return set(order[:top_k])
    chosen: set[int] = set()
    taken: dict[int, int] = {}
    for i in order:
        task = groups[i].task
        if taken.get(task, 0) < top_k:
            chosen.add(i)
            taken[task] = taken.get(task, 0) + 1
    return chosen


def _records(
    groups: list[NodeGroup],
    selected: set[int],
    branches: list[_Branch],
    agent_policy: tuple[int, ...],
    g: int,
) -> tuple[list[NodeGroup], list[SampleRecord]]:
    """G records per selected group (group ids contiguous in node order), and every group with
    `selected`/`group` filled in."""
    group_ids = GroupIds()
    records: list[SampleRecord] = []
    final_groups = []
    for gi, group in enumerate(groups):
        if gi not in selected:
            final_groups.append(group)
            continue
        gid = group_ids((group.task, group.node))
        final_groups.append(replace(group, selected=True, group=gid))
        for k in range(g):
            alt = branches[gi * g + k].nodes[0]
            records.append(
                SampleRecord(
                    prompt=group.prompt,
                    completion=alt.completion,
                    reward=group.rewards[k],
                    group=gid,
                    env=group.task,
                    turn=group.turn,
                    agent=group.agent,
                    policy=agent_policy[group.agent],
                    source_policy=agent_policy[group.agent],
                    info={
                        "node": group.node,
                        "variance": group.variance,
                        "reruns": sum(kind == "rerun" for *_, kind in group.downstream[k]),
                        "local_reward": alt.local_reward,
                        "team_reward": alt.team_reward,
                        "env_info": alt.env_info,
                    },
                )
            )
    return final_groups, records


def _episode_stats(env: Any, base: _Branch) -> EpisodeStats:
    """Stats of a base trajectory."""
    local = [0.0] * len(env.agents)
    for p in base.nodes:
        local[p.decision.agent] += p.local_reward
    return EpisodeStats(
        env=base.task,
        seed=base.seed,
        success=bool(env.success(base.state)),
        team_reward=float(sum(p.team_reward for p in base.nodes)),
        agent_rewards=tuple(local),
        num_turns=(max(p.turn for p in base.nodes) + 1) if base.nodes else 0,
    )
