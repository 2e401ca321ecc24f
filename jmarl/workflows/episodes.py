"""The lock-step episode loop shared by the `independent` and `tree` plans (and the expert
demonstrations of a warm start).

Many episodes advance together, turn by turn, so that each actor call carries every live
episode. At every (episode, turn, agent) node the loop takes `num_candidates` completions of
the one prompt the agent observes from an `Actor` (the plans': a `Sampler`; the warm start's:
the env's expert), applies each to its own copy of the running state (`env.step` on the same
parent state: states are immutable, so branches never share anything), scores them, and lets a
`choose` function pick the candidate whose state continues the episode. With one candidate
this is plain episode sampling.

Turn semantics, per `env.parallel`:
- sequential: the agent observes the running state (the actions already taken this turn
  included); one actor call per agent position, over all live episodes.
- parallel: every agent observes the turn-start state; one actor call per turn for a
  `per_turn` actor (a sampler: the whole turn in one batch), else one per agent position with
  the running state (the expert, whose text may depend on the earlier agents' actions); the
  chosen actions are then applied in `turn_order`, each agent's candidates on the running
  state (the state after the earlier agents' chosen actions), each on its own branch.

An episode ends when `env.done(state)` or after `max_turns` turns. If it ends in the middle of
a turn, the remaining agents of that turn do not act (in a parallel turn their already-sampled
completions are discarded) and `end_turn` is not called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from jmarl.envs.base import StepResult
from jmarl.errors import JmarlError
from jmarl.workflows.base import (
    Completion,
    Sampler,
    call_sampler,
    check_agent_policy,
    resolve_max_turns,
    split_key,
)
from jmarl.workflows.stepping import step_all

# (rewards f32[E, K], rng) -> chosen candidate index int[E]
ChooseFn = Callable[[np.ndarray, jax.Array], np.ndarray]
# StepResult of one candidate -> its score (the reward the choice is based on)
ScoreFn = Callable[[StepResult], float]


@dataclass(frozen=True)
class Request:
    """One node asking for completions: episode (index into the loop's tasks), turn, agent
    name, policy id of the agent, the prompt it observed, and the state it acts on (the running
    state; the turn-start state in a parallel turn asked for at once by a `per_turn` actor)."""

    episode: int
    turn: int
    agent: str
    policy: int
    prompt: str
    state: Any


@runtime_checkable
class Actor(Protocol):
    """Produces the candidate completions of the loop's nodes.

    per_turn: in a parallel env, whether the actor answers every agent of a turn in one call
    at the turn start (True: a sampler batching the turn) or each agent position when it acts,
    with the running state (False).
    """

    per_turn: bool

    def act(self, requests: Sequence[Request], n: int, rng: jax.Array | None) -> list[list[Completion]]:
        """For each request, `n` completions (a list of length n)."""
        ...


@dataclass(frozen=True)
class SamplerActor:
    """The plans' actor: `sampler.sample` over (policy id, prompt) requests, a turn at once."""

    sampler: Sampler
    per_turn: bool = True

    def act(self, requests: Sequence[Request], n: int, rng: jax.Array | None) -> list[list[Completion]]:
        """n sampled completions per request (one sampler call)."""
        return call_sampler(self.sampler, [(r.policy, r.prompt) for r in requests], n, rng)


@dataclass(frozen=True)
class ExpertActor:
    """The env's expert: `env.expert_text(state, agent)` on the state the agent acts on (the
    running state, also in a parallel turn). Its completions carry the text only (no tokens or
    log-probs: empty arrays); deterministic, so the n completions of a request are equal."""

    env: Any
    per_turn: bool = False

    def act(self, requests: Sequence[Request], n: int, rng: jax.Array | None) -> list[list[Completion]]:
        """n copies of the expert's completion per request."""
        del rng
        out = []
        for r in requests:
            text = self.env.expert_text(r.state, r.agent)
            out.append([_text_completion(text)] * n)
        return out


def _text_completion(text: str) -> Completion:
    """A completion holding only its text."""
    return Completion(
        text=text,
        prompt_tokens=np.zeros((0,), np.int32),
        completion_tokens=np.zeros((0,), np.int32),
        logprobs=np.zeros((0,), np.float32),
    )


def as_actor(source: Sampler | Actor) -> Actor:
    """`source` itself if it is an `Actor`, else a `SamplerActor` around the sampler."""
    if isinstance(source, Actor):
        return source
    return SamplerActor(source)


def _split(rng: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """`split_key`, passing None through (actors and choices that need no randomness)."""
    if rng is None:
        return None, None
    return split_key(rng)


@dataclass(frozen=True)
class NodeTrace:
    """One agent's decision in one turn of one episode.

    prompt: what the agent observed; candidates/results/scores: the K completions, the
    `StepResult` of applying each to the running state, and their scores; chosen: the index
    of the candidate that continued the episode.
    """

    turn: int
    agent: int
    prompt: str
    candidates: tuple[Completion, ...]
    results: tuple[StepResult, ...]
    scores: tuple[float, ...]
    chosen: int


@dataclass(frozen=True)
class EpisodeTrace:
    """One episode: its task index and seed, the nodes in the order they were played, the
    final state and the number of turns in which some agent acted."""

    task: int
    seed: int
    nodes: tuple[NodeTrace, ...]
    final_state: Any
    num_turns: int


def run_episodes(
    env: Any,
    tasks: Sequence[tuple[int, int]],
    agent_policy: tuple[int, ...],
    actor: Sampler | Actor,
    rng: jax.Array | None,
    *,
    num_candidates: int,
    score: ScoreFn,
    choose: ChooseFn,
    max_turns: int,
) -> list[EpisodeTrace]:
    """Plays one episode per (task index, seed) in `tasks`, all in lock step.

    actor: a `Sampler` (wrapped in a `SamplerActor`) or any `Actor`; rng: the key split for
    every actor call and every choice (None where neither needs one, e.g. the expert with
    `choose_first`).
    """
    actor = as_actor(actor)
    agent_index = {name: i for i, name in enumerate(env.agents)}
    states = [env.reset(seed) for _, seed in tasks]
    nodes: list[list[NodeTrace]] = [[] for _ in tasks]
    num_turns = [0] * len(tasks)

    def act(
        turn: int, prompts: dict[tuple[int, str], str], rng: jax.Array | None
    ) -> dict[tuple[int, str], list[Completion]]:
        keys = list(prompts)
        requests = [
            Request(e, turn, a, agent_policy[agent_index[a]], prompts[(e, a)], states[e])
            for e, a in keys
        ]
        if not requests:
            return {}
        answers = actor.act(requests, num_candidates, rng)
        if len(answers) != len(requests) or any(len(c) != num_candidates for c in answers):
            raise JmarlError(
                f"actor returned {[len(c) for c in answers]} completions for {len(requests)} "
                f"requests with n={num_candidates}; it must return n completions per request"
            )
        return dict(zip(keys, (list(c) for c in answers)))

    for turn in range(max_turns):
        live = [e for e in range(len(tasks)) if not env.done(states[e])]
        if not live:
            break
        for e in live:
            num_turns[e] = turn + 1
        if env.parallel:
            prompts = {(e, a): env.observe(states[e], a) for e in live for a in env.turn_order}
            if actor.per_turn:
                rng, key = _split(rng)
                completions = act(turn, prompts, key)
        for agent in env.turn_order:
            acting = [e for e in live if not env.done(states[e])]
            if not acting:
                break
            if not env.parallel:
                prompts = {(e, agent): env.observe(states[e], agent) for e in acting}
            if not (env.parallel and actor.per_turn):
                rng, key = _split(rng)
                completions = act(turn, {(e, agent): prompts[(e, agent)] for e in acting}, key)
            # every candidate is applied to the same immutable parent state: its own branch;
            # all candidates of the turn's agent position are stepped together
            flat = step_all(
                env, [(states[e], agent, c.text) for e in acting for c in completions[(e, agent)]]
            )
            k = num_candidates
            branches = [flat[row * k : (row + 1) * k] for row in range(len(acting))]
            scores = np.array([[score(res) for _, res in b] for b in branches], np.float64)
            rng, key = _split(rng)
            chosen = np.asarray(choose(scores, key)).reshape(-1)
            for row, e in enumerate(acting):
                k = int(chosen[row])
                states[e] = branches[row][k][0]
                nodes[e].append(
                    NodeTrace(
                        turn=turn,
                        agent=agent_index[agent],
                        prompt=prompts[(e, agent)],
                        candidates=tuple(completions[(e, agent)]),
                        results=tuple(res for _, res in branches[row]),
                        scores=tuple(float(s) for s in scores[row]),
                        chosen=k,
                    )
                )
        for e in live:
            if not env.done(states[e]):
                states[e] = env.end_turn(states[e])

    return [
        EpisodeTrace(task=t, seed=s, nodes=tuple(n), final_state=st, num_turns=nt)
        for (t, s), n, st, nt in zip(tasks, nodes, states, num_turns)
    ]


def expert_demonstrations(
    env: Any,
    seeds: Sequence[int],
    agent_policy: Sequence[int],
    *,
    max_turns: int | None = None,
) -> list[tuple[int, str, str]]:
    """(policy id, prompt, expert text) for every agent step of one expert episode per seed.

    The episodes are played by the plans' loop (`run_episodes`) with the `ExpertActor`: each
    agent observes its prompt (the turn-start state in a parallel turn, the running state in a
    sequential one) and acts with `env.expert_text` on the running state; max_turns caps the
    turns (None: `env.max_turns`). Ordered by seed, then in play order. The policy is the
    acting agent's (`agent_policy[i]` for `env.agents[i]`).
    """
    agent_policy = check_agent_policy(env, agent_policy)
    traces = run_episodes(
        env,
        [(t, int(s)) for t, s in enumerate(seeds)],
        agent_policy,
        ExpertActor(env),
        None,
        num_candidates=1,
        score=lambda res: 0.0,
        choose=choose_first,
        max_turns=resolve_max_turns(env, max_turns),
    )
    return [
        (agent_policy[node.agent], node.prompt, node.candidates[node.chosen].text)
        for trace in traces
        for node in trace.nodes
    ]


def choose_first(scores: np.ndarray, rng: jax.Array) -> np.ndarray:
    """Always candidate 0: int[E] zeros for scores f32[E, K]."""
    del rng
    return np.zeros(scores.shape[0], np.int64)


def choose_best(scores: np.ndarray, rng: jax.Array) -> np.ndarray:
    """The highest-scoring candidate per row (the first one on ties): int[E]."""
    del rng
    return np.argmax(scores, axis=1)


def choose_sampled(temperature: float) -> ChooseFn:
    """Samples candidate k with probability softmax(scores / temperature)[k], per row."""

    def choose(scores: np.ndarray, rng: jax.Array) -> np.ndarray:
        logits = np.asarray(scores, np.float32) / temperature
        return np.asarray(jax.random.categorical(rng, logits, axis=-1))

    return choose
