"""What a variant of the code env (`jmarl.envs.code`) supplies, and what it works with.

The `Code` env owns the options, the problems and the episode loop; a variant (`CodeVariant`:
`jmarl.envs.code_coder_tester.CoderTester`, `jmarl.envs.code_helper_main.HelperMain`) owns
the agents, their prompt texts, the rewards of a step, the feedback between turns, when the
episode may stop early, and the expert replies. Both work on the episode state `CodeState` and
run programs through `ProgramChecks` (the test harness, `jmarl.envs.code_harness`, within the
env's limits).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import ClassVar, Mapping, Protocol, Sequence

from jmarl.envs.base import StepResult
from jmarl.envs.code_harness import ProgramCheck, run_tests
from jmarl.envs.code_parsing import parse_code
from jmarl.envs.code_problems import Problem

_SHOWN_CODE_CHARS = 3_000


@dataclass(frozen=True)
class CodeState:
    """One episode (immutable).

    codes: each agent's latest parsed code, in the env's `agents` order ("" before it acts);
    pass_ratio: hidden pass ratio of the current solution (the coder's program / the joint
    program); checked: the (program, tests) pair that `test_results` belong to; test_results:
    the tester's tests on the coder's program (coder_tester) or the examples on the joint
    program (helper_main); feedback: the text shown on the next turn; finished: episode over.
    """

    seed: int
    problem: Problem
    turn: int = 0
    codes: tuple[str, str] = ("", "")
    pass_ratio: float = 0.0
    checked: tuple[str, tuple[str, ...]] = ("", ())
    test_results: tuple[bool, ...] = ()
    feedback: str = ""
    finished: bool = False


@dataclass(frozen=True)
class ProgramChecks:
    """Runs programs against tests in the sandbox, within the env's limits.

    max_code_chars: longer code counts as non-compiling and is never run; test_timeout_s: per
    test; memory_mb: per program.
    """

    max_code_chars: int
    test_timeout_s: float
    memory_mb: int

    def parse(self, code: str) -> ast.Module | None:
        """The AST of `code`, or None where it is empty, too long or does not compile."""
        return parse_code(code, self.max_code_chars)

    def job(self, problem: Problem, program: str, tests: Sequence[str]) -> ProgramCheck:
        """One sandbox run: `program` against `tests`, with the problem's setup code."""
        return ProgramCheck(program=program, tests=tuple(tests), setup=problem.setup,
                            program_mode=problem.entry_point is None)

    def run(self, jobs: Sequence[ProgramCheck]) -> list[tuple[bool, ...]]:
        """Each job's per-test outcomes (one batched sandbox call; outcomes are cached)."""
        return run_tests(jobs, test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)

    def hidden_pass_ratio(self, problem: Problem, program: str) -> float:
        """The share of the problem's hidden tests `program` passes (0 if it does not compile)."""
        if self.parse(program) is None:
            return 0.0
        [passed] = self.run([self.job(problem, program, problem.tests)])
        return share_passed(passed)

    def outcomes(self, problem: Problem, program: str,
                 tests: tuple[str, ...]) -> tuple[bool, ...]:
        """Each of `tests` on `program`: () without tests; all fail if it does not compile."""
        if not tests:
            return ()
        if self.parse(program) is None:
            return (False,) * len(tests)
        [passed] = self.run([self.job(problem, program, tests)])
        return passed


class CodeVariant(Protocol):
    """One variant of the code task; the `Code` env delegates to it.

    agents: the two agent names, in turn order (`CodeState.codes` follows it);
    default_max_turns: the env's `max_turns` when the option is None;
    role_text / reply_text: per agent, the paragraphs before the problem and after it
    (prompt_style "full"); compact_text: per agent, the one line before the problem
    (prompt_style "compact"). The texts are formatted with {entry} (the entry point, or "the
    program"), {target} ("the function f" / "a program that reads standard input ...") and
    {test_form} (the form of one test).
    """

    agents: ClassVar[tuple[str, str]]
    default_max_turns: ClassVar[int]
    role_text: ClassVar[Mapping[str, str]]
    reply_text: ClassVar[Mapping[str, str]]
    compact_text: ClassVar[Mapping[str, str]]

    def step(self, state: CodeState, agent: str, code: str) -> tuple[CodeState, StepResult]:
        """Scores `agent`'s `code`; `state.codes` already holds it. Never raises."""
        ...

    def sandbox_jobs(self, state: CodeState, agent: str, code: str) -> list[ProgramCheck]:
        """The sandbox runs `step(state, agent, code)` makes (so that the env can batch them)."""
        ...

    def end_turn(self, state: CodeState, another_turn: bool) -> tuple[CodeState, bool]:
        """After every agent acted: the state with the feedback for the next turn (`another_turn`:
        whether one follows), and whether the episode stops now (before `max_turns`)."""
        ...

    def expert_code(self, problem: Problem, agent: str) -> str | None:
        """The code an expert `agent` would write (None where the problem has none)."""
        ...


def share_passed(passed: Sequence[bool]) -> float:
    """The share of True in `passed` (0 for none)."""
    return sum(passed) / len(passed) if passed else 0.0


def shown(code: str) -> str:
    """`code` as a fenced block for feedback texts, cut after a few thousand characters."""
    if len(code) > _SHOWN_CODE_CHARS:
        code = code[:_SHOWN_CODE_CHARS] + "\n# ... (cut)"
    return f"```python\n{code.rstrip()}\n```"
