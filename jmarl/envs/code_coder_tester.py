"""The coder + tester variant of the code env: `Code(variant="coder_tester")` (AT-GRPO).

Agents ("coder", "tester"). The coder writes the function (or, for stdin/stdout problems, the
program); the tester writes assert-style tests. Rewards:
  coder  local = team = hidden pass ratio of the coder's program (passed / hidden tests);
  tester local = (1 - w) * agreement + w * validity (w = `tester_validity_weight`, default
                 0.5; w = 0 scores agreement alone), where
    agreement = 1 if (the coder's program passes all the tester's tests) equals (it passes all
                hidden tests), else 0;
    validity  = fraction of the tester's tests that the reference solution passes
                (without a reference solution: local = agreement);
    a reply with no test scores 0; team = the coder's hidden pass ratio.
The tester is scored against the coder's program in the running state (the coder acts first in
`turn_order`). The episode ends once the coder's program passes all of the tester's tests (at
least one), or after `max_turns` (default 2); each later turn shows both agents the previous
program, the tests, and which tests failed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from jmarl.envs.base import StepResult
from jmarl.envs.code_harness import ProgramCheck
from jmarl.envs.code_parsing import parse_tests
from jmarl.envs.code_problems import Problem
from jmarl.envs.code_variant import CodeState, ProgramChecks, share_passed, shown

# Names the tester's setup code may not redefine (besides the function under test): the
# harness's helpers.
_HARNESS_NAMES = {"_same", "_same_lines", "_eq", "run_program"}


@dataclass(frozen=True)
class CoderTester:
    """The coder + tester variant (see the module docstring); a `CodeVariant`.

    checks: the env's sandbox runs; validity_weight: the env's `tester_validity_weight`.
    """

    checks: ProgramChecks
    validity_weight: float = 0.5

    agents: ClassVar[tuple[str, str]] = ("coder", "tester")
    default_max_turns: ClassVar[int] = 2
    role_text: ClassVar[dict[str, str]] = {
        "coder": "You are the coder in a team of a coder and a unit tester. Write {target}.",
        "tester": "You are the unit tester in a team of a coder and a unit tester. "
        "Write tests for {target}: each test is one line of the form\n{test_form}\nwith an input "
        "you choose and the correct expected output.",
    }
    reply_text: ClassVar[dict[str, str]] = {
        "coder": "Reply with the complete solution in one ```python code block.",
        "tester": "Reply with your assert statements in one ```python code block.",
    }
    compact_text: ClassVar[dict[str, str]] = {
        "coder": "Coder: write {target} in one ```python block.",
        "tester": "Tester: write tests `{test_form}` in one ```python block.",
    }

    def step(self, state: CodeState, agent: str, code: str) -> tuple[CodeState, StepResult]:
        if agent == "coder":
            return self._step_coder(state, code)
        return self._step_tester(state, code)

    def sandbox_jobs(self, state: CodeState, agent: str, code: str) -> list[ProgramCheck]:
        p = state.problem
        if agent == "coder":
            if self.checks.parse(code) is None:
                return []
            return [self.checks.job(p, code, p.tests)]
        program, tests = self._program_and_tests(state)
        if not tests:
            return []
        jobs = []
        if self.checks.parse(program) is not None:
            jobs.append(self.checks.job(p, program, tests))
        if p.reference is not None:
            jobs.append(self.checks.job(p, p.reference, tests))
        return jobs

    def end_turn(self, state: CodeState, another_turn: bool) -> tuple[CodeState, bool]:
        """Feedback on every turn; stops once the program passes all the tests (at least one)."""
        program, tests = self._program_and_tests(state)
        results = self._tests_on(state, program, tests)
        passes_all = bool(program.strip()) and bool(results) and all(results)
        state = dataclasses.replace(state, checked=(program, tests), test_results=results,
                                    feedback=self.feedback(program, tests, results))
        return state, passes_all

    def feedback(self, program: str, tests: tuple[str, ...], results: tuple[bool, ...]) -> str:
        """The text both agents see on the next turn: the program, the tests, which failed."""
        lines = [f"Turn feedback. The coder's current program:\n{shown(program or '# (none)')}"]
        if not tests:
            lines.append("The tester wrote no runnable tests.")
        else:
            lines.append(f"The tester's tests:\n{shown(chr(10).join(tests))}")
            failed = [t for t, ok in zip(tests, results) if not ok]
            lines.append(f"Result: {len(tests) - len(failed)} of {len(tests)} tests passed.")
            if failed:
                lines.append("Failing tests:\n" + shown("\n".join(failed[:5])))
        return "\n".join(lines)

    def expert_code(self, problem: Problem, agent: str) -> str | None:
        """Coder: the reference solution; tester: the visible examples (else 3 hidden tests)."""
        if agent == "coder":
            return problem.reference
        if agent == "tester":
            return "\n".join(problem.examples or problem.tests[:3])
        return None

    # ---- internals

    def _program_and_tests(self, state: CodeState) -> tuple[str, tuple[str, ...]]:
        """The coder's latest program and the tests parsed from the tester's latest code."""
        program = state.codes[0]
        protected = {state.problem.entry_point or "run_program", *_HARNESS_NAMES}
        tests = parse_tests(state.codes[1], protected, self.checks.max_code_chars)
        return program, tests

    def _tests_on(self, state: CodeState, program: str,
                  tests: tuple[str, ...]) -> tuple[bool, ...]:
        """The tests on the program (reusing the outcomes the tester's step stored)."""
        if state.checked == (program, tests) and len(state.test_results) == len(tests):
            return state.test_results
        return self.checks.outcomes(state.problem, program, tests)

    def _step_coder(self, state: CodeState, code: str) -> tuple[CodeState, StepResult]:
        p = state.problem
        syntax_ok = self.checks.parse(code) is not None
        ratio = self.checks.hidden_pass_ratio(p, code)
        state = dataclasses.replace(state, pass_ratio=ratio)
        info = {"code": code, "syntax_ok": syntax_ok, "hidden_pass_ratio": ratio,
                "hidden_tests": len(p.tests)}
        return state, StepResult(ratio, ratio, False, info)

    def _step_tester(self, state: CodeState, code: str) -> tuple[CodeState, StepResult]:
        p = state.problem
        program, tests = self._program_and_tests(state)
        info: dict[str, Any] = {"code": code, "num_tests": len(tests)}
        if not tests:
            info.update(agreement=0.0, validity=0.0)
            return state, StepResult(0.0, state.pass_ratio, False, info)
        program_ok = self.checks.parse(program) is not None
        # A program that does not compile fails every test without being run.
        jobs = [self.checks.job(p, program, tests if program_ok else ())]
        if p.reference is not None:
            jobs.append(self.checks.job(p, p.reference, tests))
        outcomes = self.checks.run(jobs)
        on_program = outcomes[0] if program_ok else (False,) * len(tests)
        tester_verdict = all(on_program)
        hidden_verdict = state.pass_ratio >= 1.0
        agreement = float(tester_verdict == hidden_verdict)
        info.update(tests_passed_by_coder=sum(on_program), tester_verdict=tester_verdict,
                    hidden_verdict=hidden_verdict, agreement=agreement)
        if p.reference is not None:
            validity = share_passed(outcomes[1])
            w = self.validity_weight
            local = (1.0 - w) * agreement + w * validity
            info["validity"] = validity
        else:
            local = agreement
        state = dataclasses.replace(state, checked=(program, tests), test_results=on_program)
        return state, StepResult(local, state.pass_ratio, False, info)
