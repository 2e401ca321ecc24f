"""Code: agents write Python that is run against hidden tests in the sandbox.

Two variants (`variant=`):

* "coder_tester" (AT-GRPO): agents ("coder", "tester"). The coder writes the function (or, for
  stdin/stdout problems, the program); the tester writes assert-style tests. Rewards:
    coder  local = team = hidden pass ratio of the coder's program (passed / hidden tests);
    tester local = (1 - w) * agreement + w * validity (w = `tester_validity_weight`, default
                   0.5; w = 0 scores agreement alone), where
      agreement = 1 if (the coder's program passes all the tester's tests) equals (it passes all
                  hidden tests), else 0;
      validity  = fraction of the tester's tests that the reference solution passes
                  (without a reference solution: local = agreement);
      a reply with no test scores 0; team = the coder's hidden pass ratio.
  The tester is scored against the coder's program in the running state (the coder acts first
  in `turn_order`). The episode ends once the coder's program passes all of the tester's
  tests (at least one), or after `max_turns`; each later turn shows both agents the previous
  program, the tests, and which tests failed.

* "helper_main" (MAGRPO): agents ("aux", "main"). `aux` writes a helper function named `aux`;
  `main` writes the entry-point function, which may call `aux`. The joint program is the aux
  code followed by the main code. Rewards:
    team  = 0.1 * structure + 0.1 * syntax + 0.6 * pass_ratio + 0.2 * uses_aux (the weights are
            the option `joint_weights`), where
      structure  = the aux code defines `aux` and the main code defines the entry point
                   (for stdin/stdout problems: the main code is not empty);
      syntax     = the main code is not empty and the joint program compiles;
      pass_ratio = hidden pass ratio of the joint program (0 if it does not compile);
      uses_aux   = the main code calls `aux`, the aux code defines it and syntax holds;
    local = 1 if the agent's own code compiles and defines its function (`aux` / the entry
            point), else 0.
  team is computed at each step from the latest code of both agents in the running state, so
  after both acted in a turn, main's StepResult holds the joint reward of the joint action.
  Later turns show both agents the joint program's results on the visible examples. The
  episode ends after `max_turns` (default 1 in this variant).

Every StepResult's `info` reports the parsed code and each reward component. `step` never
raises: the code is the ```python fenced blocks of the reply (joined), else any fenced blocks,
else the text after an unclosed fence, else the whole text; code longer than
`max_code_chars` or that does not compile scores as non-compiling (and is never run).

Programs run in the sandbox through `jmarl.envs.code_harness` (`run_tests`), which reports each
test's outcome so that printing "PASS", exiting early, looping or crashing wins nothing.

Problems: built-in generated ones (default, see `jmarl.envs.code_problems`), or a HumanEval /
MBPP / APPS JSONL file (`path=`). Training seeds draw training problems and evaluation seeds
evaluation problems; the split is a hash of the problem (fraction `eval_fraction` held out).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from jmarl.envs import code_problems
from jmarl.envs.base import EVAL_SEED_START, StepResult, is_eval_seed
from jmarl.envs.code_harness import ProgramCheck, run_tests
from jmarl.envs.code_problems import Problem
from jmarl.errors import JmarlError

VARIANTS = ("coder_tester", "helper_main")
PROMPT_STYLES = ("full", "compact")
_AGENTS = {"coder_tester": ("coder", "tester"), "helper_main": ("aux", "main")}
MAX_TESTER_TESTS = 20
_MAX_REPLY_CHARS = 200_000
_SHOWN_CODE_CHARS = 3_000

# ------------------------------------------------------------------------------------ parsing

_PY_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.S | re.I)
_ANY_FENCE_RE = re.compile(r"```[^\n`]*\r?\n(.*?)```", re.S)
_OPEN_FENCE_RE = re.compile(r"```[^\n`]*\r?\n(.*)\Z", re.S)


def extract_code(text: Any) -> str:
    """The Python code in a model reply (see the module docstring); never raises."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        text = "" if text is None else str(text)
    text = text[:_MAX_REPLY_CHARS].replace("\x00", "")
    blocks = _PY_FENCE_RE.findall(text) or _ANY_FENCE_RE.findall(text)
    if blocks:
        return "\n\n".join(b.strip("\n") for b in blocks) + "\n"
    unclosed = _OPEN_FENCE_RE.search(text)
    if unclosed:
        return unclosed.group(1)
    return text


