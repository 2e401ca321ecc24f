"""The helper + main variant of the code env: `Code(variant="helper_main")` (MAGRPO).

Agents ("aux", "main"). `aux` writes a helper function named `aux`; `main` writes the
entry-point function, which may call `aux`. The joint program is the aux code followed by the
main code. Rewards:
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
Later turns show both agents the joint program's results on the visible examples. The episode
ends after `max_turns` (default 1 in this variant).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from jmarl.envs.base import StepResult
from jmarl.envs.code_harness import ProgramCheck
from jmarl.envs.code_parsing import calls, defines, parse_code
from jmarl.envs.code_problems import Problem
from jmarl.envs.code_variant import CodeState, ProgramChecks, shown


@dataclass(frozen=True)
class HelperMain:
    """The helper + main variant (see the module docstring); a `CodeVariant`.

    checks: the env's sandbox runs; weights: the env's `joint_weights` (structure, syntax,
    pass ratio, uses_aux).
    """

    checks: ProgramChecks
    weights: tuple[float, float, float, float] = (0.1, 0.1, 0.6, 0.2)

    agents: ClassVar[tuple[str, str]] = ("aux", "main")
    default_max_turns: ClassVar[int] = 1
    role_text: ClassVar[dict[str, str]] = {
        "aux": "You write a helper function named aux that {entry} will call. "
        "Decide what part of the work aux does. Do not write {entry} itself.",
        "main": "You write {target}. A helper function aux, written by a teammate, "
        "will be defined before your code; call it. Do not define aux yourself.",
    }
    reply_text: ClassVar[dict[str, str]] = {
        "aux": "Reply with def aux(...) in one ```python code block.",
        "main": "Reply with the code for {entry} in one ```python code block.",
    }
    compact_text: ClassVar[dict[str, str]] = {
        "aux": "Aux: write a helper def aux(...) for {entry} in one ```python block.",
        "main": "Main: write {target}, calling aux (defined before your code), in "
        "one ```python block.",
    }

    def step(self, state: CodeState, agent: str, code: str) -> tuple[CodeState, StepResult]:
        p = state.problem
        aux_code, main_code = state.codes
        max_chars = self.checks.max_code_chars
        aux_tree = parse_code(aux_code, max_chars)
        main_tree = parse_code(main_code, max_chars)
        aux_ok = defines(aux_tree, "aux")
        main_ok = (main_tree is not None if p.entry_point is None
                   else defines(main_tree, p.entry_point))
        joint = joint_program(state)
        # The joint program may be as long as both parts; it is run only within max_code_chars.
        syntax = bool(main_code.strip()) and parse_code(joint, 2 * max_chars) is not None
        structure = aux_ok and main_ok
        uses_aux = syntax and aux_ok and calls(main_tree, "aux")
        ratio = self.checks.hidden_pass_ratio(p, joint) if syntax else 0.0
        w_structure, w_syntax, w_pass, w_uses = self.weights
        team = w_structure * structure + w_syntax * syntax + w_pass * ratio + w_uses * uses_aux
        local = float(aux_ok if agent == "aux" else main_ok)
        state = dataclasses.replace(state, pass_ratio=ratio)
        info = {"code": code, "structure": structure, "syntax_ok": syntax,
                "hidden_pass_ratio": ratio, "uses_aux": uses_aux, "aux_defined": aux_ok,
                "main_defined": main_ok, "hidden_tests": len(p.tests)}
        return state, StepResult(local, team, False, info)

    def sandbox_jobs(self, state: CodeState, agent: str, code: str) -> list[ProgramCheck]:
        program = joint_program(state)
        if self.checks.parse(program) is None:
            return []
        return [self.checks.job(state.problem, program, state.problem.tests)]

    def end_turn(self, state: CodeState, another_turn: bool) -> tuple[CodeState, bool]:
        """Feedback (the examples on the joint program) only where a turn follows; never stops
        early."""
        if not another_turn:
            return dataclasses.replace(state, feedback=""), False
        results = self.checks.outcomes(state.problem, joint_program(state),
                                       state.problem.examples)
        return dataclasses.replace(state, test_results=results,
                                   feedback=self.feedback(state, results)), False

    def feedback(self, state: CodeState, results: tuple[bool, ...]) -> str:
        """The text both agents see on the next turn: both parts and the examples that fail."""
        aux, main = state.codes
        lines = [f"Turn feedback. The helper:\n{shown(aux or '# (none)')}",
                 f"The main function:\n{shown(main or '# (none)')}"]
        if results:
            failed = [t for t, ok in zip(state.problem.examples, results) if not ok]
            lines.append(f"The examples: {len(results) - len(failed)} of {len(results)} pass.")
            if failed:
                lines.append("Failing examples:\n" + shown("\n".join(failed)))
        return "\n".join(lines)

    def expert_code(self, problem: Problem, agent: str) -> str | None:
        """The reference helper (aux) and the reference main part that calls it (main)."""
        if agent == "aux":
            return problem.aux_reference
        if agent == "main":
            return problem.main_reference
        return None


def joint_program(state: CodeState) -> str:
    """The aux code followed by the main code (the main code alone while aux wrote nothing)."""
    aux, main = state.codes
    return f"{aux.rstrip()}\n\n\n{main}" if aux.strip() else main
