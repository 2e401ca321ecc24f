"""Plan-Path (AT-GRPO): move from the start to the goal on a grid with walls.

Agents `tool` + `planner` (see `jmarl.envs.puzzle`). Actions: moves "U D L R" (also "up,
right", a JSON list, "URRD"), optionally after "Actions:". Reward of executing moves m_1..m_k
from cell p_0 (stopping at the goal), with Phi(p) = -d(p), d the Manhattan distance to the goal:
  local = sum_i [ -cost_i + shaping * (gamma * Phi(p_i) - Phi(p_{i-1})) ]
          cost_i = step_cost for a move that moves, invalid_cost for one into a wall or the
          border (which stays put, p_i = p_{i-1})
  team  = goal_reward if the goal is reached, + shortest_bonus if the total number of moves of
          the episode equals the BFS shortest-path length; fail_reward (and the episode ends)
          if the episode's moves reach move_limit (> 0) without reaching the goal.
The coefficients come from the `reward` setting (`PathRewards`, `REWARD_SETTINGS`): "compact"
(default; gamma 1, so the shaping is shaping * (d(p_{i-1}) - d(p_i))) or "pettingllms" (the
AT-GRPO paper's code); any coefficient option set overrides the setting's value.
Sizes: `size=5` (CPU tests, default) to `size=10` (the paper).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from jmarl.envs.grid import MOVES, Cell, bfs, format_moves, manhattan, shift
from jmarl.envs.parsing import parse_moves
from jmarl.envs.puzzle import Applied, PuzzleEnv
from jmarl.errors import JmarlError


@dataclass(frozen=True)
class PathPuzzle:
    """A grid of `size` x `size` cells, its walls, start, goal and shortest-path length."""

    size: int
    walls: frozenset[Cell]
    start: Cell
    goal: Cell
    shortest: int


@dataclass(frozen=True)
class PathRewards:
    """Plan-Path's reward coefficients (one set per named `reward` setting).

    step_cost / invalid_cost: charged for a move that moves / for one into a wall or the border;
    shaping, gamma: the shaping term shaping * (gamma * Phi(p') - Phi(p)), Phi = -distance;
    goal_reward, shortest_bonus: team terms on reaching the goal (in the fewest moves);
    malformed_reward: an action that cannot be parsed (tool or planner);
    move_limit, fail_reward: an episode whose moves reach move_limit (0: no limit) unsolved
    ends with team term fail_reward.
    """

    step_cost: float
    invalid_cost: float
    shaping: float
    gamma: float
    goal_reward: float
    shortest_bonus: float
    malformed_reward: float
    move_limit: int
    fail_reward: float


REWARD_SETTINGS: Mapping[str, PathRewards] = {
    # jmarl's compact rewards: a bump costs what a move costs, undiscounted shaping 0.1.
    "compact": PathRewards(step_cost=0.01, invalid_cost=0.01, shaping=0.1, gamma=1.0,
                           goal_reward=1.0, shortest_bonus=0.5, malformed_reward=-0.5,
                           move_limit=0, fail_reward=0.0),
    # PettingLLMs' PlanPathGridEnvState defaults (pettingllms/multi_agent_env/stateful/
    # env_state.py: DEFAULT_* at lines 903-910, step_single 1159-1214) and its agents' -2 for
    # an action that cannot be parsed (agents/plan_agent.py:85-86, agents/tool_agent.py:125-126).
    "pettingllms": PathRewards(step_cost=0.01, invalid_cost=0.1, shaping=1.0, gamma=0.99,
                               goal_reward=1.0, shortest_bonus=0.5, malformed_reward=-2.0,
                               move_limit=10_000, fail_reward=-1.0),
}


@dataclass(frozen=True)
class PlanPath(PuzzleEnv):
    """Plan-Path with `size` x `size` grids whose cells are walls with probability `wall_prob`."""

    name: ClassVar[str] = "plan_path"
    generation_options: ClassVar[tuple[str, ...]] = ("size", "wall_prob")
    reward_settings: ClassVar[Mapping[str, PathRewards]] = REWARD_SETTINGS
    size: int = 5
    wall_prob: float = 0.25
    max_turns: int = 3
    reward: str = "compact"  # "compact" | "pettingllms": the coefficient set (REWARD_SETTINGS)
    # Coefficient overrides (None: the `reward` setting's value; see PathRewards).
    step_cost: float | None = None
    invalid_cost: float | None = None
    shaping: float | None = None
    gamma: float | None = None
    goal_reward: float | None = None
    shortest_bonus: float | None = None
    malformed_reward: float | None = None
    move_limit: int | None = None
    fail_reward: float | None = None
    program_timeout_s: float = 5.0
    prompt_style: str = "full"  # "full" | "compact" (see jmarl.envs.puzzle.PROMPT_STYLES)
    single_agent: bool = False  # True: the planner alone (no tool agent), the single-agent baseline

    def __post_init__(self) -> None:
        self._check_options()
        if not 3 <= self.size <= 30:
            raise JmarlError(f"plan_path: size must be in [3, 30], got {self.size}")
        if not 0.0 <= self.wall_prob <= 0.5:
            raise JmarlError(f"plan_path: wall_prob must be in [0, 0.5], got {self.wall_prob}")

    # ---- generation ----------------------------------------------------------------------------
    def _generate(self, rng: random.Random) -> PathPuzzle:
        n = self.size
        cells = [(r, c) for r in range(n) for c in range(n)]
        while True:
            walls = frozenset(cell for cell in cells if rng.random() < self.wall_prob)
            free = [cell for cell in cells if cell not in walls]
            start, goal = rng.sample(free, 2)
            path = self._path(n, walls, start, goal)
            if path is not None and len(path) >= 2:
                return PathPuzzle(n, walls, start, goal, len(path))

    @staticmethod
    def _path(n: int, walls: frozenset[Cell], start: Cell, goal: Cell) -> tuple[str, ...] | None:
        def successors(cell: Cell):
            for move in MOVES:
                nxt = shift(cell, move)
                if 0 <= nxt[0] < n and 0 <= nxt[1] < n and nxt not in walls:
                    yield move, nxt

        return bfs(start, successors, lambda cell: cell == goal)

    def _key(self, puzzle: PathPuzzle) -> str:
        return f"{puzzle.size}|{sorted(puzzle.walls)}|{puzzle.start}|{puzzle.goal}"

    def _initial_board(self, puzzle: PathPuzzle) -> Cell:
        return puzzle.start

    # ---- text --------------------------------------------------------------------------------
    def _instructions(self) -> str:
        return ("Plan-Path: move A to the goal G. '#' is a wall, '.' is free. Moves: U (up), "
                "D (down), L (left), R (right). Answer with moves separated by spaces after "
                "'Actions:', e.g. 'Actions: R R D'.")

    def _render(self, puzzle: PathPuzzle, board: Cell) -> str:
        rows = []
        for r in range(puzzle.size):
            row = []
            for c in range(puzzle.size):
                cell = (r, c)
                row.append("A" if cell == board else "G" if cell == puzzle.goal
                           else "#" if cell in puzzle.walls else ".")
            rows.append(" ".join(row))
        rows.append(f"A is at row {board[0]}, column {board[1]}; G is at row {puzzle.goal[0]}, "
                    f"column {puzzle.goal[1]}.")
        return "\n".join(rows)

    def _render_compact(self, puzzle: PathPuzzle, board: Cell) -> str:
        """Rows without spaces, then "A<row>,<col> G<row>,<col>"."""
        rows = self._render(puzzle, board).split("\n")[: puzzle.size]
        return "\n".join(r.replace(" ", "") for r in rows) + (
            f"\nA{board[0]},{board[1]} G{puzzle.goal[0]},{puzzle.goal[1]}")

    def _format_compact(self, action: tuple[str, ...]) -> str:
        return "".join(action)

    def _parse_action(self, text: str) -> tuple[str, ...] | None:
        return parse_moves(text, max_moves=4 * self.size * self.size)

    def _format_action(self, action: tuple[str, ...]) -> str:
        return format_moves(action)

    # ---- dynamics and reward -------------------------------------------------------------------
    def _apply(self, puzzle: PathPuzzle, board: Cell, action: tuple[str, ...],
               moves_so_far: int) -> Applied:
        k = self.coefficients
        pos, local, made, bumps, costs, shaping, failed = board, 0.0, 0, 0, 0.0, 0.0, False
        for move in action:
            if pos == puzzle.goal:
                break
            made += 1
            nxt = shift(pos, move)
            phi = -manhattan(pos, puzzle.goal)  # Phi(p_{i-1})
            if 0 <= nxt[0] < puzzle.size and 0 <= nxt[1] < puzzle.size and nxt not in puzzle.walls:
                pos, cost = nxt, k.step_cost
            else:
                bumps, cost = bumps + 1, k.invalid_cost
            term = k.shaping * (k.gamma * -manhattan(pos, puzzle.goal) - phi)
            local += -cost + term
            costs, shaping = costs - cost, shaping + term
            if k.move_limit and pos != puzzle.goal and moves_so_far + made >= k.move_limit:
                failed = True  # PettingLLMs' timeout failure (steps >= max_steps, unsolved)
                break
        reached = pos == puzzle.goal
        shortest = reached and moves_so_far + made == puzzle.shortest
        team = (k.goal_reward + (k.shortest_bonus if shortest else 0.0)) if reached else 0.0
        if failed:
            team = k.fail_reward
        info = {"moves": made, "bumps": bumps, "reached": reached, "shortest": shortest,
                "failed": failed, "step_cost": costs, "shaping": shaping}
        return Applied(pos, made, local, team, reached, info, failed)

    def _expert_action(self, puzzle: PathPuzzle, board: Cell) -> tuple[str, ...]:
        return self._path(puzzle.size, puzzle.walls, board, puzzle.goal) or ()

    def solution(self, seed: int) -> tuple[str, ...]:
        """A shortest move sequence from the start of `seed`'s grid to its goal."""
        state = self.reset(seed)
        return self._expert_action(state.puzzle, state.puzzle.start)
