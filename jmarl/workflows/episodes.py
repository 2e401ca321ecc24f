"""The lock-step episode loop shared by the `independent` and `tree` plans.

Many episodes advance together, turn by turn, so that each sampler call carries every live
episode. At every (episode, turn, agent) node the loop samples `num_candidates` completions
from the one prompt the agent observes, applies each to its own copy of the running state
(`env.step` on the same parent state: states are immutable, so branches never share
anything), scores them, and lets a `choose` function pick the candidate whose state continues
the episode. With one candidate this is plain episode sampling.

Turn semantics, per `env.parallel`:
- sequential: the agent observes the running state (the actions already taken this turn
  included); one sampler call per agent position, over all live episodes.
- parallel: every agent observes the turn-start state; one sampler call per turn; the chosen
  actions are then applied in `turn_order`, each agent's candidates on the running state (the
  state after the earlier agents' chosen actions), each on its own branch.

An episode ends when `env.done(state)` or after `max_turns` turns. If it ends in the middle of
a turn, the remaining agents of that turn do not act (in a parallel turn their already-sampled
completions are discarded) and `end_turn` is not called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jmarl.envs.base import StepResult
from jmarl.workflows.base import Completion, Sampler, call_sampler, split_key

# (rewards f32[E, K], rng) -> chosen candidate index int[E]
ChooseFn = Callable[[np.ndarray, jax.Array], np.ndarray]
# StepResult of one candidate -> its score (the reward the choice is based on)
ScoreFn = Callable[[StepResult], float]


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
    sampler: Sampler,
    rng: jax.Array,
    *,
    num_candidates: int,
    score: ScoreFn,
    choose: ChooseFn,
    max_turns: int,
) -> list[EpisodeTrace]:
    """Plays one episode per (task index, seed) in `tasks`, all in lock step."""
    agent_index = {name: i for i, name in enumerate(env.agents)}
    states = [env.reset(seed) for _, seed in tasks]
    nodes: list[list[NodeTrace]] = [[] for _ in tasks]
    num_turns = [0] * len(tasks)

    def sample(prompts: dict[tuple[int, str], str], rng: jax.Array) -> dict[tuple[int, str], list]:
        keys = list(prompts)
        requests = [(agent_policy[agent_index[a]], prompts[(e, a)]) for e, a in keys]
        return dict(zip(keys, call_sampler(sampler, requests, num_candidates, rng)))

    for turn in range(max_turns):
        live = [e for e in range(len(tasks)) if not env.done(states[e])]
        if not live:
            break
        for e in live:
            num_turns[e] = turn + 1
        if env.parallel:
            prompts = {(e, a): env.observe(states[e], a) for e in live for a in env.turn_order}
            rng, key = split_key(rng)
            completions = sample(prompts, key)
        for agent in env.turn_order:
            acting = [e for e in live if not env.done(states[e])]
            if not acting:
                break
            if not env.parallel:
                prompts = {(e, agent): env.observe(states[e], agent) for e in acting}
                rng, key = split_key(rng)
                completions = sample(prompts, key)
            # every candidate is applied to the same immutable parent state: its own branch
            branches = [
                [env.step(states[e], agent, c.text) for c in completions[(e, agent)]]
                for e in acting
            ]
            scores = np.array([[score(res) for _, res in b] for b in branches], np.float64)
            rng, key = split_key(rng)
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