def _parse(code: str, max_chars: int) -> ast.Module | None:
    """The AST of `code`, or None if it is empty, too long, or does not compile."""
    if not code.strip() or len(code) > max_chars:
        return None
    try:
        tree = ast.parse(code)
        compile(tree, "solution.py", "exec")  # compiles only (e.g. catches 'return' outside def)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError, OverflowError):
        return None
    return tree


def _defines(tree: ast.Module | None, name: str) -> bool:
    """Whether `tree` defines a top-level function `name`."""
    if tree is None:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
               for n in tree.body)


def _calls(tree: ast.Module | None, name: str) -> bool:
    """Whether `tree` calls `name(...)` anywhere."""
    if tree is None:
        return False
    try:
        return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
                   for n in ast.walk(tree))
    except RecursionError:
        return False


def _binds(node: ast.stmt, names: set[str]) -> bool:
    """Whether the statement (re)defines one of `names` at top level."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name in names
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) in names for a in node.names)
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    return any(isinstance(n, ast.Name) and n.id in names for t in targets for n in ast.walk(t))


def parse_tests(code: str, protected: set[str], max_chars: int,
                max_tests: int = MAX_TESTER_TESTS) -> tuple[str, ...]:
    """The tester's tests: one snippet per top-level `assert` or `def test_*()` function.

    The other top-level statements (imports, helpers) are kept before every test, except those
    that would redefine a `protected` name (the function under test). () if nothing parses.
    """
    tree = _parse(code, max_chars)
    if tree is None:
        return ()
    setup, tests = [], []
    for node in tree.body:
        if isinstance(node, ast.Assert):
            tests.append(ast.unparse(node))
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            if not node.args.args and not _binds(node, protected):
                tests.append(f"{ast.unparse(node)}\n{node.name}()")
        elif not isinstance(node, ast.Expr) and not _binds(node, protected):
            setup.append(ast.unparse(node))  # imports, helpers; bare calls are dropped
    prefix = "\n".join(setup)
    return tuple(f"{prefix}\n{t}" if prefix else t for t in tests[:max_tests])


def _ratio(passed: Sequence[bool]) -> float:
    return sum(passed) / len(passed) if passed else 0.0


# -------------------------------------------------------------------------------------- state


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


def _shown(code: str) -> str:
    if len(code) > _SHOWN_CODE_CHARS:
        code = code[:_SHOWN_CODE_CHARS] + "\n# ... (cut)"
    return f"```python\n{code.rstrip()}\n```"


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

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise JmarlError(f"code: unknown variant {self.variant!r}; use one of {VARIANTS}")
        if self.max_turns is None:
            object.__setattr__(self, "max_turns", 2 if self.variant == "coder_tester" else 1)
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
        agents = _AGENTS[self.variant]
        object.__setattr__(self, "agents", agents)
        object.__setattr__(self, "turn_order", agents)
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
        role = _ROLE_TEXT[(self.variant, agent)]
        entry = p.entry_point
        if entry is None:
            target = "a program that reads standard input and writes standard output"
            test_form = 'assert run_program("<stdin text>") == "<expected stdout>"'
        else:
            target = f"the function {entry}"
            test_form = f"assert {entry}(...) == ..."
        fields = {"entry": entry or "the program", "target": target, "test_form": test_form}
        if self.prompt_style == "compact":
            parts = [_COMPACT_TEXT[(self.variant, agent)].format(**fields), p.description]
            if state.feedback:
                parts.append(state.feedback)
            return "\n\n".join(parts)
        parts = [role.format(**fields), "Problem:\n" + p.description]
        if state.feedback:
            parts.append(state.feedback)
        parts.append(_REPLY_TEXT[(self.variant, agent)].format(**fields))
        return "\n\n".join(parts)

    def step(self, state: CodeState, agent: str, text: str) -> tuple[CodeState, StepResult]:
        if state.finished:
            return state, StepResult(0.0, 0.0, True, {"error": "the episode is over"})
        if agent not in self.agents:
            return state, StepResult(0.0, 0.0, False, {"error": f"unknown agent {agent!r}"})
        code = extract_code(text)
        codes = tuple(code if a == agent else c for a, c in zip(self.agents, state.codes))
        state = dataclasses.replace(state, codes=codes)  # type: ignore[arg-type]
        if self.variant == "coder_tester":
            return self._step_coder_tester(state, agent, code)
        return self._step_helper_main(state, agent, code)

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
        codes = tuple(code if a == agent else c for a, c in zip(self.agents, state.codes))
        state = dataclasses.replace(state, codes=codes)  # type: ignore[arg-type]
        p = state.problem
        if self.variant == "helper_main":
            program = self._joint_program(state)
        elif agent == "coder":
            program = code
        else:
            program, tests = self._program_and_tests(state)
            if not tests:
                return []
            jobs = []
            if _parse(program, self.max_code_chars) is not None:
                jobs.append(self._job(p, program, tests))
            if p.reference is not None:
                jobs.append(self._job(p, p.reference, tests))
            return jobs
        if _parse(program, self.max_code_chars) is None:
            return []
        return [self._job(p, program, p.tests)]

    def end_turn(self, state: CodeState) -> CodeState:
        if state.finished:
            return state
        turn = state.turn + 1
        if self.variant == "coder_tester":
            program, tests = self._program_and_tests(state)
            results = self._tests_on(state, program, tests)
            feedback = self._coder_tester_feedback(program, tests, results)
            agreed = bool(program.strip()) and bool(results) and all(results)
            state = dataclasses.replace(state, checked=(program, tests), test_results=results)
        else:
            agreed = False
            feedback = ""
            if turn < self.max_turns:  # feedback is only read by a next turn
                results = self._examples_on(state, self._joint_program(state))
                feedback = self._helper_main_feedback(state, results)
                state = dataclasses.replace(state, test_results=results)
        return dataclasses.replace(state, turn=turn, feedback=feedback,
                                   finished=agreed or turn >= self.max_turns)

    def done(self, state: CodeState) -> bool:
        return state.finished

    def success(self, state: CodeState) -> bool:
        return state.pass_ratio >= 1.0

    def solution(self, seed: int) -> str | None:
        """The reference program for `seed` (None where the data has none)."""
        return self.problem(seed).reference

    def expert_text(self, state: CodeState, agent: str) -> str:
        p = state.problem
        if agent == "coder":
            code = p.reference
        elif agent == "tester":
            code = "\n".join(p.examples or p.tests[:3])
        elif agent == "aux":
            code = p.aux_reference
        elif agent == "main":
            code = p.main_reference
        else:
            code = None
        if not code:
            return ""
        return f"```python\n{code.rstrip()}\n```"

    # ---- coder + tester

    def _program_and_tests(self, state: CodeState) -> tuple[str, tuple[str, ...]]:
        program = state.codes[0]
        protected = {state.problem.entry_point or "run_program", "_same", "_same_lines", "_eq",
                     "run_program"}
        tests = parse_tests(state.codes[1], protected, self.max_code_chars)
        return program, tests

    def _job(self, problem: Problem, program: str, tests: Sequence[str]) -> ProgramCheck:
        return ProgramCheck(program=program, tests=tuple(tests), setup=problem.setup,
                       program_mode=problem.entry_point is None)

    def _hidden_ratio(self, problem: Problem, program: str) -> float:
        if _parse(program, self.max_code_chars) is None:
            return 0.0
        [passed] = run_tests([self._job(problem, program, problem.tests)],
                             test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)
        return _ratio(passed)

    def _tests_on(self, state: CodeState, program: str, tests: tuple[str, ...]) -> tuple[bool, ...]:
        if state.checked == (program, tests) and len(state.test_results) == len(tests):
            return state.test_results
        if not tests:
            return ()
        if _parse(program, self.max_code_chars) is None:
            return (False,) * len(tests)
        [passed] = run_tests([self._job(state.problem, program, tests)],
                             test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)
        return passed

    def _step_coder_tester(self, state: CodeState, agent: str,
                           code: str) -> tuple[CodeState, StepResult]:
        p = state.problem
        if agent == "coder":
            syntax_ok = _parse(code, self.max_code_chars) is not None
            ratio = self._hidden_ratio(p, code)
            state = dataclasses.replace(state, pass_ratio=ratio)
            info = {"code": code, "syntax_ok": syntax_ok, "hidden_pass_ratio": ratio,
                    "hidden_tests": len(p.tests)}
            return state, StepResult(ratio, ratio, False, info)
        program, tests = self._program_and_tests(state)
        info: dict[str, Any] = {"code": code, "num_tests": len(tests)}
        if not tests:
            info.update(agreement=0.0, validity=0.0)
            return state, StepResult(0.0, state.pass_ratio, False, info)
        program_ok = _parse(program, self.max_code_chars) is not None
        # A program that does not compile fails every test without being run.
        jobs = [self._job(p, program, tests if program_ok else ())]
        if p.reference is not None:
            jobs.append(self._job(p, p.reference, tests))
        outcomes = run_tests(jobs, test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)
        on_program = outcomes[0] if program_ok else (False,) * len(tests)
        tester_verdict = all(on_program)
        hidden_verdict = state.pass_ratio >= 1.0
        agreement = float(tester_verdict == hidden_verdict)
        info.update(tests_passed_by_coder=sum(on_program), tester_verdict=tester_verdict,
                    hidden_verdict=hidden_verdict, agreement=agreement)
        if p.reference is not None:
            validity = _ratio(outcomes[1])
            w = self.tester_validity_weight
            local = (1.0 - w) * agreement + w * validity
            info["validity"] = validity
        else:
            local = agreement
        state = dataclasses.replace(state, checked=(program, tests), test_results=on_program)
        return state, StepResult(local, state.pass_ratio, False, info)

    def _coder_tester_feedback(self, program: str, tests: tuple[str, ...],
                               results: tuple[bool, ...]) -> str:
        lines = [f"Turn feedback. The coder's current program:\n{_shown(program or '# (none)')}"]
        if not tests:
            lines.append("The tester wrote no runnable tests.")
        else:
            lines.append(f"The tester's tests:\n{_shown(chr(10).join(tests))}")
            failed = [t for t, ok in zip(tests, results) if not ok]
            lines.append(f"Result: {len(tests) - len(failed)} of {len(tests)} tests passed.")
            if failed:
                lines.append("Failing tests:\n" + _shown("\n".join(failed[:5])))
        return "\n".join(lines)

    # ---- helper + main

    def _joint_program(self, state: CodeState) -> str:
        aux, main = state.codes
        return f"{aux.rstrip()}\n\n\n{main}" if aux.strip() else main

    def _examples_on(self, state: CodeState, program: str) -> tuple[bool, ...]:
        p = state.problem
        if not p.examples:
            return ()
        if _parse(program, self.max_code_chars) is None:
            return (False,) * len(p.examples)
        [passed] = run_tests([self._job(p, program, p.examples)],
                             test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)
        return passed

    def _step_helper_main(self, state: CodeState, agent: str,
                          code: str) -> tuple[CodeState, StepResult]:
        p = state.problem
        aux_code, main_code = state.codes
        aux_tree = _parse(aux_code, self.max_code_chars)
        main_tree = _parse(main_code, self.max_code_chars)
        aux_ok = _defines(aux_tree, "aux")
        main_ok = (main_tree is not None if p.entry_point is None
                   else _defines(main_tree, p.entry_point))
        joint = self._joint_program(state)
        syntax = bool(main_code.strip()) and _parse(joint, 2 * self.max_code_chars) is not None
        structure = aux_ok and main_ok
        uses_aux = syntax and aux_ok and _calls(main_tree, "aux")
        ratio = self._hidden_ratio(p, joint) if syntax else 0.0
        w_structure, w_syntax, w_pass, w_uses = self.joint_weights
        team = w_structure * structure + w_syntax * syntax + w_pass * ratio + w_uses * uses_aux
        local = float(aux_ok if agent == "aux" else main_ok)
        state = dataclasses.replace(state, pass_ratio=ratio)
        info = {"code": code, "structure": structure, "syntax_ok": syntax,
                "hidden_pass_ratio": ratio, "uses_aux": uses_aux, "aux_defined": aux_ok,
                "main_defined": main_ok, "hidden_tests": len(p.tests)}
        return state, StepResult(local, team, False, info)

    def _helper_main_feedback(self, state: CodeState, results: tuple[bool, ...]) -> str:
        aux, main = state.codes
        lines = [f"Turn feedback. The helper:\n{_shown(aux or '# (none)')}",
                 f"The main function:\n{_shown(main or '# (none)')}"]
        if results:
            failed = [t for t, ok in zip(state.problem.examples, results) if not ok]
            lines.append(f"The examples: {len(results) - len(failed)} of {len(results)} pass.")
            if failed:
                lines.append("Failing examples:\n" + _shown("\n".join(failed)))
        return "\n".join(lines)


_ROLE_TEXT = {
    ("coder_tester", "coder"): "You are the coder in a team of a coder and a unit tester. "
    "Write {target}.",
    ("coder_tester", "tester"): "You are the unit tester in a team of a coder and a unit tester. "
    "Write tests for {target}: each test is one line of the form\n{test_form}\nwith an input you "
    "choose and the correct expected output.",
    ("helper_main", "aux"): "You write a helper function named aux that {entry} will call. "
    "Decide what part of the work aux does. Do not write {entry} itself.",
    ("helper_main", "main"): "You write {target}. A helper function aux, written by a teammate, "
    "will be defined before your code; call it. Do not define aux yourself.",
}
_REPLY_TEXT = {
    ("coder_tester", "coder"): "Reply with the complete solution in one ```python code block.",
    ("coder_tester", "tester"): "Reply with your assert statements in one ```python code block.",
    ("helper_main", "aux"): "Reply with def aux(...) in one ```python code block.",
    ("helper_main", "main"): "Reply with the code for {entry} in one ```python code block.",
}
# prompt_style="compact": one line instead of the role and reply paragraphs (for small models)
_COMPACT_TEXT = {
    ("coder_tester", "coder"): "Coder: write {target} in one ```python block.",
    ("coder_tester", "tester"): "Tester: write tests `{test_form}` in one ```python block.",
    ("helper_main", "aux"): "Aux: write a helper def aux(...) for {entry} in one ```python block.",
    ("helper_main", "main"): "Main: write {target}, calling aux (defined before your code), in "
    "one ```python block.",
}


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime: float, size: int) -> tuple[Problem, ...]:
    return code_problems.load_jsonl(path)


def _load(path: str) -> tuple[Problem, ...]:
    if not os.path.isfile(path):
        raise JmarlError(f"code: problem file {path!r} not found; pass path= an existing "
                         "HumanEval/MBPP/APPS-style JSONL file")
    st = os.stat(path)
    return _load_cached(os.path.abspath(path), st.st_mtime, st.st_size)
