"""What every sampling plan shares: the sampler protocol, sample records and episode stats.

A sampling plan decides which prompts are sampled how many times, which env state every
completion is applied to, and which reward and group every sample gets. It is host-side code:
it talks to the model only through a `Sampler` and to the task only through the env protocol
(`jmarl.envs.base.Env`, immutable states). Its output is a `PlanResult`: a list of
`SampleRecord`s (one per completion), one `EpisodeStats` per finished episode and the step's
`PlanStats`; the learner packs the records into its batches (`jmarl.train.learner.learner_batch`).

Sampler calls. A plan batches every request it can into one `Sampler.sample` call: all agents
of a turn of every live episode when the env is `parallel`, and all live episodes for each
agent position of a turn when it is sequential (an agent's prompt then depends on the previous
agent's action, so the agents of one turn cannot share a call).

Policies. `agent_policy[i]` is the policy id (learner and generator) of `env.agents[i]`:
`(0, 0)` shares one policy between two agents, `(0, 1)` gives each its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from jmarl.errors import JmarlError


@dataclass(frozen=True)
class Completion:
    """One sampled completion of one prompt.

    text: the decoded completion (what the env parses); prompt_tokens int32[P]: the
    chat-templated prompt as the policy's tokenizer encoded it; completion_tokens int32[C]: the
    sampled tokens, including the stop token if one was produced; logprobs f32[C]: the
    behaviour log-prob of each completion token under the policy that sampled it; routing
    uint8/uint16[P + C, S, k] or None: with routing replay (a mixture-of-experts policy with
    model.routing_replay: replay), the experts each prompt and completion token ran in the
    sampler's S sparse layers (`jmarl.models.moe.no_route` where none was recorded: the last
    token, which no decode step read); None otherwise.
    """

    text: str
    prompt_tokens: np.ndarray
    completion_tokens: np.ndarray
    logprobs: np.ndarray
    routing: np.ndarray | None = None


@runtime_checkable
class Sampler(Protocol):
    """Samples completions for a batch of (policy id, prompt text) requests.

    The trainer implements it with the jitted KV-cache sampler (grouping requests by policy
    architecture so that every agent of a turn sharing an architecture is sampled in one device
    call); tests implement it with scripted policies.
    """

    def sample(
        self, requests: Sequence[tuple[int, str]], n: int, rng: jax.Array
    ) -> list[list[Completion]]:
        """For each (policy id, prompt text) request, `n` completions (a list of length n).

        Requests may repeat a prompt (e.g. G independent episodes at turn 0); each repeat is
        sampled independently. `rng` is a fresh key for this call.
        """
        ...


@dataclass(frozen=True)
class SampleRecord:
    """One training sample: a completion with where it came from and what it earned.

    reward: the plan's training reward (the scalar the algorithm turns into an advantage);
    group: GRPO group id, contiguous from 0 within one `PlanResult`; env: index of the task in
    the plan's seed list; turn: turn index from 0; agent: index into `env.agents`; policy: the
    learner policy id; source_policy: the policy that generated it; info: plan-specific
    extras (immediate reward, local/team components, whether a tree candidate was chosen);
    source_seq_logprob: the source policy's mean completion-token log-prob, taken at rollout,
    for a sample whose tokens are not the source's (a `shared` cross sample re-tokenised for
    its learner); None: the mean of `completion.logprobs`.
    """

    prompt: str
    completion: Completion
    reward: float
    group: int
    env: int
    turn: int
    agent: int
    policy: int
    source_policy: int
    info: Mapping[str, Any] = field(default_factory=dict)
    source_seq_logprob: float | None = None


@dataclass(frozen=True)
class EpisodeStats:
    """One finished episode (for `joint`, one root-to-leaf path of the tree).

    env: index of the task in the seed list; seed: its seed; success: `env.success` of the
    final state; team_reward: sum of the team rewards of every step taken; agent_rewards: per
    agent (indexed like `env.agents`), the sum of its local rewards; num_turns: turns played.
    """

    env: int
    seed: int
    success: bool
    team_reward: float
    agent_rewards: tuple[float, ...]
    num_turns: int


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """What every sampling plan reports about one step.

    num_generated: the completions sampled from the model this step. It is `len(records)`
    where every completion becomes one record (`independent`, `tree`, `joint`) and differs
    where it does not (`shared` routes each completion to every learner and drops lossy cross
    samples; `node_wise` keeps only the top-K node groups).

    A plan with more to report extends it with typed fields (`shared.SharedStats`,
    `node_wise.NodeWiseStats`); the trainer logs every number field as `plan/<name>`
    (`plan_metrics`).
    """

    num_generated: int


@dataclass(frozen=True)
class PlanResult:
    """What a sampling plan returns: the sample records, the per-episode stats and plan stats.

    stats: the plan's `PlanStats` (or its own subclass of it) for this step.
    """

    records: tuple[SampleRecord, ...]
    episodes: tuple[EpisodeStats, ...]
    stats: PlanStats

    @property
    def num_groups(self) -> int:
        """Number of distinct group ids among the records."""
        return len({r.group for r in self.records})


def plan_metrics(stats: PlanStats) -> dict[str, float]:
    """`plan/<field>` -> value for every int or float field of `stats` (bools, strings and
    tuples, e.g. `shared`'s mode or per-policy rates, are not logged)."""
    out = {}
    for f in dataclasses.fields(stats):
        value = getattr(stats, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"plan/{f.name}"] = float(value)
    return out


def summarize(episodes: Sequence[EpisodeStats]) -> dict[str, float]:
    """Mean success rate, team reward, per-agent reward and number of turns over `episodes`."""
    if not episodes:
        return {}
    out = {
        "success_rate": float(np.mean([e.success for e in episodes])),
        "team_reward": float(np.mean([e.team_reward for e in episodes])),
        "num_turns": float(np.mean([e.num_turns for e in episodes])),
    }
    per_agent = np.mean([e.agent_rewards for e in episodes], axis=0)
    for i, value in enumerate(np.atleast_1d(per_agent)):
        out[f"agent_reward/{i}"] = float(value)
    return out


def check_agent_policy(env: Any, agent_policy: Sequence[int]) -> tuple[int, ...]:
    """Validates the `agent -> policy` map (one non-negative int per `env.agents` entry)."""
    agent_policy = tuple(agent_policy)
    if len(agent_policy) != len(env.agents):
        raise JmarlError(
            f"agent_policy has {len(agent_policy)} entries but env {env.name!r} has "
            f"{len(env.agents)} agents {env.agents}; give one policy id per agent"
        )
    if any(not isinstance(p, (int, np.integer)) or p < 0 for p in agent_policy):
        raise JmarlError(f"agent_policy entries must be ints >= 0, got {agent_policy}")
    unknown = [a for a in env.turn_order if a not in env.agents]
    if unknown:
        raise JmarlError(f"env {env.name!r} turn_order names unknown agents {unknown}")
    return tuple(int(p) for p in agent_policy)


def resolve_max_turns(env: Any, max_turns: int | None) -> int:
    """The plan's turn limit: `max_turns` if given (at most `env.max_turns`), else the env's."""
    if max_turns is None:
        return int(env.max_turns)
    return min(int(max_turns), int(env.max_turns))


def call_sampler(
    sampler: Sampler, requests: Sequence[tuple[int, str]], n: int, rng: jax.Array
) -> list[list[Completion]]:
    """Calls `sampler.sample` and checks that it answered n completions per request."""
    if not requests:
        return []
    out = sampler.sample(list(requests), n, rng)
    if len(out) != len(requests) or any(len(c) != n for c in out):
        got = [len(c) for c in out]
        raise JmarlError(
            f"sampler returned {got} completions for {len(requests)} requests with n={n}; "
            "it must return a list of n completions per request"
        )
    return [list(c) for c in out]


class GroupIds:
    """Assigns contiguous group ids (0, 1, ...) to hashable keys in order of first use."""

    def __init__(self) -> None:
        self._ids: dict[Any, int] = {}

    def __call__(self, key: Any) -> int:
        """The id of `key`, allocating the next one on first use."""
        if key not in self._ids:
            self._ids[key] = len(self._ids)
        return self._ids[key]


def assert_identical_prompts(records: Sequence[SampleRecord]) -> None:
    """Raises unless every group's samples share a byte-identical prompt (text and tokens)."""
    first: dict[int, SampleRecord] = {}
    for r in records:
        ref = first.setdefault(r.group, r)
        a, b = ref.completion.prompt_tokens, r.completion.prompt_tokens
        same_tokens = a is b or np.array_equal(np.asarray(a), np.asarray(b))  # one request's n share one array
        if ref.prompt != r.prompt or not same_tokens:
            raise JmarlError(
                f"group {r.group} mixes different prompts (env {r.env}, turn {r.turn}, "
                f"agent {r.agent}): a GRPO group must share one identical prompt"
            )


def split_key(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(next key, subkey for one use)."""
    rng, sub = jax.random.split(rng)
    return rng, sub


def input_field(default: Any = None) -> Any:
    """A plan options field that is a run input (filled by the run, e.g. tokenizers, a memory,
    a sampler), not a user setting: marked with the field metadata `{"input": True}`."""
    return field(default=default, metadata={"input": True})


def input_fields(options: Any) -> tuple[str, ...]:
    """Names of the run-input fields (metadata `{"input": True}`) of an options dataclass or
    instance, in field order."""
    return tuple(f.name for f in dataclasses.fields(options) if f.metadata.get("input", False))


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raises a `JmarlError` naming the option if `value` is not one of `choices`."""
    if value not in choices:
        raise JmarlError(f"option {name}={value!r} is not one of {tuple(choices)}")
