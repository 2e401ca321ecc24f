"""Sokoban (AT-GRPO): push every box onto a goal.

Rooms come from reverse play: boxes start on their goals and the player walks and *pulls*
boxes for `reverse_steps` random steps; every pull is a push played backwards, so every room
is solvable. A breadth-first solver then finds a shortest solution (`solution(seed)`).

Agents `tool` + `planner` (see `jmarl.envs.puzzle`); actions are moves "U D L R" like Plan-Path.
Reward of executing moves (stopping once solved), with Phi(boxes) = -sum over boxes of the
Manhattan distance to the nearest goal:
  local = sum over moves of [ -step_cost for a move that moves, or -invalid_cost for a blocked
          one (a wall, or a box against a wall or box) + box_on_goal per push onto a goal
          + box_off_goal (negative) per push off a goal
          + shaping * (gamma * Phi(boxes after) - Phi(boxes before)) ]
  team  = solved_reward if every box is on a goal; fail_reward (and the episode ends) if the
          episode's moves reach move_limit (> 0) unsolved.
The coefficients come from the `reward` setting (`SokobanRewards`, `REWARD_SETTINGS`):
"compact" (default; a blocked move costs a step, no shaping) or "pettingllms" (the AT-GRPO
paper's code); any coefficient option set overrides the setting's value.
Sizes: `size` counts the border walls; 5x5 or 6x6 with 1 box for CPU tests, 6x6 (default) in
the paper; `boxes` sets the number of boxes; rooms whose shortest solution is shorter than
`min_moves` are redrawn.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from jmarl.envs.grid import MOVES, Cell, bfs, format_moves, shift
from jmarl.envs.parsing import parse_moves
from jmarl.envs.puzzle import Applied, PuzzleEnv
from jmarl.errors import JmarlError

Board = tuple[Cell, frozenset]  # (player, boxes)
_OPPOSITE = {"U": "D", "D": "U", "L": "R", "R": "L"}


@dataclass(frozen=True)
class Room:
    """A room: walls (border included), goals, the initial boxes and player, and the length of
    a shortest solution."""

    size: int
    walls: frozenset[Cell]
    goals: frozenset[Cell]
    boxes: frozenset[Cell]
    player: Cell
    shortest: int


def push(walls: frozenset[Cell], board: Board, move: str) -> tuple[Board, Cell | None, Cell | None]:
    """One Sokoban move: (new board, box origin, box destination); the board is unchanged when
    the move is blocked (wall, or a box against a wall or another box)."""
    player, boxes = board
    nxt = shift(player, move)
    if nxt in walls:
        return board, None, None
    if nxt in boxes:
        beyond = shift(nxt, move)
        if beyond in walls or beyond in boxes:
            return board, None, None
        return (nxt, (boxes - {nxt}) | {beyond}), nxt, beyond
    return (nxt, boxes), None, None


def solve(walls: frozenset[Cell], goals: frozenset[Cell], board: Board,
          max_nodes: int = 300_000) -> tuple[str, ...] | None:
    """A shortest move sequence putting every box on a goal (breadth-first), or None."""

    def successors(b: Board):
        for move in MOVES:
            nb, _, _ = push(walls, b, move)
            if nb != b:
                yield move, nb

    return bfs(board, successors, lambda b: b[1] == goals, max_nodes=max_nodes)


def potential(goals: frozenset[Cell], boxes: frozenset[Cell]) -> int:
    """Phi = -(sum over boxes of the Manhattan distance to the nearest goal); 0 when solved."""
    return -sum(min(abs(b[0] - g[0]) + abs(b[1] - g[1]) for g in goals) for b in boxes)


@dataclass(frozen=True)
class SokobanRewards:
    """Sokoban's reward coefficients (one set per named `reward` setting).

    step_cost / invalid_cost: charged for a move that moves / for a blocked one;
    box_on_goal, box_off_goal: per push onto / off a goal;
    shaping, gamma: the box-distance term shaping * (gamma * Phi' - Phi) of every move;
    solved_reward: team term when every box is on a goal;
    malformed_reward: an action that cannot be parsed (tool or planner);
    move_limit, fail_reward: an episode whose moves reach move_limit (0: no limit) unsolved
    ends with team term fail_reward.
    """

    step_cost: float
    invalid_cost: float
    box_on_goal: float
    box_off_goal: float
    shaping: float
    gamma: float
    solved_reward: float
    malformed_reward: float
    move_limit: int
    fail_reward: float


REWARD_SETTINGS: Mapping[str, SokobanRewards] = {
    # jmarl's compact rewards: a blocked move costs what a move costs, no box-distance shaping.
    "compact": SokobanRewards(step_cost=0.01, invalid_cost=0.01, box_on_goal=1.0,
                              box_off_goal=-0.5, shaping=0.0, gamma=1.0, solved_reward=10.0,
                              malformed_reward=-0.5, move_limit=0, fail_reward=0.0),
    # PettingLLMs' SokobanGridEnvState defaults (pettingllms/multi_agent_env/stateful/
    # env_state.py: DEFAULT_* at lines 1273-1281, _potential 1507-1519, step_single 1594-1662)
    # and its agents' -2 for an action that cannot be parsed (agents/plan_agent.py:85-86,
    # agents/tool_agent.py:125-126).
    "pettingllms": SokobanRewards(step_cost=0.01, invalid_cost=0.05, box_on_goal=1.0,
                                  box_off_goal=-0.5, shaping=0.1, gamma=0.99,
                                  solved_reward=10.0, malformed_reward=-2.0, move_limit=200,
                                  fail_reward=-5.0),
}


@dataclass(frozen=True)
class Sokoban(PuzzleEnv):
    """Sokoban rooms of `size` x `size` (border included) with `boxes` boxes."""

    name: ClassVar[str] = "sokoban"
    generation_options: ClassVar[tuple[str, ...]] = ("size", "boxes", "wall_prob",
                                                     "reverse_steps", "min_moves")
    reward_settings: ClassVar[Mapping[str, SokobanRewards]] = REWARD_SETTINGS
    size: int = 6
    boxes: int = 1
    wall_prob: float = 0.15
    reverse_steps: int = 30
    min_moves: int = 3
    max_turns: int = 3
    reward: str = "compact"  # "compact" | "pettingllms": the coefficient set (REWARD_SETTINGS)
    # Coefficient overrides (None: the `reward` setting's value; see SokobanRewards).
    step_cost: float | None = None
    invalid_cost: float | None = None
    box_on_goal: float | None = None
    box_off_goal: float | None = None
    shaping: float | None = None
    gamma: float | None = None
    solved_reward: float | None = None
    malformed_reward: float | None = None
    move_limit: int | None = None
    fail_reward: float | None = None
    program_timeout_s: float = 5.0
    prompt_style: str = "full"  # "full" | "compact" (see jmarl.envs.puzzle.PROMPT_STYLES)
    single_agent: bool = False  # True: the planner alone (no tool agent), the single-agent baseline

    def __post_init__(self) -> None:
        self._check_options()
        if not 5 <= self.size <= 12:
            raise JmarlError(f"sokoban: size must be in [5, 12], got {self.size}")
        if not 1 <= self.boxes <= max(1, (self.size - 2) ** 2 // 4):
            raise JmarlError(f"sokoban: boxes={self.boxes} does not fit a {self.size}x{self.size}"
                             " room; use fewer boxes or a larger size")
        if not 0.0 <= self.wall_prob <= 0.3:
            raise JmarlError(f"sokoban: wall_prob must be in [0, 0.3], got {self.wall_prob}")

    # ---- generation ----------------------------------------------------------------------------
    def _generate(self, rng: random.Random) -> Room:
        n = self.size
        border = {(r, c) for r in range(n) for c in range(n) if r in (0, n - 1) or c in (0, n - 1)}
        interior = [(r, c) for r in range(1, n - 1) for c in range(1, n - 1)]
        while True:
            walls = frozenset(border | {cell for cell in interior if rng.random() < self.wall_prob})
            floor = [cell for cell in interior if cell not in walls]
            if len(floor) < 2 * self.boxes + 2:
                continue
            goals = frozenset(rng.sample(floor, self.boxes))
            player = rng.choice([cell for cell in floor if cell not in goals])
            boxes = set(goals)
            for _ in range(self.reverse_steps):
                move = rng.choice("UDLR")
                nxt = shift(player, move)
                if nxt in walls or nxt in boxes:
                    continue
                behind = shift(player, _OPPOSITE[move])
                if behind in boxes and rng.random() < 0.8:  # pull the box behind the player
                    boxes.remove(behind)
                    boxes.add(player)
                player = nxt
            boxes_f = frozenset(boxes)
            if boxes_f == goals:
                continue
            path = solve(walls, goals, (player, boxes_f))
            if path is not None and len(path) >= max(1, self.min_moves):
                return Room(n, walls, goals, boxes_f, player, len(path))

    def _key(self, room: Room) -> str:
        return (f"{room.size}|{sorted(room.walls)}|{sorted(room.goals)}|{sorted(room.boxes)}|"
                f"{room.player}")

    def _initial_board(self, room: Room) -> Board:
        return (room.player, room.boxes)

    # ---- text --------------------------------------------------------------------------------
    def _instructions(self) -> str:
        return ("Sokoban: push every box onto a goal. '#' wall, '.' floor, 'G' goal, 'B' box, "
                "'*' box on a goal, 'P' you, '+' you on a goal. You push a box by walking into "
                "it; you cannot pull. Moves: U (up), D (down), L (left), R (right). Answer with "
                "moves separated by spaces after 'Actions:', e.g. 'Actions: R R D'.")

    def _render(self, room: Room, board: Board) -> str:
        player, boxes = board
        rows = []
        for r in range(room.size):
            row = []
            for c in range(room.size):
                cell = (r, c)
                goal = cell in room.goals
                if cell in room.walls:
                    row.append("#")
                elif cell in boxes:
                    row.append("*" if goal else "B")
                elif cell == player:
                    row.append("+" if goal else "P")
                else:
                    row.append("G" if goal else ".")
            rows.append(" ".join(row))
        on = len(boxes & room.goals)
        rows.append(f"P is at row {player[0]}, column {player[1]}; {on} of {len(boxes)} boxes "
                    "on goals.")
        return "\n".join(rows)

    def _render_compact(self, room: Room, board: Board) -> str:
        """Rows without spaces (the sentence under the board is left out)."""
        return "\n".join(r.replace(" ", "") for r in self._render(room, board).split("\n")[: room.size])

    def _format_compact(self, action: tuple[str, ...]) -> str:
        return "".join(action)

    def _parse_action(self, text: str) -> tuple[str, ...] | None:
        return parse_moves(text, max_moves=4 * self.size * self.size)

    def _format_action(self, action: tuple[str, ...]) -> str:
        return format_moves(action)

    # ---- dynamics and reward -------------------------------------------------------------------
    def _apply(self, room: Room, board: Board, action: tuple[str, ...],
               moves_so_far: int) -> Applied:
        k = self.coefficients
        local, made, on, off, blocked, costs, shaping, failed = 0.0, 0, 0, 0, 0, 0.0, 0.0, False
        for move in action:
            if board[1] == room.goals:
                break
            made += 1
            new_board, src, dst = push(room.walls, board, move)
            cost = k.invalid_cost if new_board == board else k.step_cost
            blocked += new_board == board
            local -= cost
            costs -= cost
            if dst is not None:
                if dst in room.goals and src not in room.goals:
                    on += 1
                    local += k.box_on_goal
                elif src in room.goals and dst not in room.goals:
                    off += 1
                    local += k.box_off_goal
            term = k.shaping * (k.gamma * potential(room.goals, new_board[1])
                                - potential(room.goals, board[1]))
            local += term
            shaping += term
            board = new_board
            if k.move_limit and board[1] != room.goals and moves_so_far + made >= k.move_limit:
                failed = True  # PettingLLMs' timeout failure (steps >= max_steps, unsolved)
                break
        solved = board[1] == room.goals
        team = k.fail_reward if failed else k.solved_reward if solved else 0.0
        info = {"moves": made, "blocked": blocked, "pushed_on": on, "pushed_off": off,
                "failed": failed, "step_cost": costs, "shaping": shaping,
                "box_terms": on * k.box_on_goal + off * k.box_off_goal}
        return Applied(board, made, local, team, solved, info, failed)

    def _expert_action(self, room: Room, board: Board) -> tuple[str, ...]:
        return solve(room.walls, room.goals, board) or ()

    def solution(self, seed: int) -> tuple[str, ...]:
        """A shortest move sequence solving `seed`'s room."""
        state = self.reset(seed)
        return self._expert_action(state.puzzle, state.board)
