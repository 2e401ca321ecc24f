"""Grid helpers for the move-based puzzles: directions, breadth-first search, move formatting.

Cells are (row, col) tuples; row 0 is the top. "U" decreases the row, "R" increases the column.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable

Cell = tuple[int, int]
MOVES: dict[str, Cell] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}


def shift(cell: Cell, move: str, times: int = 1) -> Cell:
    """`cell` moved `times` steps in direction `move`."""
    dr, dc = MOVES[move]
    return cell[0] + times * dr, cell[1] + times * dc


def manhattan(a: Cell, b: Cell) -> int:
    """|dr| + |dc|."""
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def bfs(start: Hashable, successors: Callable[[Hashable], Iterable[tuple[str, Hashable]]],
        is_goal: Callable[[Hashable], bool], max_nodes: int = 500_000) -> tuple[str, ...] | None:
    """A shortest move sequence from `start` to a goal state, or None (unreachable or more than
    `max_nodes` states visited). `successors(s)` yields (move, next_state)."""
    if is_goal(start):
        return ()
    parent: dict = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for move, nxt in successors(node):
            if nxt in parent:
                continue
            parent[nxt] = (node, move)
            if is_goal(nxt):
                path = []
                while parent[nxt] is not None:
                    nxt, move = parent[nxt]
                    path.append(move)
                return tuple(reversed(path))
            if len(parent) > max_nodes:
                return None
            queue.append(nxt)
    return None


def format_moves(moves: Iterable[str]) -> str:
    """("U", "R") -> "U R"."""
    return " ".join(moves)
