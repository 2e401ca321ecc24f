"""`joint` (MAGRPO): G completions per agent per node, joint actions, a tree over turns.

Used by MAGRPO (and its MAREINFORCE/MAReMax/MARLOO baselines, which differ only in the
advantage). The agents of a turn act simultaneously (a Dec-POMDP): at a node every agent
observes the node's state, so the env must be `parallel`.

Node. For each task seed the root node holds `env.reset(seed)`. At a node each agent k samples
G completions from its own prompt (one request with n=G: the G prompts are byte-identical).
Joint actions: `aligned` (default) pairs the g-th completion of every agent (G joint actions);
`cross` takes the Cartesian product (G**n joint actions). The env's joint reward is computed
once per joint action, on a copy of the node state: the agents' actions are applied in
`turn_order` (stopping early if the env is done), then `end_turn`; the reward of agent k is
`(sum of the team rewards of those steps) + local_weight * (k's local reward)` (local_weight
default 0: MAGRPO trains on the joint reward).

Tree. Every joint action at turn t whose state is not done spawns a child node at turn t + 1
whose prompts come from that state (the env's transition: the joint answer / feedback), up to
`max_turns`. Optional early stop: a node whose mean reward (over joint actions and agents)
reaches `early_stop_threshold` spawns no children. Return of joint action j at a node for
agent k: `Q[j, k] = r[j, k] + gamma * mean_j' Q_child(j)[j', k]` (just `r[j, k]` without a
child; gamma default 1.0). A completion's return is `Q` of its joint action (aligned), or the
`sum` (default, as CoMLRL) or `mean` over every joint action it appears in (cross); that
return is the sample's reward. The advantage is left to the algorithm.

Groups. One group per (node, agent): the G sibling completions of one agent at one node.
A record's `info`: its `node`, `immediate_reward` (the reward before the children's returns,
aggregated like the return) and `env_info` (the numeric entries of the agent's own step info,
each the mean over the joint actions the completion took part in).
Episode stats: one `EpisodeStats` per leaf joint action (a root-to-leaf path).

Sample count. E tasks, n agents, T turns, branching B = G (aligned) or G**n (cross), nothing
stopping early: nodes = E * (1 + B + ... + B**(T-1)), samples = n * G * nodes, groups =
n * nodes. E.g. aligned G=4, n=2, T=2: 40 samples per task; cross: 8 * 17 = 136. A plan whose
upper bound exceeds `max_samples` raises before sampling.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

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
    resolve_max_turns,
    split_key,
)
from jmarl.workflows.bounds import BoundsContext, PlanBounds
from jmarl.workflows.stepping import numeric_info, step_all


@dataclass(frozen=True)
class JointOptions:
    """Options of the `joint` plan (see the module docstring).

    group_size: G >= 1 completions per agent per node; joint_mode: "aligned" | "cross";
    cross_aggregate: "sum" | "mean" (how a completion's return aggregates over its joint
    actions in cross mode); gamma: discount of the children's mean return; local_weight:
    weight of an agent's local reward in its reward; early_stop_threshold: a node whose mean
    reward is >= it has no children (None: never); max_turns: cap (None: `env.max_turns`);
    max_samples: refuse plans whose sample count could exceed it.
    """

    group_size: int = 4
    joint_mode: str = "aligned"
    cross_aggregate: str = "sum"
    gamma: float = 1.0
    local_weight: float = 0.0
    early_stop_threshold: float | None = None
    max_turns: int | None = None
    max_samples: int = 65536

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise JmarlError(f"joint: group_size must be >= 1, got {self.group_size}")
        if self.max_turns is not None and self.max_turns < 1:
            raise JmarlError(f"joint: max_turns must be >= 1 or None, got {self.max_turns}")
        check_choice("joint.joint_mode", self.joint_mode, ("aligned", "cross"))
        check_choice("joint.cross_aggregate", self.cross_aggregate, ("sum", "mean"))


@dataclass
class _Node:
    """One node of the joint tree (host bookkeeping; filled in as the plan proceeds).

    rewards/returns are f64[J, A] over joint actions and agent indices; children[j] is the node
    id of joint action j's child or None; outcomes[j] is joint action j's (state after it, team
    reward, local rewards per agent); step_info[j] maps each agent index that stepped in joint
    action j to the numeric entries of its step's info (`numeric_info`).
    """

    task: int
    seed: int
    turn: int
    state: Any
    team_before: float
    local_before: tuple[float, ...]
    prompts: dict[int, str] = field(default_factory=dict)
    completions: dict[int, list[Completion]] = field(default_factory=dict)
    joint: list[tuple[int, ...]] = field(default_factory=list)
    rewards: np.ndarray | None = None
    returns: np.ndarray | None = None
    children: list[int | None] = field(default_factory=list)
    outcomes: list[tuple[Any, float, list[float]]] = field(default_factory=list)
    step_info: list[dict[int, dict[str, float]]] = field(default_factory=list)


def joint_sample_bound(
    num_tasks: int, num_agents: int, group_size: int, turns: int, joint_mode: str
) -> int:
    """Samples of a full joint tree: n * G * E * sum_{t<T} B**t with B = G or G**n."""
    branching = group_size if joint_mode == "aligned" else group_size**num_agents
    nodes_per_task = sum(branching**t for t in range(turns))
    return num_tasks * num_agents * group_size * nodes_per_task


def joint_bounds(options: JointOptions, ctx: BoundsContext) -> PlanBounds:
    """Rows E x G x a x (1 + B + .. + B^(T-1)) per policy (B = G aligned, G^n cross), G per
    prompt; the largest call is the last turn's frontier, E x B^(T-1) x a x G."""
    e, g, turns = ctx.num_tasks, options.group_size, ctx.turns
    branching = g if options.joint_mode == "aligned" else g**ctx.num_agents
    nodes = sum(branching**t for t in range(turns))
    frontier = e * branching ** (turns - 1)
    calls = ((tuple(frontier * ctx.agents_of(p) * g for p in ctx.policy_ids), g),)
    return PlanBounds(rows=e * g * ctx.max_agents * nodes, share=g, aligned=True, calls=calls)


