"""The shape bounds a sampling plan declares for one step: what the memory check
(`jmarl.memory_check`) compiles a run's programs for, before any rollout exists.

Each plan module gives a function `(options, BoundsContext) -> PlanBounds` and its `Plan` value
carries it (`Plan.bounds`); a plan without one runs, but its memory cannot be checked.
Notation of the plans' docstrings: E = tasks per step, T = turns, a = the agents of the turn
order that map to one policy (the most over a group's policies), n = all of them.
"""

from __future__ import annotations

from dataclasses import dataclass


# (rows per policy of the group, rows sharing a prompt) of one sampler call
SamplerCall = tuple[tuple[int, ...], int]


@dataclass(frozen=True)
class BoundsContext:
    """What a plan's bounds depend on besides its options, for one policy group.

    num_tasks: E; turns: T (the plan's max_turns, else the env's); order: the env's turn order
    as agent indices; agent_policy: the policy id of each agent (indexed like `env.agents`);
    policy_ids: the group's policies; parallel: whether the env's agents act at once.
    """

    num_tasks: int
    turns: int
    order: tuple[int, ...]
    agent_policy: tuple[int, ...]
    policy_ids: tuple[int, ...]
    parallel: bool

    def agents_of(self, policy: int) -> int:
        """The agents of the turn order that map to `policy`."""
        return sum(self.agent_policy[a] == policy for a in self.order)

    @property
    def max_agents(self) -> int:
        """a: the most agents of the turn order that map to one policy of the group."""
        return max(self.agents_of(p) for p in self.policy_ids)

    @property
    def num_agents(self) -> int:
        """n: the agents of the turn order."""
        return len(self.order)

    def per_agent_calls(self, rows: int, share: int) -> tuple[SamplerCall, ...]:
        """One sampler call per agent of `rows` completions (a sequential env), or one per turn
        with every agent's (a parallel env)."""
        ids = self.policy_ids
        if self.parallel:
            return ((tuple(rows * self.agents_of(p) for p in ids), share),)
        return tuple((tuple(rows if self.agent_policy[i] == p else 0 for p in ids), share) for i in self.order)


@dataclass(frozen=True)
class PlanBounds:
    """Upper bounds of one step for one policy group: `rows` samples of any one policy, `share`
    consecutive rows per prompt (`aligned`: groups of exactly `share` rows from row 0; False
    where groups may be cut), and the sampler `calls` of the step."""

    rows: int
    share: int
    aligned: bool
    calls: tuple[SamplerCall, ...]
