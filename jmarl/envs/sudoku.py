"""Sudoku 4x4 and 9x9 (AT-GRPO) with a generator that guarantees a unique solution.

Generation: a random solution grid (a base pattern shuffled by bands, rows within bands,
stacks, columns within stacks and a digit permutation), then cells are blanked in random order,
each blank kept only if a solution counter still finds exactly one solution, until `givens`
cells remain (or no further cell can be blanked).

Agents `tool` + `planner` (see `jmarl.envs.puzzle`). The action is a whole grid: n lines of n
digits (0 or '.' for a blank; spaces, '|' and ',' ignored), or a JSON list of lists. The
submitted grid becomes the board. Reward of submitting grid S on board B:
  local = progress_weight * (correct(S) - correct(B)) / blanks     correct = blank cells of the
          - conflict_penalty * conflicts(S)                         puzzle holding the solution
          - given_penalty * (givens of the puzzle changed in S)     digit; conflicts = repeated
  team  = solved_reward if S is solved                             digits summed over all units
A grid is solved when it is complete, every row/column/box holds each digit once, and every
given digit of the puzzle was kept (a valid grid that changed a given does not count).
Unparseable text: `malformed_reward` (< 0). Sizes: `size=4` (default, CPU) or `size=9`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import ClassVar

from jmarl.envs.parsing import parse_grid
from jmarl.envs.puzzle import Applied, PuzzleEnv
from jmarl.errors import JmarlError

Grid = tuple[tuple[int, ...], ...]  # [n][n], 0 = blank


@dataclass(frozen=True)
class SudokuPuzzle:
    """The puzzle's given digits (0 = blank) and its unique solution, both [n][n]."""

    givens: Grid
    solution: Grid