def sample_joint(
    env: Any,
    seeds: Sequence[int],
    agent_policy: Sequence[int],
    sampler: Sampler,
    rng: jax.Array,
    options: JointOptions = JointOptions(),
) -> PlanResult:
    """Joint-action tree per seed -> G records per (node, agent), reward = the return."""
    agent_policy = check_agent_policy(env, agent_policy)
    if not env.parallel:
        raise JmarlError(
            f"the joint plan needs an env whose agents act simultaneously, but env "
            f"{env.name!r} is sequential (parallel=False); use the tree plan or a parallel "
            "variant of the env"
        )
    max_turns = resolve_max_turns(env, options.max_turns)
    acting = [env.agents.index(a) for a in env.turn_order]
    bound = joint_sample_bound(
        len(seeds), len(acting), options.group_size, max_turns, options.joint_mode
    )
    if bound > options.max_samples:
        raise JmarlError(
            f"joint plan could produce {bound} samples (tasks={len(seeds)}, agents={len(acting)}, "
            f"G={options.group_size}, turns={max_turns}, joint_mode={options.joint_mode!r}), "
            f"more than max_samples={options.max_samples}; lower G, turns or use aligned mode"
        )

    zeros = tuple(0.0 for _ in env.agents)
    nodes = [
        _Node(task=t, seed=int(s), turn=0, state=env.reset(int(s)), team_before=0.0,
              local_before=zeros)
        for t, s in enumerate(seeds)
    ]
    frontier = [i for i, n in enumerate(nodes) if not env.done(n.state)]
    while frontier:
        rng, key = split_key(rng)
        live = [nodes[i] for i in frontier]
        _sample_frontier(env, live, acting, agent_policy, sampler, key, options)
        _play_joint(env, live, acting, options)
        next_frontier = []
        for i in frontier:
            for child in _expand(env, nodes[i], acting, options, max_turns):
                if child is None:
                    nodes[i].children.append(None)
                    continue
                nodes.append(child)
                nodes[i].children.append(len(nodes) - 1)
                next_frontier.append(len(nodes) - 1)
        frontier = next_frontier
    _fill_returns(nodes, options.gamma)
    records = _records(nodes, acting, agent_policy, options)
    assert_identical_prompts(records)
    # every sampled node's G completions per agent are records: one per sampled completion
    return PlanResult(records=tuple(records), episodes=tuple(_leaf_stats(env, nodes)),
                      stats=PlanStats(num_generated=len(records)))


def _sample_frontier(
    env: Any,
    frontier: list[_Node],
    acting: list[int],
    agent_policy: tuple[int, ...],
    sampler: Sampler,
    rng: jax.Array,
    options: JointOptions,
) -> None:
    """One sampler call for every (node, agent) of the frontier; fills prompts and completions."""
    requests, slots = [], []
    for node in frontier:
        for a in acting:
            node.prompts[a] = env.observe(node.state, env.agents[a])
            requests.append((agent_policy[a], node.prompts[a]))
            slots.append((node, a))
    answers = call_sampler(sampler, requests, options.group_size, rng)
    for (node, a), completions in zip(slots, answers):
        node.completions[a] = completions


