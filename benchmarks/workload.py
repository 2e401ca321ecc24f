"""The whole-iteration workload shared by jmarl and the PyTorch trainers: prompts and reward.

Task `seed` shows a 46-character instruction; under the plain chat template of the char
tokenizer ("user: ...\\nassistant: ") the prompt is exactly 64 tokens on both sides. Agent k's
score is the fraction of its completion's characters in `LIKES[k]` (dense: random text scores
~0.1, so group advantages are never all zero). Single agent: reward = score. Two agents (one
parallel turn, MAGRPO): the joint reward is the mean of both scores.

jmarl reads it as the env `benchmarks.workload:BenchTask`; TRL and CoMLRL get the same templated
prompt strings (`templated_prompts`) and the reward functions below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Sequence

from jmarl.envs.base import StepResult

LIKES = ("abcdefghijklm", "nopqrstuvwxyz")
PROMPT_CHARS = 46  # + len("user: ") + len("\nassistant: ") = 64 tokens


def instruction(seed: int) -> str:
    """The 46-character instruction of task `seed`."""
    text = f"task {seed:08d}: write text that scores well, please."
    return (text + " " * PROMPT_CHARS)[:PROMPT_CHARS]


def score(text: str, agent: int) -> float:
    """Fraction of `text`'s characters in LIKES[agent] (0 for empty text)."""
    return sum(ch in LIKES[agent] for ch in text) / max(len(text), 1)


def templated_prompts(tokenizer: Any, seeds: Sequence[int]) -> list[str]:
    """The chat-templated prompt of each seed (what jmarl's sampler tokenises)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": instruction(s)}], add_generation_prompt=True,
                                          tokenize=False) for s in seeds]


def trl_reward(prompts, completions, **kwargs) -> list[float]:
    """TRL reward function (single agent): the score of each completion."""
    return [score(c, 0) for c in completions]


def comlrl_reward(completions_a, completions_b, **kwargs) -> list[float]:
    """CoMLRL joint reward of aligned completion lists of the two agents."""
    return [(score(a, 0) + score(b, 1)) / 2 for a, b in zip(completions_a, completions_b)]


@dataclass(frozen=True)
class BenchState:
    seed: int
    scores: tuple[float, ...] = ()
    turn: int = 0


@dataclass(frozen=True)
class BenchTask:
    """One-turn env (see the module docstring); `num_agents` 1 (GRPO) or 2 (MAGRPO, parallel)."""

    name: ClassVar[str] = "bench_task"
    num_agents: int = 1
    max_turns: int = 1
    parallel: bool = True

    @property
    def agents(self) -> tuple[str, ...]:
        return ("a", "b")[: self.num_agents]

    @property
    def turn_order(self) -> tuple[str, ...]:
        return self.agents

    def reset(self, seed: int) -> BenchState:
        return BenchState(seed=seed)

    def observe(self, state: BenchState, agent: str) -> str:
        return instruction(state.seed)

    def step(self, state: BenchState, agent: str, text: str) -> tuple[BenchState, StepResult]:
        s = score(text, self.agents.index(agent))
        new = replace(state, scores=state.scores + (s,))
        complete = len(new.scores) == self.num_agents
        team = sum(new.scores) / self.num_agents if complete else 0.0
        return new, StepResult(local_reward=0.0, team_reward=team, done=complete, info={})

    def end_turn(self, state: BenchState) -> BenchState:
        return replace(state, turn=state.turn + 1)

    def done(self, state: BenchState) -> bool:
        return state.turn >= self.max_turns or len(state.scores) >= self.num_agents

    def success(self, state: BenchState) -> bool:
        return bool(state.scores) and min(state.scores) > 0.5

    def solution(self, seed: int):
        return None

    def expert_text(self, state: BenchState, agent: str) -> str:
        return LIKES[self.agents.index(agent)]
