"""Sokoban (AT-GRPO): push every box onto a goal.

Rooms come from reverse play: boxes start on their goals and the player walks and *pulls*
boxes for `reverse_steps` random steps; every pull is a push played backwards, so every room
is solvable. A breadth-first solver then finds a shortest solution (`solution(seed)`).

Agents `tool` + `planner` (see `jmarl.envs.puzzle`); actions are moves "U D L R" like Plan-Path.
Reward of executing moves (stopping once solved); a blocked move still costs its step:
  local = -step_cost per move + box_on_goal per push onto a goal + box_off_goal (negative) per
          push off a goal
  team  = solved_reward if every box is on a goal.
Sizes: `size` counts the border walls; 5x5 or 6x6 with 1 box for CPU tests, 6x6 (default) in
the paper; `boxes` sets the number of boxes; rooms whose shortest solution is shorter than
`min_moves` are redrawn.
"""

from __future__ import annotations

import random
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


@dataclass(frozen=True)
class Sokoban(PuzzleEnv):
    """Sokoban rooms of `size` x `size` (border included) with `boxes` boxes."""

    name: ClassVar[str] = "sokoban"
    generation_options: ClassVar[tuple[str, ...]] = ("size", "boxes", "wall_prob",
                                                     "reverse_steps", "min_moves")
    size: int = 6
    boxes: int = 1
    wall_prob: float = 0.15
    reverse_steps: int = 30
    min_moves: int = 3
    max_turns: int = 3
    step_cost: float = 0.01
    box_on_goal: float = 1.0
    box_off_goal: float = -0.5
    solved_reward: float = 10.0
    malformed_reward: float = -0.5
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
        local, made, on, off, blocked = 0.0, 0, 0, 0, 0
        for move in action:
            if board[1] == room.goals:
                break
            made += 1
            local -= self.step_cost
            new_board, src, dst = push(room.walls, board, move)
            blocked += new_board == board
            if dst is not None:
                if dst in room.goals and src not in room.goals:
                    on += 1
                    local += self.box_on_goal
                elif src in room.goals and dst not in room.goals:
                    off += 1
                    local += self.box_off_goal
            board = new_board
        solved = board[1] == room.goals
        team = self.solved_reward if solved else 0.0
        info = {"moves": made, "blocked": blocked, "pushed_on": on, "pushed_off": off,
                "step_cost": -self.step_cost * made, "box_terms": on * self.box_on_goal
                + off * self.box_off_goal}
        return Applied(board, made, local, team, solved, info)

    def _expert_action(self, room: Room, board: Board) -> tuple[str, ...]:
        return solve(room.walls, room.goals, board) or ()

    def solution(self, seed: int) -> tuple[str, ...]:
        """A shortest move sequence solving `seed`'s room."""
        state = self.reset(seed)
        return self._expert_action(state.puzzle, state.board)
