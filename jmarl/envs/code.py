"""Code: agents write Python that is run against hidden tests in the sandbox.

Two variants (`variant=`), each a small class in its own module that decides the agents, their
prompt texts, the rewards of a step, the feedback between turns, when the episode stops early
and the expert replies; the `Code` env delegates to it through the `CodeVariant` protocol
(`jmarl.envs.code_variant`):

* "coder_tester" (AT-GRPO, `jmarl.envs.code_coder_tester`): agents ("coder", "tester"). The
  coder writes the function (or a stdin/stdout program), the tester assert-style tests; the
  episode ends once the program passes all of the tester's tests, or after `max_turns`
  (default 2).
* "helper_main" (MAGRPO, `jmarl.envs.code_helper_main`): agents ("aux", "main"). `aux` writes a
  helper function `aux`, `main` the entry point that may call it; they are scored as one joint
  program. The episode ends after `max_turns` (default 1).

This module holds what the two share: the options, the problems and their train/eval split,
the prompt's frame, and the episode loop. Every StepResult's `info` reports the parsed code
and each reward component. `step` never raises: the code is read from the reply by
`jmarl.envs.code_parsing.extract_code`; code longer than `max_code_chars` or that does not
compile scores as non-compiling (and is never run).

Programs run in the sandbox through `jmarl.envs.code_harness` (`run_tests`), which reports each
test's outcome so that printing "PASS", exiting early, looping or crashing wins nothing.

Problems: built-in generated ones (default, see `jmarl.envs.code_problems`), or a HumanEval /
MBPP / APPS JSONL file (`path=`). Training seeds draw training problems and evaluation seeds
evaluation problems; the split is a hash of the problem (fraction `eval_fraction` held out).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from jmarl.envs import code_jsonl, code_problems
from jmarl.envs.base import EVAL_SEED_START, StepResult, is_eval_seed
from jmarl.envs.code_coder_tester import CoderTester
from jmarl.envs.code_harness import ProgramCheck, run_tests
from jmarl.envs.code_helper_main import HelperMain
from jmarl.envs.code_parsing import MAX_TESTER_TESTS, extract_code, parse_tests
from jmarl.envs.code_problems import Problem
from jmarl.envs.code_variant import CodeState, CodeVariant, ProgramChecks
from jmarl.errors import JmarlError

# Re-exported: the names tests and users import from this module.
__all__ = ["Code", "CodeState", "MAX_TESTER_TESTS", "VARIANTS", "extract_code", "parse_tests"]

_VARIANT_CLASSES: dict[str, type[CoderTester] | type[HelperMain]] = {
    "coder_tester": CoderTester, "helper_main": HelperMain}
VARIANTS = tuple(_VARIANT_CLASSES)
PROMPT_STYLES = ("full", "compact")


# ---------------------------------------------------------------------------------------- env


@dataclass(frozen=True)
class Code:
    """The Code task (see the module docstring).

    Options: variant ("coder_tester" | "helper_main"); path (a HumanEval/MBPP/APPS JSONL file;
    None: built-in problems); max_turns (default 2 for coder_tester, 1 for helper_main);
    eval_fraction (share of problems held out for evaluation seeds); num_problems (None: every
    problem; N: each split keeps N problems, the built-in problems of the split's first N seeds
    or the file's first N problems of the split, and its seeds cycle through them);
    prompt_style ("full": the role, problem and reply instructions; "compact": one line naming
    the role and the reply form, then the problem and any feedback, for small models);
    num_hidden_tests (built-in problems); test_timeout_s (per test); memory_mb (per program);
    max_code_chars (longer code scores as non-compiling); tester_validity_weight (coder_tester);
    joint_weights (helper_main: weights of structure, syntax, pass ratio, uses_aux).
    """

    name: ClassVar[str] = "code"
    variant: str = "coder_tester"
    path: str | None = None
    max_turns: int | None = None
    eval_fraction: float = 0.2
    num_problems: int | None = None
    prompt_style: str = "full"
    num_hidden_tests: int = code_problems.NUM_HIDDEN_TESTS
    test_timeout_s: float = 1.0
    memory_mb: int = 512
    max_code_chars: int = 20_000
    tester_validity_weight: float = 0.5
    joint_weights: tuple[float, float, float, float] = (0.1, 0.1, 0.6, 0.2)
    agents: tuple[str, ...] = field(init=False)
    turn_order: tuple[str, ...] = field(init=False)
    parallel: bool = field(default=True, init=False)
    _splits: tuple[tuple[Problem, ...], tuple[Problem, ...]] = field(
        init=False, repr=False, compare=False)
    # the variant's rules (agents, texts, rewards, feedback), built from the options
    _rules: CodeVariant = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise JmarlError(f"code: unknown variant {self.variant!r}; use one of {VARIANTS}")
        if self.max_turns is None:
            object.__setattr__(self, "max_turns", _VARIANT_CLASSES[self.variant].default_max_turns)
        if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
            raise JmarlError(f"code: max_turns must be an int >= 1, got {self.max_turns!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise JmarlError(f"code: eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.prompt_style not in PROMPT_STYLES:
            raise JmarlError(f"code: prompt_style must be one of {PROMPT_STYLES}, got "
                             f"{self.prompt_style!r}")
        if self.num_problems is not None and not (
                isinstance(self.num_problems, int) and not isinstance(self.num_problems, bool)
                and self.num_problems >= 1):
            raise JmarlError(f"code: num_problems must be an int >= 1 or None (every problem), "
                             f"got {self.num_problems!r}")
        if not (isinstance(self.num_hidden_tests, int) and 1 <= self.num_hidden_tests <= 100):
            raise JmarlError(f"code: num_hidden_tests must be in [1, 100], got "
                             f"{self.num_hidden_tests!r}")
        if not 0.0 < self.test_timeout_s <= 60.0:
            raise JmarlError(f"code: test_timeout_s must be in (0, 60], got {self.test_timeout_s}")
        if not (isinstance(self.memory_mb, int) and self.memory_mb >= 64):
            raise JmarlError(f"code: memory_mb must be an int >= 64, got {self.memory_mb!r}")
        if not 0.0 <= self.tester_validity_weight <= 1.0:
            raise JmarlError(f"code: tester_validity_weight must be in [0, 1], got "
                             f"{self.tester_validity_weight}")
        weights = tuple(self.joint_weights)
        if len(weights) != 4 or any(not isinstance(w, (int, float)) or w < 0 for w in weights):
            raise JmarlError(f"code: joint_weights must be 4 non-negative numbers (structure, "
                             f"syntax, pass ratio, uses_aux), got {self.joint_weights!r}")
        object.__setattr__(self, "joint_weights", tuple(float(w) for w in weights))
        checks = ProgramChecks(self.max_code_chars, self.test_timeout_s, self.memory_mb)
        rules: CodeVariant = (CoderTester(checks, self.tester_validity_weight)
                              if self.variant == "coder_tester"
                              else HelperMain(checks, self.joint_weights))
        object.__setattr__(self, "_rules", rules)
        object.__setattr__(self, "agents", rules.agents)
        object.__setattr__(self, "turn_order", rules.agents)
        splits: tuple[tuple[Problem, ...], tuple[Problem, ...]] = ((), ())
        if self.path is not None:
            problems = _load(str(self.path))
            train = tuple(p for p in problems if not code_problems.is_eval_identity(
                p.task_id, self.eval_fraction))
            held = tuple(p for p in problems if code_problems.is_eval_identity(
                p.task_id, self.eval_fraction))
            splits = (train, held)
        object.__setattr__(self, "_splits", splits)

    # ---- problems

    def problem(self, seed: int) -> Problem:
        """The problem for `seed` (training seeds: training split; eval seeds: held-out)."""
        if not isinstance(seed, int) or seed < 0:
            raise JmarlError(f"code: seed must be an int >= 0, got {seed!r}")
        want_eval = is_eval_seed(seed)
        index = seed - EVAL_SEED_START if want_eval else seed
        if self.num_problems is not None:
            index %= self.num_problems
        if self.path is None:
            start = EVAL_SEED_START if want_eval else 0
            return code_problems.builtin_problem(start + index, want_eval=want_eval,
                                                 eval_fraction=self.eval_fraction,
                                                 n_tests=self.num_hidden_tests)
        pool = self._splits[1 if want_eval else 0]
        if not pool:
            which = "evaluation" if want_eval else "training"
            raise JmarlError(f"code: {self.path!r} has no {which} problems with eval_fraction="
                             f"{self.eval_fraction}; use more problems or another fraction")
        return pool[index % len(pool)]

    # ---- protocol

    def reset(self, seed: int) -> CodeState:
        return CodeState(seed=seed, problem=self.problem(seed))

    def observe(self, state: CodeState, agent: str) -> str:
        p = state.problem
        if agent not in self.agents:
            return f"Unknown agent {agent!r}; this task's agents are {', '.join(self.agents)}."
        entry = p.entry_point
        if entry is None:
            target = "a program that reads standard input and writes standard output"
            test_form = 'assert run_program("<stdin text>") == "<expected stdout>"'
        else:
            target = f"the function {entry}"
            test_form = f"assert {entry}(...) == ..."
        fields = {"entry": entry or "the program", "target": target, "test_form": test_form}
        if self.prompt_style == "compact":
            parts = [self._rules.compact_text[agent].format(**fields), p.description]
            if state.feedback:
                parts.append(state.feedback)
            return "\n\n".join(parts)
        parts = [self._rules.role_text[agent].format(**fields), "Problem:\n" + p.description]
        if state.feedback:
            parts.append(state.feedback)
        parts.append(self._rules.reply_text[agent].format(**fields))
        return "\n\n".join(parts)

    def step(self, state: CodeState, agent: str, text: str) -> tuple[CodeState, StepResult]:
        if state.finished:
            return state, StepResult(0.0, 0.0, True, {"error": "the episode is over"})
        if agent not in self.agents:
            return state, StepResult(0.0, 0.0, False, {"error": f"unknown agent {agent!r}"})
        code = extract_code(text)
        return self._rules.step(self._with_code(state, agent, code), agent, code)

    def step_many(self, items: Sequence[tuple[CodeState, str, str]]) -> list[tuple[CodeState, StepResult]]:
        """`[self.step(*item) for item in items]`, with the sandbox runs of every item's step
        (hidden tests, the tester's tests on the program and on the reference) batched through
        one `run_many` first; the steps then read them from `run_tests`' cache."""
        jobs = [job for state, agent, text in items for job in self._step_jobs(state, agent, text)]
        if jobs:
            run_tests(jobs, test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)
        return [self.step(state, agent, text) for state, agent, text in items]

    def _step_jobs(self, state: CodeState, agent: str, text: str) -> list[ProgramCheck]:
        """The sandbox jobs `step(state, agent, text)` runs (mirrors `step`)."""
        if state.finished or agent not in self.agents:
            return []
        code = extract_code(text)
        return self._rules.sandbox_jobs(self._with_code(state, agent, code), agent, code)

    def _with_code(self, state: CodeState, agent: str, code: str) -> CodeState:
        """`state` with `code` as `agent`'s latest code."""
        codes = tuple(code if a == agent else c for a, c in zip(self.agents, state.codes))
        return dataclasses.replace(state, codes=codes)  # type: ignore[arg-type]

    def end_turn(self, state: CodeState) -> CodeState:
        if state.finished:
            return state
        turn = state.turn + 1
        state, stop = self._rules.end_turn(state, another_turn=turn < self.max_turns)
        return dataclasses.replace(state, turn=turn, finished=stop or turn >= self.max_turns)

    def done(self, state: CodeState) -> bool:
        return state.finished

    def success(self, state: CodeState) -> bool:
        return state.pass_ratio >= 1.0

    def solution(self, seed: int) -> str | None:
        """The reference program for `seed` (None where the data has none)."""
        return self.problem(seed).reference

    def expert_text(self, state: CodeState, agent: str) -> str:
        """The variant's expert code for `agent`, fenced ("" where there is none)."""
        code = self._rules.expert_code(state.problem, agent)
        if not code:
            return ""
        return f"```python\n{code.rstrip()}\n```"


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime: float, size: int) -> tuple[Problem, ...]:
    return code_jsonl.load_jsonl(path)


def _load(path: str) -> tuple[Problem, ...]:
    if not os.path.isfile(path):
        raise JmarlError(f"code: problem file {path!r} not found; pass path= an existing "
                         "HumanEval/MBPP/APPS-style JSONL file")
    st = os.stat(path)
    return _load_cached(os.path.abspath(path), st.st_mtime, st.st_size)