def _play_joint(env: Any, frontier: list[_Node], acting: list[int], options: JointOptions) -> None:
    """Fills `joint` and `outcomes` of every frontier node: each joint action is played on its
    own copy of the node's immutable state (the agents' actions in `turn_order`, stopping once
    the env is done, then `end_turn`). The joint actions of every node are stepped together,
    one agent position at a time (`step_all`)."""
    g = options.group_size
    runs = []  # [node, picks, state, team reward, local rewards, step info per agent]
    for node in frontier:
        if options.joint_mode == "aligned":
            node.joint = [(j,) * len(acting) for j in range(g)]
        else:
            node.joint = list(itertools.product(range(g), repeat=len(acting)))
        runs.extend([node, picks, node.state, 0.0, [0.0] * len(env.agents), {}] for picks in node.joint)
    for pos, a in enumerate(acting):
        live = [r for r in runs if not env.done(r[2])]
        name = env.agents[a]
        stepped = step_all(env, [(r[2], name, r[0].completions[a][r[1][pos]].text) for r in live])
        for r, (state, res) in zip(live, stepped):
            r[2] = state
            r[3] += float(res.team_reward)
            r[4][a] += float(res.local_reward)
            r[5][a] = numeric_info(res.info)
    for node in frontier:
        node.outcomes, node.step_info = [], []
    for node, _, state, team, local, info in runs:
        if not env.done(state):
            state = env.end_turn(state)
        node.outcomes.append((state, team, local))
        node.step_info.append(info)


def _expand(
    env: Any, node: _Node, acting: list[int], options: JointOptions, max_turns: int
) -> list[_Node | None]:
    """Scores every joint action of `node` (fills rewards from the outcomes `_play_joint`
    filled) and returns its children: one entry per joint action, the child node, or None
    where the branch ends (done, last turn, or early stop)."""
    outcomes = node.outcomes
    rewards = np.zeros((len(node.joint), len(env.agents)), np.float64)
    for j, (_, team, local) in enumerate(outcomes):
        rewards[j] = team + options.local_weight * np.asarray(local)
    node.rewards = rewards
    stop = (
        options.early_stop_threshold is not None
        and float(rewards[:, acting].mean()) >= options.early_stop_threshold
    )
    children: list[_Node | None] = []
    for state, team, local in outcomes:
        if stop or env.done(state) or node.turn + 1 >= max_turns:
            children.append(None)
            continue
        children.append(
            _Node(
                task=node.task,
                seed=node.seed,
                turn=node.turn + 1,
                state=state,
                team_before=node.team_before + team,
                local_before=tuple(b + x for b, x in zip(node.local_before, local)),
            )
        )
    return children


def _fill_returns(nodes: list[_Node], gamma: float) -> None:
    """Q[j, k] = r[j, k] + gamma * mean_j' Q_child(j)[j', k], children before parents."""
    for node in reversed(nodes):
        if node.rewards is None:  # a root that was done at reset: never sampled
            continue
        returns = node.rewards.copy()
        for j, child in enumerate(node.children):
            if child is not None:
                returns[j] += gamma * nodes[child].returns.mean(axis=0)
        node.returns = returns


def _records(
    nodes: list[_Node], acting: list[int], agent_policy: tuple[int, ...], options: JointOptions
) -> list[SampleRecord]:
    """G records per (node, agent); reward = the completion's (aggregated) return."""
    groups = GroupIds()
    # aligned: one joint action per completion, so sum and mean agree
    agg = np.sum if options.cross_aggregate == "sum" else np.mean
    records = []
    for node_id, node in enumerate(nodes):
        if node.rewards is None:
            continue
        for pos, a in enumerate(acting):
            group = groups((node_id, a))
            for g, completion in enumerate(node.completions[a]):
                rows = [j for j, picks in enumerate(node.joint) if picks[pos] == g]
                records.append(
                    SampleRecord(
                        prompt=node.prompts[a],
                        completion=completion,
                        reward=float(agg(node.returns[rows, a])),
                        group=group,
                        env=node.task,
                        turn=node.turn,
                        agent=a,
                        policy=agent_policy[a],
                        source_policy=agent_policy[a],
                        info={
                            "node": node_id,
                            "immediate_reward": float(agg(node.rewards[rows, a])),
                            "env_info": _mean_info([node.step_info[j].get(a, {}) for j in rows]),
                        },
                    )
                )
    return records


def _mean_info(infos: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the step infos (of a completion's joint actions) that report it."""
    keys = dict.fromkeys(k for info in infos for k in info)
    return {k: float(np.mean([info[k] for info in infos if k in info])) for k in keys}


def _leaf_stats(env: Any, nodes: list[_Node]) -> list[EpisodeStats]:
    """One `EpisodeStats` per joint action that has no child (the end of a root-to-leaf path)."""
    stats = []
    for node in nodes:
        if node.rewards is None:
            stats.append(
                EpisodeStats(
                    env=node.task,
                    seed=node.seed,
                    success=bool(env.success(node.state)),
                    team_reward=0.0,
                    agent_rewards=node.local_before,
                    num_turns=0,
                )
            )
            continue
        for child, (state, team, local) in zip(node.children, node.outcomes):
            if child is not None:
                continue
            stats.append(
                EpisodeStats(
                    env=node.task,
                    seed=node.seed,
                    success=bool(env.success(state)),
                    team_reward=node.team_before + team,
                    agent_rewards=tuple(b + x for b, x in zip(node.local_before, local)),
                    num_turns=node.turn + 1,
                )
            )
    return stats
