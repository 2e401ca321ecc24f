"""A toy env for trainer tests: any text earns a different reward, so advantages are non-zero.

Two agents (`a`, `b`) act sequentially for one turn; agent `a`'s reward is the fraction of its
characters in 'a'..'m', `b`'s the fraction in 'n'..'z' (dense: random text scores ~0.13); the
team reward is their mean; success is both fractions above 1/2. Used as `env.name: tests._toy_env:Letters`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from jmarl.envs.base import StepResult


LIKES = {"a": "abcdefghijklm", "b": "nopqrstuvwxyz"}


@dataclass(frozen=True)
class LettersState:
    seed: int
    scores: tuple[tuple[str, float], ...] = ()
    turn: int = 0
    finished: bool = False


@dataclass(frozen=True)
class Letters:
    name: ClassVar[str] = "letters"
    agents: tuple[str, ...] = ("a", "b")
    turn_order: tuple[str, ...] = ("a", "b")
    parallel: bool = False
    max_turns: int = 1

    def reset(self, seed: int) -> LettersState:
        return LettersState(seed=seed)

    def observe(self, state: LettersState, agent: str) -> str:
        return f"task {state.seed % 7}: write letters like {LIKES[agent][:3]}"

    def step(self, state: LettersState, agent: str, text: str) -> tuple[LettersState, StepResult]:
        text = text[:1000]
        letters = LIKES[agent]
        score = sum(ch in letters for ch in text) / max(len(text), 1)
        new = replace(state, scores=state.scores + ((agent, score),))
        team = sum(s for _, s in new.scores) / len(self.agents) if len(new.scores) == len(self.agents) else 0.0
        return new, StepResult(local_reward=score, team_reward=team, done=False, info={})

    def end_turn(self, state: LettersState) -> LettersState:
        turn = state.turn + 1
        return replace(state, turn=turn, finished=turn >= self.max_turns)

    def done(self, state: LettersState) -> bool:
        return state.finished

    def success(self, state: LettersState) -> bool:
        return len(state.scores) == len(self.agents) and all(s > 0.5 for _, s in state.scores)

    def solution(self, seed: int):
        return None

    def expert_text(self, state: LettersState, agent: str) -> str:
        return LIKES[agent][:6]