def count_solutions(grid: Grid, limit: int = 2) -> int:
    """The number of solutions of `grid` ([n][n], 0 = blank), counting stops at `limit`."""
    n = len(grid)
    box = math.isqrt(n)
    rows, cols, boxes = [0] * n, [0] * n, [0] * n
    empties = []
    for r in range(n):
        for c in range(n):
            v = grid[r][c]
            b = (r // box) * box + c // box
            if v:
                bit = 1 << v
                if (rows[r] | cols[c] | boxes[b]) & bit:
                    return 0
                rows[r] |= bit
                cols[c] |= bit
                boxes[b] |= bit
            else:
                empties.append((r, c, b))
    full = sum(1 << d for d in range(1, n + 1))
    found = 0

    def search(remaining: list) -> None:
        nonlocal found
        if not remaining:
            found += 1
            return
        # the blank with the fewest candidates (minimum remaining values)
        best_i, best_mask, best_count = -1, 0, n + 1
        for i, (r, c, b) in enumerate(remaining):
            mask = full & ~(rows[r] | cols[c] | boxes[b])
            count = mask.bit_count()
            if count < best_count:
                best_i, best_mask, best_count = i, mask, count
                if count <= 1:
                    break
        if best_count == 0:
            return
        r, c, b = remaining[best_i]
        rest = remaining[:best_i] + remaining[best_i + 1:]
        mask = best_mask
        while mask and found < limit:
            bit = mask & -mask
            mask ^= bit
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            search(rest)
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit

    search(empties)
    return found


def conflicts(grid: Grid) -> int:
    """Repeated digits: sum over rows, columns and boxes of (count of a digit - 1) for each
    digit that occurs more than once (blanks ignored)."""
    n = len(grid)
    box = math.isqrt(n)
    units = [list(row) for row in grid]
    units += [[grid[r][c] for r in range(n)] for c in range(n)]
    units += [[grid[br + r][bc + c] for r in range(box) for c in range(box)]
              for br in range(0, n, box) for bc in range(0, n, box)]
    total = 0
    for unit in units:
        digits = [v for v in unit if v]
        total += len(digits) - len(set(digits))
    return total


def is_solved(givens: Grid, grid: Grid) -> bool:
    """Complete, no repeated digit in any unit, and every given digit kept."""
    n = len(givens)
    complete = all(1 <= v <= n for row in grid for v in row)
    kept = all(g == 0 or g == v for grow, row in zip(givens, grid) for g, v in zip(grow, row))
    return complete and kept and conflicts(grid) == 0


@dataclass(frozen=True)
class Sudoku(PuzzleEnv):
    """Sudoku of `size` 4 or 9 with `givens` given digits (0: 8 for 4x4, 34 for 9x9)."""

    name: ClassVar[str] = "sudoku"
    generation_options: ClassVar[tuple[str, ...]] = ("size", "target_givens")
    answer_label: ClassVar[str] = "Grid"
    size: int = 4
    givens: int = 0
    max_turns: int = 3
    progress_weight: float = 1.0
    conflict_penalty: float = 0.1
    given_penalty: float = 0.2
    solved_reward: float = 2.0
    malformed_reward: float = -0.5
    program_timeout_s: float = 5.0
    prompt_style: str = "full"  # "full" | "compact" (see jmarl.envs.puzzle.PROMPT_STYLES)
    single_agent: bool = False  # True: the planner alone (no tool agent), the single-agent baseline

    def __post_init__(self) -> None:
        self._check_options()
        if self.size not in (4, 9):
            raise JmarlError(f"sudoku: size must be 4 or 9, got {self.size}")
        if self.givens and not 1 <= self.givens < self.size * self.size:
            raise JmarlError(f"sudoku: givens must be in [1, {self.size ** 2}), got {self.givens}")

    @property
    def target_givens(self) -> int:
        """How many given digits a generated puzzle keeps (at least; uniqueness may need more)."""
        return self.givens or {4: 8, 9: 34}[self.size]

    # ---- generation ----------------------------------------------------------------------------
    def _generate(self, rng: random.Random) -> SudokuPuzzle:
        n, box = self.size, math.isqrt(self.size)

        def shuffled(xs) -> list:
            xs = list(xs)
            rng.shuffle(xs)
            return xs

        rows = [g * box + r for g in shuffled(range(box)) for r in shuffled(range(box))]
        cols = [g * box + c for g in shuffled(range(box)) for c in shuffled(range(box))]
        digits = shuffled(range(1, n + 1))
        solution = tuple(tuple(digits[(box * (r % box) + r // box + c) % n] for c in cols)
                         for r in rows)
        cells = [list(row) for row in solution]
        kept = n * n
        for idx in shuffled(range(n * n)):
            if kept <= self.target_givens:
                break
            r, c = divmod(idx, n)
            value, cells[r][c] = cells[r][c], 0
            if count_solutions(tuple(map(tuple, cells))) == 1:
                kept -= 1
            else:
                cells[r][c] = value
        return SudokuPuzzle(tuple(map(tuple, cells)), solution)

    def _key(self, puzzle: SudokuPuzzle) -> str:
        return "".join(str(v) for row in puzzle.givens for v in row)

    def _initial_board(self, puzzle: SudokuPuzzle) -> Grid:
        return puzzle.givens

    # ---- text --------------------------------------------------------------------------------
    def _instructions(self) -> str:
        n, box = self.size, math.isqrt(self.size)
        return (f"Sudoku {n}x{n}: replace every 0 so that each row, column and {box}x{box} box "
                f"holds the digits 1-{n} once. Keep the given digits. Answer with the whole "
                f"grid after 'Grid:', one row per line, digits separated by spaces.")

    def _render(self, puzzle: SudokuPuzzle, board: Grid) -> str:
        text = "\n".join(" ".join(str(v) for v in row) for row in board)
        if board != puzzle.givens:
            givens = "\n".join(" ".join(str(v) for v in row) for row in puzzle.givens)
            text = f"Current grid:\n{text}\nGiven digits:\n{givens}"
        return text

    def _parse_action(self, text: str) -> Grid | None:
        return parse_grid(text, self.size)

    def _format_action(self, action: Grid) -> str:
        return "\n".join(" ".join(str(v) for v in row) for row in action)

    # ---- reward --------------------------------------------------------------------------------
    def _apply(self, puzzle: SudokuPuzzle, board: Grid, action: Grid,
               moves_so_far: int) -> Applied:
        n = self.size
        grid = tuple(tuple(v if 1 <= v <= n else 0 for v in row) for row in action)
        cells = [(r, c) for r in range(n) for c in range(n)]
        blank = [(r, c) for r, c in cells if puzzle.givens[r][c] == 0]

        def correct(g: Grid) -> int:
            return sum(g[r][c] == puzzle.solution[r][c] for r, c in blank)

        changed = sum(puzzle.givens[r][c] not in (0, grid[r][c]) for r, c in cells)
        n_conflicts = conflicts(grid)
        progress = self.progress_weight * (correct(grid) - correct(board)) / max(1, len(blank))
        solved = is_solved(puzzle.givens, grid)
        local = progress - self.conflict_penalty * n_conflicts - self.given_penalty * changed
        info = {"progress": progress, "conflicts": n_conflicts, "changed_givens": changed,
                "filled": sum(v != 0 for row in grid for v in row)}
        return Applied(grid, 1, local, self.solved_reward if solved else 0.0, solved, info)

    def _feedback(self, action: Grid, applied: Applied) -> str:
        info = applied.info
        return (f"grid with {info['filled']} filled cells, {info['conflicts']} conflicts, "
                f"{info['changed_givens']} given digits changed"
                + (" (solved)" if applied.solved else ""))

    def _expert_action(self, puzzle: SudokuPuzzle, board: Grid) -> Grid:
        return puzzle.solution

    def solution(self, seed: int) -> Grid:
        """The unique solution of `seed`'s puzzle."""
        return self.reset(seed).puzzle.solution
