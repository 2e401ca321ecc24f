"""The two-agent puzzle workflow of AT-GRPO (Plan-Path, Sokoban, Sudoku): tool + planner.

Per turn, sequentially:
1. `tool` proposes an action: directly in text, or as a ```python program run in the sandbox
   whose stdout is parsed as the action (the program reads the rendered board on stdin). The
   proposal is not executed; the tool's local reward is the reward the proposal would earn if
   executed now (local + team terms of that simulated step), or the malformed reward if no
   action could be parsed or the program failed. Its team reward is 0 (the board did not change).
2. `planner` sees the board and the tool's proposal and writes the final action, which is
   executed: local reward = the per-move terms, team reward = the outcome terms (solved, ...).
   local + team is the reward of the task's table in docs/environments.md.
`end_turn` advances the turn; the episode ends when solved or after `max_turns` turns (or
when an executed action fails it, e.g. a move limit of the `pettingllms` reward setting).

Named reward settings (Plan-Path, Sokoban): a subclass lists its coefficient sets in
`reward_settings` ({name: frozen dataclass of coefficients}); its `reward` option picks one
("compact" by default: small terms that train tiny CPU models well; "pettingllms": the
coefficients of PettingLLMs' env_state.py, the AT-GRPO paper's code) and every coefficient
option that is set (not None) overrides that coefficient. `coefficients` is the resolved set.
See docs/environments.md, section 2.6.

A subclass supplies the puzzle: `_generate`, `_key`, `_render`, `_parse_action`, `_apply`,
`_expert_action`, `_format_action`, `_instructions`, `solution`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jmarl.envs.base import StepResult
from jmarl.envs.common import FrozenMap, clip_text, draw_split_item, freeze_memory, with_memory
from jmarl.envs.parsing import extract_python, run_program
from jmarl.errors import JmarlError

AGENTS = ("tool", "planner")
# "full": instructions, the board, turn, feedback and the agent's role in sentences (the
# papers' prompts). "compact": the board and one short line per fact, e.g. for Plan-Path
#   A...#\n.#..G\n...\nA0,0 G1,4 turn 1/2\ntool: RRDD\nplan:
# and answers without the "Actions:" label: 5-10x fewer tokens for small CPU models.
PROMPT_STYLES = ("full", "compact")


@dataclass(frozen=True)
class PuzzleState:
    """One episode's state (immutable).

    puzzle: the generated instance (env-specific, immutable); board: the current configuration;
    turn: turns completed; moves: actions executed so far (for "shortest" bonuses);
    proposal: the tool's parsed action this turn (None = none or unparseable);
    proposal_note: how the proposal was obtained (direct / program status);
    history: one feedback line per executed planner action; solved / finished: episode flags;
    memory_context: {agent: memory entries} injected by a workflow.
    """

    seed: int
    puzzle: Any
    board: Any
    turn: int = 0
    moves: int = 0
    proposal: Any = None
    proposal_note: str = ""
    history: tuple[str, ...] = ()
    solved: bool = False
    finished: bool = False
    memory_context: FrozenMap = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_context", freeze_memory(self.memory_context))


@dataclass(frozen=True)
class Applied:
    """The outcome of executing one action on a board: the new board, the number of moves it
    made, the per-move (local) and outcome (team) reward terms, whether it solved the puzzle and
    the reward components; `failed`: the action ends the episode unsolved (a move limit ran
    out)."""

    board: Any
    moves: int
    local: float
    team: float
    solved: bool
    info: dict
    failed: bool = False


class PuzzleEnv:
    """Base class of the tool + planner puzzle envs (subclasses are frozen dataclasses)."""

    name = "puzzle"
    single_agent: bool = False  # subclasses' dataclass field: True drops the tool agent

    @property
    def agents(self) -> tuple[str, ...]:
        """("tool", "planner"), or ("planner",) with `single_agent` (the papers' single-agent
        baseline: one model reads the board and writes the executed action)."""
        return ("planner",) if self.single_agent else AGENTS

    @property
    def turn_order(self) -> tuple[str, ...]:
        return self.agents
    parallel = False
    max_turns: int = 3
    malformed_reward: float = -0.5
    program_timeout_s: float = 5.0
    answer_label = "Actions"
    generation_options: tuple[str, ...] = ()  # the fields the generated puzzles depend on
    # {setting name: coefficient dataclass} for envs with a `reward` option (see the module
    # docstring); empty: the env's own fields are its coefficients.
    reward_settings: Mapping[str, Any] = {}

    @property
    def coefficients(self) -> Any:
        """The reward coefficients in force: those of the `reward` setting, each replaced by the
        env option of the same name when that option is set (not None). Envs without named
        settings return themselves (their fields are the coefficients)."""
        if not self.reward_settings:
            return self
        base = self.reward_settings[self.reward]
        overrides = {f.name: getattr(self, f.name) for f in dataclasses.fields(base)
                     if getattr(self, f.name, None) is not None}
        return dataclasses.replace(base, **overrides)

    # ---- subclass hooks ----------------------------------------------------------------------
    def _generate(self, rng: random.Random) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _key(self, puzzle: Any) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _initial_board(self, puzzle: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _render(self, puzzle: Any, board: Any) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _instructions(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _parse_action(self, text: str) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _apply(self, puzzle: Any, board: Any, action: Any, moves_so_far: int) -> Applied:
        raise NotImplementedError  # pragma: no cover - abstract

    def _expert_action(self, puzzle: Any, board: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _format_action(self, action: Any) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _render_compact(self, puzzle: Any, board: Any) -> str:
        """The board for `prompt_style="compact"` prompts (default: the full rendering)."""
        return self._render(puzzle, board)

    def _format_compact(self, action: Any) -> str:
        """An action as written in `prompt_style="compact"` prompts and demonstrations."""
        return self._format_action(action)

    def _format(self, action: Any) -> str:
        """An action in this env's prompt style."""
        return self._format_compact(action) if self._compact else self._format_action(action)

    @property
    def _compact(self) -> bool:
        return getattr(self, "prompt_style", "full") == "compact"

    def _feedback(self, action: Any, applied: Applied) -> str:
        """One line on an executed action for later prompts."""
        return self._format(action) + (" (solved)" if applied.solved else
                                       " (move limit reached)" if applied.failed else "")

    # ---- protocol ----------------------------------------------------------------------------
    def _check_options(self) -> None:
        if self.max_turns < 1:
            raise JmarlError(f"{self.name}: max_turns must be >= 1, got {self.max_turns}")
        style = getattr(self, "prompt_style", "full")
        if style not in PROMPT_STYLES:
            raise JmarlError(f"{self.name}: prompt_style must be one of {PROMPT_STYLES}, got {style!r}")
        if self.reward_settings:
            setting = getattr(self, "reward", None)
            if setting not in self.reward_settings:
                raise JmarlError(f"{self.name}: reward must be one of "
                                 f"{tuple(self.reward_settings)}, got {setting!r}")
            coefs = self.coefficients
            if not 0.0 < coefs.gamma <= 1.0:
                raise JmarlError(f"{self.name}: gamma must be in (0, 1], got {coefs.gamma}")
            if coefs.move_limit < 0:
                raise JmarlError(f"{self.name}: move_limit must be >= 0 (0: no limit), "
                                 f"got {coefs.move_limit}")

    def reset(self, seed: int) -> PuzzleState:
        """The initial state for `seed` (train/eval items are disjoint by content hash)."""
        if not isinstance(seed, int) or seed < 0:
            raise JmarlError(f"{self.name}: seed must be an int >= 0, got {seed!r}")
        puzzle = draw_split_item(self._rng_name(), seed, self._generate, self._key)
        return PuzzleState(seed=seed, puzzle=puzzle, board=self._initial_board(puzzle))

    def _rng_name(self) -> str:
        """Keys the generator RNG by the env's name and its generation options (so changing a
        reward weight or `max_turns` keeps the same puzzles)."""
        options = ",".join(f"{name}={getattr(self, name)!r}" for name in self.generation_options)
        return f"{self.name}({options})"

    def observe(self, state: PuzzleState, agent: str) -> str:
        """The prompt: (memory), task, board, turn, feedback, (planner) the tool's proposal, format."""
        self._check_agent(agent)
        if self._compact:
            return with_memory(state, agent, self._observe_compact(state, agent))
        lines = [self._instructions(), "", self._render(state.puzzle, state.board), ""]
        lines.append(f"Turn {state.turn + 1} of {self.max_turns}.")
        if state.history:
            lines.append("Previous turns: " + " | ".join(state.history[-3:]))
        if agent == "tool":
            lines.append("You are the tool agent. Propose the action, either directly or as a "
                         "```python program that reads the board from stdin and prints it.")
        else:
            if not self.single_agent:
                if state.proposal is not None:
                    proposed = self._format_action(state.proposal)
                else:
                    proposed = "(none)"
                note = f" [{state.proposal_note}]" if state.proposal_note else ""
                lines.append(f"Tool agent's proposal{note}: {proposed}")
            lines.append("You are the planner. Write the final action; it will be executed.")
        return with_memory(state, agent, "\n".join(lines))

    def _observe_compact(self, state: PuzzleState, agent: str) -> str:
        """The compact prompt (see PROMPT_STYLES); ends with "tool:" or "plan:"."""
        lines = [self._render_compact(state.puzzle, state.board)]
        turn = f"turn {state.turn + 1}/{self.max_turns}"
        if state.history:
            turn += " prev " + "|".join(h.split(": ", 1)[-1] for h in state.history[-3:])
        lines.append(turn)
        if agent == "tool":
            lines.append("tool:")
        else:
            if not self.single_agent:
                proposed = "?" if state.proposal is None else self._format_compact(state.proposal)
                lines.append(f"tool: {proposed}")
            lines.append("plan:")
        return "\n".join(lines)

    def step(self, state: PuzzleState, agent: str, text: str) -> tuple[PuzzleState, StepResult]:
        """Applies `agent`'s text (see the module docstring); never raises, never mutates."""
        self._check_agent(agent)
        if state.finished:
            return state, StepResult(0.0, 0.0, True, {"ignored": "episode already over"})
        text = clip_text(text)
        if agent == "tool":
            return self._tool_step(state, text)
        return self._planner_step(state, text)

    def _tool_step(self, state: PuzzleState, text: str) -> tuple[PuzzleState, StepResult]:
        code = extract_python(text)
        if code is not None:
            run = run_program(code, stdin=self._render(state.puzzle, state.board),
                              timeout_s=self.program_timeout_s)
            note = f"program {run.status}"
            action = self._parse_action(run.stdout) if run.status == "ok" else None
        else:
            note, action = "direct", self._parse_action(text)
        new_state = dataclasses.replace(state, proposal=action, proposal_note=note)
        info: dict = {"source": note, "action": action}
        if action is None:
            info["malformed"] = True
            return new_state, StepResult(self.coefficients.malformed_reward, 0.0, False, info)
        applied = self._apply(state.puzzle, state.board, action, state.moves)
        info.update(applied.info, would_solve=applied.solved)
        return new_state, StepResult(float(applied.local + applied.team), 0.0, False, info)

    def _planner_step(self, state: PuzzleState, text: str) -> tuple[PuzzleState, StepResult]:
        action = self._parse_action(text)
        if action is None:
            new_state = dataclasses.replace(
                state, history=state.history + (f"turn {state.turn + 1}: unparseable action",))
            return new_state, StepResult(self.coefficients.malformed_reward, 0.0, False,
                                         {"malformed": True})
        applied = self._apply(state.puzzle, state.board, action, state.moves)
        feedback = f"turn {state.turn + 1}: {self._feedback(action, applied)}"
        new_state = dataclasses.replace(
            state, board=applied.board, moves=state.moves + applied.moves,
            history=state.history + (feedback,), solved=state.solved or applied.solved,
            finished=state.finished or applied.solved or applied.failed)
        info = dict(applied.info, action=action, solved=applied.solved)
        return new_state, StepResult(float(applied.local), float(applied.team),
                                     new_state.finished, info)

    def end_turn(self, state: PuzzleState) -> PuzzleState:
        """Advances the turn, clears the proposal, ends the episode at `max_turns`."""
        turn = state.turn + 1
        return dataclasses.replace(state, turn=turn, proposal=None, proposal_note="",
                                   finished=state.finished or turn >= self.max_turns)

    def done(self, state: PuzzleState) -> bool:
        """Solved, or out of turns."""
        return state.finished

    def success(self, state: PuzzleState) -> bool:
        """Whether the puzzle is solved."""
        return state.solved

    def expert_text(self, state: PuzzleState, agent: str) -> str:
        """The solving action from the current board, written in the direct format."""
        self._check_agent(agent)
        action = self._expert_action(state.puzzle, state.board)
        if self._compact:
            return self._format_compact(action)
        return f"{self.answer_label}:\n{self._format_action(action)}"

    def _check_agent(self, agent: str) -> None:
        if agent not in self.agents:
            raise JmarlError(f"{self.name}: unknown agent {agent!r}; agents are {self.agents}")
