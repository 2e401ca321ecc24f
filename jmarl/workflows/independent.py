"""`independent`: G full episodes per task, each sampled on its own.

Used by the single-agent baselines (GRPO, Dr.GRPO, DAPO, GSPO with one agent), by MAGRPO's
aligned single-turn setting, and as the "parallel sampling" ablation of AT-GRPO on
multi-agent envs.

Episodes. For every task seed, `group_size` (G) episodes are played to the end
(`env.done` or `max_turns`) with one completion per (episode, turn, agent) node; the loop and
its sequential/parallel turn semantics are those of `jmarl.workflows.episodes`. The G
episodes of a task are sampled independently: at turn 0 the sampler receives G copies of the
same request.

Reward. Every sample of agent a in an episode gets that episode's return for a:
`team_weight * (sum of the team rewards of all steps) + local_weight * (sum of a's own local
rewards)` (defaults 1 and 1).
A record's `info`: the step's `local_reward`, `team_reward` and `env_info` (the numeric entries
of the env's step info, e.g. Writing's reward components on the step that scores the pair).

Groups. `group_by="task_agent"` (default): one group per (task, agent), holding every sample
that agent produced in the task's G episodes, all turns. `group_by="task_turn_agent"`: one
group per (task, turn, agent). Only turn-0 prompts are identical within a group: later prompts
carry each episode's own history, so a group compares samples from different prompts. That is
exactly the weakness of the parallel-sampling ablation (it is why AT-GRPO samples a tree);
with one agent and one turn it is plain GRPO (G samples of one prompt per group).

Sample count. For E tasks, n agents, T turns: at most E * G * n * T samples, exactly
E * G * n * T when no episode ends early; groups: E * n (task_agent) or up to E * T * n.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax

from jmarl.errors import JmarlError
from jmarl.workflows.base import (
    EpisodeStats,
    GroupIds,
    PlanResult,
    PlanStats,
    SampleRecord,
    Sampler,
    check_agent_policy,
    check_choice,
    resolve_max_turns,
)
from jmarl.workflows.bounds import BoundsContext, PlanBounds
from jmarl.workflows.episodes import EpisodeTrace, choose_first, run_episodes
from jmarl.workflows.stepping import numeric_info


@dataclass(frozen=True)
class IndependentOptions:
    """Options of the `independent` plan (see the module docstring).

    group_size: G episodes per task (>= 1); team_weight/local_weight: weights of the team
    return and of the agent's own local return in its reward; group_by: "task_agent" or
    "task_turn_agent"; max_turns: cap below `env.max_turns` (None: the env's).
    """

    group_size: int = 4
    team_weight: float = 1.0
    local_weight: float = 1.0
    group_by: str = "task_agent"
    max_turns: int | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise JmarlError(f"independent: group_size must be >= 1, got {self.group_size}")
        if self.max_turns is not None and self.max_turns < 1:
            raise JmarlError(f"independent: max_turns must be >= 1 or None, got {self.max_turns}")
        check_choice("independent.group_by", self.group_by, ("task_agent", "task_turn_agent"))


def independent_bounds(options: IndependentOptions, ctx: BoundsContext) -> PlanBounds:
    """Rows E x G x T x a per policy, every row its own prompt (later turns' prompts differ);
    one call per acting agent of E x G rows (a parallel env: E x G x a)."""
    e, g = ctx.num_tasks, options.group_size
    return PlanBounds(rows=e * g * ctx.turns * ctx.max_agents, share=1, aligned=True,
                      calls=ctx.per_agent_calls(e * g, 1))


def sample_independent(
    env: Any,
    seeds: Sequence[int],
    agent_policy: Sequence[int],
    sampler: Sampler,
    rng: jax.Array,
    options: IndependentOptions = IndependentOptions(),
) -> PlanResult:
    """G independent episodes per seed -> records (reward = episode return) and episode stats."""
    agent_policy = check_agent_policy(env, agent_policy)
    tasks = [(t, int(s)) for t, s in enumerate(seeds) for _ in range(options.group_size)]
    traces = run_episodes(
        env,
        tasks,
        agent_policy,
        sampler,
        rng,
        num_candidates=1,
        score=lambda res: 0.0,
        choose=choose_first,
        max_turns=resolve_max_turns(env, options.max_turns),
    )
    groups = GroupIds()
    records: list[SampleRecord] = []
    episodes: list[EpisodeStats] = []
    for trace in traces:
        stats = episode_stats(env, trace)
        episodes.append(stats)
        for node in trace.nodes:
            reward = (
                options.team_weight * stats.team_reward
                + options.local_weight * stats.agent_rewards[node.agent]
            )
            key = (trace.task, node.agent)
            if options.group_by == "task_turn_agent":
                key = (trace.task, node.turn, node.agent)
            res = node.results[0]
            records.append(
                SampleRecord(
                    prompt=node.prompt,
                    completion=node.candidates[0],
                    reward=float(reward),
                    group=groups(key),
                    env=trace.task,
                    turn=node.turn,
                    agent=node.agent,
                    policy=agent_policy[node.agent],
                    source_policy=agent_policy[node.agent],
                    info={"local_reward": res.local_reward, "team_reward": res.team_reward,
                          "env_info": numeric_info(res.info)},
                )
            )
    # one record per sampled completion
    return PlanResult(records=tuple(records), episodes=tuple(episodes),
                      stats=PlanStats(num_generated=len(records)))


def episode_stats(env: Any, trace: EpisodeTrace) -> EpisodeStats:
    """Stats of the path an episode took (the chosen candidate of each node)."""
    team = 0.0
    local = [0.0] * len(env.agents)
    for node in trace.nodes:
        res = node.results[node.chosen]
        team += float(res.team_reward)
        local[node.agent] += float(res.local_reward)
    return EpisodeStats(
        env=trace.task,
        seed=trace.seed,
        success=bool(env.success(trace.final_state)),
        team_reward=team,
        agent_rewards=tuple(local),
        num_turns=trace.num_turns,
    )
