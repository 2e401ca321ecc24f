"""`tree` (AT-GRPO): K candidates from one identical prompt at every (env, turn, agent) node.

Used by AT-GRPO. One episode per task seed. At every node the agent's prompt is sampled K
times (one request with n=K, so the K prompts are byte-identical; this is asserted). Each
candidate is applied to its own copy of the running state (`env.step` on the same immutable
parent state) and scored: `score = local_reward + alpha * team_reward` of that step (alpha
default 1). The best candidate continues the episode ("best": highest score, the first on ties;
"sampled": drawn with probability softmax(score / temperature) using the plan's rng; "first":
candidate 0). Turn order follows `env.parallel` (see `jmarl.workflows.episodes`): sequential
agents see this turn's earlier actions; parallel agents all observe the turn-start state and
their chosen actions are applied in turn order, each agent's K candidates scored on their own
branches of the state after the earlier agents' chosen actions. The episode ends when
`env.done(state)` or after `max_turns` turns. Samples go to the policy of their agent.

Reward. `reward_mode="immediate"` (default): the candidate's own score. "return_to_go": its
score plus the discounted scores of the chosen candidates at every later node of the path,
`gamma ** (t' - t)` per turn of distance (`return_scope="path"`: all agents' later nodes,
the team's return; "agent": only the same agent's later nodes).

Groups. One group per (task index, turn, agent): the K candidates of one node. Ids come from
that key (never from a prompt or env object), so tasks with equal seeds never merge.

Sample count. E tasks, n agents, T turns: K * (nodes played) <= E * T * n * K samples, in
E * T * n groups of exactly K when no episode ends early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax

from jmarl.errors import JmarlError
from jmarl.workflows.base import (
    GroupIds,
    PlanResult,
    PlanStats,
    SampleRecord,
    Sampler,
    assert_identical_prompts,
    check_agent_policy,
    check_choice,
    resolve_max_turns,
)
from jmarl.workflows.bounds import BoundsContext, PlanBounds
from jmarl.workflows.episodes import (
    EpisodeTrace,
    choose_best,
    choose_first,
    choose_sampled,
    run_episodes,
)
from jmarl.workflows.independent import episode_stats
from jmarl.workflows.stepping import numeric_info


@dataclass(frozen=True)
class TreeOptions:
    """Options of the `tree` plan (see the module docstring).

    group_size: K >= 1 candidates per node; alpha: weight of the team reward in a candidate's score;
    select: "best" | "sampled" | "first"; select_temperature: softmax temperature of
    "sampled"; reward_mode: "immediate" | "return_to_go"; gamma: per-turn discount of the
    return-to-go; return_scope: "path" | "agent"; max_turns: cap (None: `env.max_turns`).
    """

    group_size: int = 4
    alpha: float = 1.0
    select: str = "best"
    select_temperature: float = 1.0
    reward_mode: str = "immediate"
    gamma: float = 1.0
    return_scope: str = "path"
    max_turns: int | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise JmarlError(f"tree: group_size must be >= 1, got {self.group_size}")
        if self.select_temperature <= 0:
            raise JmarlError(f"tree: select_temperature must be > 0, got {self.select_temperature}")
        if self.max_turns is not None and self.max_turns < 1:
            raise JmarlError(f"tree: max_turns must be >= 1 or None, got {self.max_turns}")
        check_choice("tree.select", self.select, ("best", "sampled", "first"))
        check_choice("tree.reward_mode", self.reward_mode, ("immediate", "return_to_go"))
        check_choice("tree.return_scope", self.return_scope, ("path", "agent"))


def tree_bounds(options: TreeOptions, ctx: BoundsContext) -> PlanBounds:
    """Rows E x T x K x a per policy, K per node (a node's candidates); one call per acting agent
    of E x K rows (a parallel env: E x a x K)."""
    e, k = ctx.num_tasks, options.group_size
    return PlanBounds(rows=e * ctx.turns * k * ctx.max_agents, share=k, aligned=True,
                      calls=ctx.per_agent_calls(e * k, k))


def sample_tree(
    env: Any,
    seeds: Sequence[int],
    agent_policy: Sequence[int],
    sampler: Sampler,
    rng: jax.Array,
    options: TreeOptions = TreeOptions(),
) -> PlanResult:
    """One tree-sampled episode per seed -> K records per node and one `EpisodeStats` per seed."""
    agent_policy = check_agent_policy(env, agent_policy)
    choose = {
        "best": choose_best,
        "first": choose_first,
        "sampled": choose_sampled(options.select_temperature),
    }[options.select]
    traces = run_episodes(
        env,
        [(t, int(s)) for t, s in enumerate(seeds)],
        agent_policy,
        sampler,
        rng,
        num_candidates=options.group_size,
        score=lambda res: float(res.local_reward) + options.alpha * float(res.team_reward),
        choose=choose,
        max_turns=resolve_max_turns(env, options.max_turns),
    )
    groups = GroupIds()
    records: list[SampleRecord] = []
    for trace in traces:
        future = _future_returns(trace, options)
        for i, node in enumerate(trace.nodes):
            group = groups((trace.task, node.turn, node.agent))
            for k, (completion, res) in enumerate(zip(node.candidates, node.results)):
                records.append(
                    SampleRecord(
                        prompt=node.prompt,
                        completion=completion,
                        reward=node.scores[k] + future[i],
                        group=group,
                        env=trace.task,
                        turn=node.turn,
                        agent=node.agent,
                        policy=agent_policy[node.agent],
                        source_policy=agent_policy[node.agent],
                        info={
                            "score": node.scores[k],
                            "local_reward": float(res.local_reward),
                            "team_reward": float(res.team_reward),
                            "chosen": k == node.chosen,
                            "env_info": numeric_info(res.info),
                        },
                    )
                )
    assert_identical_prompts(records)
    episodes = tuple(episode_stats(env, trace) for trace in traces)
    # every candidate of every node is a record: one record per sampled completion
    return PlanResult(records=tuple(records), episodes=episodes, stats=PlanStats(num_generated=len(records)))


def _future_returns(trace: EpisodeTrace, options: TreeOptions) -> list[float]:
    """Per node i: the discounted sum of the chosen scores of the later nodes (0 if immediate)."""
    nodes = trace.nodes
    if options.reward_mode == "immediate":
        return [0.0] * len(nodes)
    out = []
    for i, node in enumerate(nodes):
        total = 0.0
        for later in nodes[i + 1 :]:
            if options.return_scope == "agent" and later.agent != node.agent:
                continue
            total += options.gamma ** (later.turn - node.turn) * later.scores[later.chosen]
        out.append(total)
    return out
