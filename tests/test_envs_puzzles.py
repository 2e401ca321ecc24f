"""Plan-Path, Sokoban and Sudoku: generators, solvers and hand-computed rewards."""

import dataclasses
import itertools

import pytest

from jmarl import JmarlError
from jmarl.envs import eval_seed, make
from jmarl.envs.grid import MOVES, shift
from jmarl.envs.plan_path import PathPuzzle
from jmarl.envs.puzzle import PuzzleState
from jmarl.envs.sokoban import Room, push
from jmarl.envs.sudoku import SudokuPuzzle, conflicts, count_solutions, is_solved

# ---- Plan-Path -----------------------------------------------------------------------------------

# 4x4 grid, wall at (1,1), start (0,0), goal (2,2); shortest path length 4.
#   A . . .
#   . # . .
#   . . G .
#   . . . .
PATH = PathPuzzle(4, frozenset({(1, 1)}), (0, 0), (2, 2), 4)


def path_state(**kw):
    return PuzzleState(seed=0, puzzle=PATH, board=PATH.start, **kw)


def test_plan_path_shortest_reward():
    env = make("plan_path", size=4)
    state, r = env.step(path_state(), "planner", "Actions: R R D D")
    # 4 moves, each -0.01 and Manhattan 4 -> 3 -> 2 -> 1 -> 0, each +0.1 * 1:
    # local = 4 * (-0.01 + 0.1) = 0.36; team = goal 1 + shortest 0.5 = 1.5
    assert r.local_reward == pytest.approx(0.36) and r.team_reward == pytest.approx(1.5)
    assert r.done and env.success(state) and state.board == (2, 2) and state.moves == 4


def test_plan_path_detour_bump_and_partial():
    env = make("plan_path", size=4)
    # U bumps the border (stays at (0,0), d=4): -0.01; D (1,0) d=3: -0.01+0.1;
    # R bumps the wall (1,1): -0.01; D (2,0) d=2: -0.01+0.1; R (2,1) d=1: -0.01+0.1;
    # R (2,2) goal d=0: -0.01+0.1; the trailing L is ignored (goal reached).
    # local = 6 * -0.01 + 4 * 0.1 = 0.34; team = 1 (6 moves != shortest 4, no bonus)
    state, r = env.step(path_state(), "planner", "U D R D R R L")
    assert r.local_reward == pytest.approx(0.34) and r.team_reward == pytest.approx(1.0)
    assert r.info["bumps"] == 2 and r.info["moves"] == 6 and not r.info["shortest"]
    # Moving away: L bumps (d=4) then D (1,0) d=3 then U back (0,0) d=4:
    # local = 3 * -0.01 + 0.1 * (4 - 3) + 0.1 * (3 - 4) = -0.03; team 0; not done.
    state, r = env.step(path_state(), "planner", "L D U")
    assert r.local_reward == pytest.approx(-0.03) and r.team_reward == 0.0 and not r.done
    assert state.board == (0, 0) and state.moves == 3


def test_plan_path_shortest_counts_moves_over_turns():
    env = make("plan_path", size=4)
    state, _ = env.step(path_state(), "planner", "R R")  # turn 1: 2 moves
    state = env.end_turn(state)
    state, r = env.step(state, "planner", "D D")  # turn 2: 2 moves; total 4 = shortest
    # local = 2 * (-0.01 + 0.1) = 0.18; team = 1 + 0.5
    assert r.local_reward == pytest.approx(0.18) and r.team_reward == pytest.approx(1.5)
    state2, _ = env.step(path_state(), "planner", "U R R")  # bump, 2 moves: 3 so far
    state2 = env.end_turn(state2)
    _, r = env.step(state2, "planner", "D D")  # 5 moves in all: no shortest bonus
    assert r.team_reward == pytest.approx(1.0)


def test_plan_path_tool_scores_its_proposal_and_planner_sees_it():
    env = make("plan_path", size=4)
    state = path_state()
    after, r = env.step(state, "tool", "R R D D")
    # The proposal is not executed: board unchanged; local = what executing it would earn
    # (0.36 + 1.5 = 1.86); team 0.
    assert after.board == (0, 0) and after.proposal == ("R", "R", "D", "D")
    assert r.local_reward == pytest.approx(1.86) and r.team_reward == 0.0 and not r.done
    assert "Tool agent's proposal [direct]: R R D D" in env.observe(after, "planner")
    _, bad = env.step(state, "tool", "no idea")
    assert bad.local_reward == env.coefficients.malformed_reward == -0.5 and bad.info["malformed"]
    _, bad = env.step(state, "planner", "")
    assert bad.local_reward == -0.5 and bad.team_reward == 0.0


def test_plan_path_episode_ends_at_max_turns():
    env = make("plan_path", size=4, max_turns=2)
    state = path_state()
    for _ in range(2):
        assert not env.done(state)
        state, _ = env.step(state, "tool", "U")
        state, _ = env.step(state, "planner", "U")
        state = env.end_turn(state)
    assert env.done(state) and not env.success(state)
    _, r = env.step(state, "planner", "R R D D")  # after the end: no effect, reward 0
    assert r.local_reward == 0.0 and r.done


def _walk(puzzle, moves):
    pos = puzzle.start
    for m in moves:
        nxt = shift(pos, m)
        assert 0 <= nxt[0] < puzzle.size and 0 <= nxt[1] < puzzle.size
        assert nxt not in puzzle.walls
        pos = nxt
    return pos


def _brute_force_distance(puzzle):
    """Shortest path by iterative deepening over all move strings (independent of bfs)."""
    frontier = {puzzle.start}
    for depth in itertools.count():
        if puzzle.goal in frontier:
            return depth
        frontier = {shift(p, m) for p in frontier for m in MOVES
                    if 0 <= shift(p, m)[0] < puzzle.size and 0 <= shift(p, m)[1] < puzzle.size
                    and shift(p, m) not in puzzle.walls} | frontier


@pytest.mark.parametrize("size", [5, 10])
def test_plan_path_solution_is_shortest(size):
    env = make("plan_path", size=size)
    for seed in list(range(20)) + [eval_seed(0)]:
        puzzle = env.reset(seed).puzzle
        path = env.solution(seed)
        assert _walk(puzzle, path) == puzzle.goal
        assert len(path) == puzzle.shortest == _brute_force_distance(puzzle)
        assert puzzle.start not in puzzle.walls and puzzle.goal not in puzzle.walls


def test_plan_path_bad_options():
    with pytest.raises(JmarlError, match="size"):
        make("plan_path", size=2)
    with pytest.raises(JmarlError, match="bad options"):
        make("plan_path", colour="red")


# ---- Sokoban -------------------------------------------------------------------------------------

def _room(boxes, goals, player):
    n = 5
    walls = frozenset((r, c) for r in range(n) for c in range(n) if r in (0, 4) or c in (0, 4))
    return Room(n, walls, frozenset(goals), frozenset(boxes), player, 1)


def _sokoban_state(room):
    return PuzzleState(seed=0, puzzle=room, board=(room.player, room.boxes))


def test_sokoban_push_onto_goal_solves():
    #  # # # # #
    #  # . . . #
    #  # P B G #      player (2,1), box (2,2), goal (2,3)
    env = make("sokoban", size=5)
    state, r = env.step(_sokoban_state(_room({(2, 2)}, {(2, 3)}, (2, 1))), "planner", "R")
    # one move -0.01, box onto a goal +1 -> local 0.99; solved -> team 10
    assert r.local_reward == pytest.approx(0.99) and r.team_reward == pytest.approx(10.0)
    assert r.done and env.success(state) and state.board == ((2, 2), frozenset({(2, 3)}))


def test_sokoban_push_off_goal_and_blocked_moves():
    env = make("sokoban", size=5)
    # two goals (2,2) and (1,2); one box on (2,2), the other at (3,2) (not on a goal).
    room = _room({(2, 2), (3, 3)}, {(2, 2), (1, 2)}, (2, 1))
    # L: wall at (2,0), blocked: -0.01. R: pushes the box off its goal to (2,3): -0.01 - 0.5.
    # R: box (2,3) against the wall (2,4): blocked -0.01.
    # local = -0.03 - 0.5 = -0.53; team 0
    state, r = env.step(_sokoban_state(room), "planner", "L R R")
    assert r.local_reward == pytest.approx(-0.53) and r.team_reward == 0.0
    assert r.info["blocked"] == 2 and r.info["pushed_off"] == 1
    assert state.board == ((2, 2), frozenset({(2, 3), (3, 3)}))
    # a box cannot push another box: player (2,1), boxes (2,2) and (2,3)
    board = ((2, 1), frozenset({(2, 2), (2, 3)}))
    assert push(room.walls, board, "R") == (board, None, None)


@pytest.mark.parametrize("options", [{"size": 5}, {"size": 6}, {"size": 6, "boxes": 2}])
def test_sokoban_rooms_solvable_and_solutions_replay(options):
    env = make("sokoban", **options)
    for seed in list(range(25)) + [eval_seed(1)]:
        state = env.reset(seed)
        room = state.puzzle
        assert room.boxes != room.goals and len(room.boxes) == env.boxes
        assert room.player not in room.walls | room.boxes
        moves = env.solution(seed)
        assert len(moves) == room.shortest >= env.min_moves
        board = state.board
        for m in moves:
            board, _, _ = push(room.walls, board, m)
        assert board[1] == room.goals


def test_sokoban_bad_options():
    with pytest.raises(JmarlError, match="boxes"):
        make("sokoban", size=5, boxes=9)


# ---- Sudoku --------------------------------------------------------------------------------------

SOLUTION = ((1, 2, 3, 4), (3, 4, 1, 2), (2, 1, 4, 3), (4, 3, 2, 1))
GIVENS = ((1, 0, 0, 4), (0, 4, 1, 0), (2, 0, 0, 3), (0, 3, 2, 0))  # 8 givens, 8 blanks


def _sudoku_state(board=GIVENS):
    return PuzzleState(seed=0, puzzle=SudokuPuzzle(GIVENS, SOLUTION), board=board)


def _text(grid):
    return "\n".join(" ".join(map(str, row)) for row in grid)


def test_sudoku_solver_and_checks():
    assert count_solutions(GIVENS) == 1
    assert count_solutions(((0,) * 4,) * 4, limit=1000) == 288  # all 4x4 sudoku grids
    assert conflicts(SOLUTION) == 0
    # row 0 = 1 1 3 4: one repeat in the row, one in the top-left box -> 2
    assert conflicts(((1, 1, 3, 4), (0,) * 4, (0,) * 4, (0,) * 4)) == 2
    assert is_solved(GIVENS, SOLUTION)
    swapped = tuple(tuple({1: 2, 2: 1}.get(v, v) for v in row) for row in SOLUTION)
    assert conflicts(swapped) == 0 and not is_solved(GIVENS, swapped)  # valid, givens changed


def test_sudoku_rewards():
    env = make("sudoku")
    # the solution: progress 8/8 = 1, no conflicts, no changed givens -> local 1; team 2
    state, r = env.step(_sudoku_state(), "planner", "Grid:\n" + _text(SOLUTION))
    assert r.local_reward == pytest.approx(1.0) and r.team_reward == 2.0 and env.success(state)
    # half the blanks right, the rest left 0: progress 4/8 = 0.5 -> local 0.5; team 0
    half = ((1, 2, 3, 4), (3, 4, 1, 2), (2, 0, 0, 3), (0, 3, 2, 0))
    state, r = env.step(_sudoku_state(), "planner", _text(half))
    assert r.local_reward == pytest.approx(0.5) and r.team_reward == 0.0 and not r.done
    # from `half`, a submission with one blank wrong: (2,1) = 3 instead of 1 ->
    # correct 4 -> 4 (blank (2,1) wrong, none added): progress 0; conflicts: row 2 has 2 3 . 3
    # (one repeat), column 1 has 2 4 3 3 (one repeat), box bottom-left 2 3 / . 3 (one repeat)
    # -> 3 conflicts -> local = 0 - 0.1 * 3 = -0.3
    wrong = ((1, 2, 3, 4), (3, 4, 1, 2), (2, 3, 0, 3), (0, 3, 2, 0))
    _, r = env.step(_sudoku_state(half), "planner", _text(wrong))
    assert r.info["conflicts"] == 3 and r.local_reward == pytest.approx(-0.3)
    # the digit-swapped valid grid: blanks correct where 1/2 not involved. Blank cells and
    # swapped values vs solution: (0,1) 1!=2, (0,2) 3 ok, (1,0) 3 ok, (1,3) 1!=2, (2,1) 2!=1,
    # (2,2) 4 ok, (3,0) 4 ok, (3,3) 2!=1 -> 4 correct -> progress 0.5; changed givens: (0,0)
    # 1->2, (1,2) 1->2, (2,0) 2->1, (3,2) 2->1 -> 4 -> local = 0.5 - 0.2 * 4 = -0.3; not solved
    swapped = tuple(tuple({1: 2, 2: 1}.get(v, v) for v in row) for row in SOLUTION)
    state, r = env.step(_sudoku_state(), "planner", _text(swapped))
    assert r.info["changed_givens"] == 4 and r.local_reward == pytest.approx(-0.3)
    assert r.team_reward == 0.0 and not env.success(state)
    # malformed
    _, r = env.step(_sudoku_state(), "planner", "I cannot solve this")
    assert r.local_reward == -0.5 and r.info["malformed"]


@pytest.mark.parametrize("size,seeds", [(4, 60), (9, 6)])
def test_sudoku_generator_unique_and_consistent(size, seeds):
    env = make("sudoku", size=size)
    for seed in list(range(seeds)) + [eval_seed(2)]:
        p = env.reset(seed).puzzle
        assert count_solutions(p.givens, limit=2) == 1
        assert is_solved(p.givens, p.solution)
        givens = sum(v != 0 for row in p.givens for v in row)
        assert givens >= env.target_givens


def test_sudoku_bad_options():
    with pytest.raises(JmarlError, match="size"):
        make("sudoku", size=6)


# ---- the program path (sandbox) ------------------------------------------------------------------

BFS_PROGRAM = '''```python
import sys
from collections import deque
rows = [l.split() for l in sys.stdin.read().splitlines()]
lines = [r for r in rows if r and all(len(t) == 1 for t in r)]
n = len(lines)
find = lambda ch: next((r, c) for r in range(n) for c in range(n) if lines[r][c] == ch)
start, goal = find("A"), find("G")
prev = {start: None}
queue = deque([start])
while queue:
    cell = queue.popleft()
    for m, (dr, dc) in (("U", (-1, 0)), ("D", (1, 0)), ("L", (0, -1)), ("R", (0, 1))):
        nxt = (cell[0] + dr, cell[1] + dc)
        if 0 <= nxt[0] < n and 0 <= nxt[1] < n and lines[nxt[0]][nxt[1]] != "#" and nxt not in prev:
            prev[nxt] = (cell, m)
            queue.append(nxt)
path = []
cell = goal
while prev[cell] is not None:
    cell, m = prev[cell]
    path.append(m)
print(" ".join(reversed(path)))
```'''


def test_tool_program_path():
    env = make("plan_path", size=5, program_timeout_s=2.0)
    state = env.reset(4)
    after, r = env.step(state, "tool", "I will search.\n" + BFS_PROGRAM)
    assert r.info["source"] == "program ok"
    assert len(after.proposal) == state.puzzle.shortest
    assert _walk(state.puzzle, after.proposal) == state.puzzle.goal
    direct = env.step(state, "tool", " ".join(after.proposal))[1]
    assert r.local_reward == pytest.approx(direct.local_reward)
    _, failed = env.step(state, "tool", "```python\nraise SystemExit(3)\n```")
    assert failed.info["source"] == "program error" and failed.local_reward == -0.5
    _, looped = env.step(state, "tool", "```python\nwhile True: pass\n```")
    assert looped.info["source"] == "program timeout" and looped.local_reward == -0.5
    _, junk = env.step(state, "tool", "```python\nprint('no moves here')\n```")
    assert junk.info["source"] == "program ok" and junk.info["malformed"]
    planner_view = env.observe(dataclasses.replace(state, proposal=after.proposal,
                                                   proposal_note="program ok"), "planner")
    assert "[program ok]" in planner_view


# ---- prompt styles and the single-agent baseline ---------------------------------------------


def test_plan_path_compact_prompt_is_exact_and_short():
    env = make("plan_path", size=4, max_turns=2, prompt_style="compact")
    state = path_state()
    assert env.observe(state, "tool") == "A...\n.#..\n..G.\n....\nA0,0 G2,2\nturn 1/2\ntool:"
    assert env.expert_text(state, "tool") in ("RRDD", "DDRR", "RDRD", "DRDR", "RDDR", "DRRD")
    after, r = env.step(state, "tool", "RRDD")  # compact answers parse like "R R D D"
    assert r.local_reward == pytest.approx(1.86) and after.proposal == ("R", "R", "D", "D")
    assert env.observe(after, "planner").endswith("A0,0 G2,2\nturn 1/2\ntool: RRDD\nplan:")
    moved, r = env.step(after, "planner", "RR")
    moved = env.end_turn(moved)
    assert r.team_reward == 0.0 and moved.board == (0, 2)
    assert env.observe(moved, "tool") == "..A.\n.#..\n..G.\n....\nA0,2 G2,2\nturn 2/2 prev RR\ntool:"
    full = make("plan_path", size=4, max_turns=2)
    assert len(env.observe(after, "planner")) * 4 < len(full.observe(after, "planner"))


def test_compact_and_full_styles_share_puzzles_and_rewards():
    for name in ("plan_path", "sokoban", "sudoku"):
        full, compact = make(name), make(name, prompt_style="compact")
        for seed in range(5):
            a, b = full.reset(seed), compact.reset(seed)
            assert a == b
            # the expert's compact answer earns exactly what its full answer earns
            fa, ra = full.step(a, "planner", full.expert_text(a, "planner"))
            fb, rb = compact.step(b, "planner", compact.expert_text(b, "planner"))
            assert (ra.local_reward, ra.team_reward, full.success(fa)) == (rb.local_reward, rb.team_reward, compact.success(fb))
            assert compact.success(fb)
    with pytest.raises(JmarlError, match="prompt_style"):
        make("plan_path", prompt_style="tiny")


def test_single_agent_mode_has_only_the_planner():
    env = make("plan_path", size=4, single_agent=True, prompt_style="compact")
    assert env.agents == env.turn_order == ("planner",)
    state = path_state()
    assert env.observe(state, "planner").endswith("turn 1/3\nplan:")  # no tool line
    assert "Tool agent" not in make("plan_path", size=4, single_agent=True).observe(state, "planner")
    with pytest.raises(JmarlError, match="unknown agent 'tool'"):
        env.step(state, "tool", "RRDD")
    done, r = env.step(state, "planner", "RRDD")
    assert env.success(done) and r.team_reward == pytest.approx(1.5)
    assert make("plan_path").agents == ("tool", "planner")


# ---- reward settings: compact (default) vs pettingllms (the AT-GRPO paper's code) ----------------
# Every expected number below is worked out by hand from the formulas in docs/environments.md,
# section 2.6. Per move: -cost + shaping * (gamma * Phi(after) - Phi(before)), Phi = -distance.
#   compact:     cost 0.01 (moved or blocked), Plan-Path shaping 0.1 gamma 1, Sokoban no shaping
#   pettingllms: cost 0.01 (moved) / 0.1 Plan-Path, 0.05 Sokoban (blocked),
#                Plan-Path shaping 1 gamma 0.99, Sokoban box-distance shaping 0.1 gamma 0.99


def _both(name, **kw):
    return make(name, **kw), make(name, reward="pettingllms", **kw)


def test_reward_setting_option_and_coefficients():
    compact, paper = _both("plan_path", size=4)
    assert compact.reward == "compact" and make("sokoban").reward == "compact"  # library default
    c, p = compact.coefficients, paper.coefficients
    assert (c.invalid_cost, c.shaping, c.gamma, c.malformed_reward) == (0.01, 0.1, 1.0, -0.5)
    assert (p.invalid_cost, p.shaping, p.gamma, p.malformed_reward) == (0.1, 1.0, 0.99, -2.0)
    sok = make("sokoban", reward="pettingllms").coefficients
    assert (sok.invalid_cost, sok.shaping, sok.gamma, sok.move_limit, sok.fail_reward) == (
        0.05, 0.1, 0.99, 200, -5.0)
    # an option set explicitly overrides that one coefficient of the setting
    tuned = make("plan_path", reward="pettingllms", invalid_cost=0.5, move_limit=0).coefficients
    assert (tuned.invalid_cost, tuned.shaping, tuned.move_limit) == (0.5, 1.0, 0)
    assert make("sokoban", shaping=0.2).coefficients.shaping == 0.2
    # the setting does not change the puzzles
    assert all(compact.reset(s) == paper.reset(s) for s in (0, 1, eval_seed(0)))
    for name in ("plan_path", "sokoban"):
        with pytest.raises(JmarlError,
                           match=r"reward must be one of \('compact', 'pettingllms'\), got 'paper'"):
            make(name, reward="paper")
    with pytest.raises(JmarlError, match="gamma"):
        make("plan_path", gamma=0.0)
    with pytest.raises(JmarlError, match="move_limit"):
        make("sokoban", move_limit=-1)


def test_plan_path_settings_one_move_toward_the_goal():
    compact, paper = _both("plan_path", size=4)
    state = dataclasses.replace(path_state(), board=(0, 2))  # d = 2; D -> (1, 2), d = 1
    # compact: -0.01 + 0.1 * (2 - 1) = 0.09
    _, r = compact.step(state, "planner", "D")
    assert r.local_reward == pytest.approx(0.09) and r.team_reward == 0.0
    # pettingllms: -0.01 + 1 * (0.99 * -1 - (-2)) = -0.01 + 1.01 = 1.00
    _, r = paper.step(state, "planner", "D")
    assert r.local_reward == pytest.approx(1.0) and r.team_reward == 0.0
    assert r.info["shaping"] == pytest.approx(1.01) and r.info["step_cost"] == pytest.approx(-0.01)


def test_plan_path_settings_shortest_path():
    _, paper = _both("plan_path", size=4)
    # R R D D from d = 4: each move -0.01 + (d - 0.99 (d - 1)) = 0.98 + 0.01 d
    #   d 4 -> 3: 1.02, 3 -> 2: 1.01, 2 -> 1: 1.00, 1 -> 0: 0.99; local = 4.02
    # team = goal 1 + shortest 0.5 (both settings)
    state, r = paper.step(path_state(), "planner", "R R D D")
    assert r.local_reward == pytest.approx(4.02) and r.team_reward == pytest.approx(1.5)
    assert r.done and paper.success(state)
    # the tool's proposal earns the simulated step's local + team: 4.02 + 1.5
    _, r = paper.step(path_state(), "tool", "R R D D")
    assert r.local_reward == pytest.approx(5.52) and r.team_reward == 0.0


def test_plan_path_settings_invalid_move():
    compact, paper = _both("plan_path", size=4)
    # U at (0, 0) bumps the border; stays at d = 4.
    #   compact: -0.01 + 0.1 * (4 - 4) = -0.01
    #   pettingllms: -0.1 + 1 * (0.99 * -4 - (-4)) = -0.1 + 0.04 = -0.06
    assert compact.step(path_state(), "planner", "U")[1].local_reward == pytest.approx(-0.01)
    state, r = paper.step(path_state(), "planner", "U")
    assert r.local_reward == pytest.approx(-0.06) and state.board == (0, 0) and r.info["bumps"] == 1
    # D at (0, 1) (d = 3) walks into the wall (1, 1):
    #   compact -0.01; pettingllms -0.1 + (0.99 * -3 + 3) = -0.07
    at = dataclasses.replace(path_state(), board=(0, 1))
    assert compact.step(at, "planner", "D")[1].local_reward == pytest.approx(-0.01)
    assert paper.step(at, "planner", "D")[1].local_reward == pytest.approx(-0.07)
    # U (bump, -0.06) then R (d 4 -> 3, 1.02): 0.96; compact -0.01 + 0.09 = 0.08
    assert paper.step(path_state(), "planner", "U R")[1].local_reward == pytest.approx(0.96)
    assert compact.step(path_state(), "planner", "U R")[1].local_reward == pytest.approx(0.08)


@pytest.mark.parametrize("name,state", [("plan_path", path_state()),
                                        ("sokoban", None)])
def test_settings_malformed_action(name, state):
    compact, paper = _both(name, size=4 if name == "plan_path" else 5)
    if state is None:
        state = _sokoban_state(_room({(2, 2)}, {(2, 3)}, (2, 1)))
    for env, expected in ((compact, -0.5), (paper, -2.0)):
        for agent, text in (("tool", "no idea"), ("planner", ""), ("planner", "Actions: []"),
                            ("tool", "```python\nraise SystemExit(3)\n```")):
            after, r = env.step(state, agent, text)
            assert r.local_reward == expected and r.team_reward == 0.0, (env.reward, agent, text)
            assert r.info["malformed"] and not r.done and after.board == state.board


def test_sokoban_settings_box_push_changes_phi():
    compact, paper = _both("sokoban", size=5)
    #  # # # # #
    #  # . . . #
    #  # P B . #      player (2,1), box (2,2), goal (3,3): box distance 1 + 1 = 2, Phi = -2
    #  # . . G #
    state = _sokoban_state(_room({(2, 2)}, {(3, 3)}, (2, 1)))
    # R pushes the box to (2,3): distance 1, Phi = -1 (not on the goal)
    #   compact: -0.01
    #   pettingllms: -0.01 + 0.1 * (0.99 * -1 - (-2)) = -0.01 + 0.101 = 0.091
    assert compact.step(state, "planner", "R")[1].local_reward == pytest.approx(-0.01)
    after, r = paper.step(state, "planner", "R")
    assert r.local_reward == pytest.approx(0.091) and r.team_reward == 0.0
    assert after.board == ((2, 2), frozenset({(2, 3)}))
    assert r.info["shaping"] == pytest.approx(0.101)
    # U walks to (1,1) without a push: Phi stays -2, the shaping is 0.1 * (0.99 - 1) * -2 = 0.002
    #   pettingllms: -0.01 + 0.002 = -0.008; compact -0.01
    assert paper.step(state, "planner", "U")[1].local_reward == pytest.approx(-0.008)
    assert compact.step(state, "planner", "U")[1].local_reward == pytest.approx(-0.01)


def test_sokoban_settings_push_onto_goal_and_blocked_move():
    compact, paper = _both("sokoban", size=5)
    state = _sokoban_state(_room({(2, 2)}, {(2, 3)}, (2, 1)))  # box 1 from its goal: Phi = -1
    # R pushes the box onto the goal: Phi -1 -> 0
    #   compact: -0.01 + 1 = 0.99; pettingllms: -0.01 + 1 + 0.1 * (0.99 * 0 - (-1)) = 1.09
    #   team: solved 10 in both
    _, r = compact.step(state, "planner", "R")
    assert r.local_reward == pytest.approx(0.99) and r.team_reward == pytest.approx(10.0)
    done, r = paper.step(state, "planner", "R")
    assert r.local_reward == pytest.approx(1.09) and r.team_reward == pytest.approx(10.0)
    assert paper.success(done)
    # L is blocked by the wall (2,0): compact -0.01; pettingllms -0.05 + 0.1 * (0.99 - 1) * -1
    #   = -0.05 + 0.001 = -0.049
    assert compact.step(state, "planner", "L")[1].local_reward == pytest.approx(-0.01)
    _, r = paper.step(state, "planner", "L")
    assert r.local_reward == pytest.approx(-0.049) and r.info["blocked"] == 1


def test_pettingllms_move_limit_fails_the_episode():
    compact, paper = _both("sokoban", size=5)
    # 199 moves made so far; the 200th (blocked L, -0.049) reaches the limit unsolved:
    # team = fail -5 and the episode ends (not solved). compact has no limit.
    state = dataclasses.replace(_sokoban_state(_room({(2, 2)}, {(2, 3)}, (2, 1))), moves=199)
    after, r = paper.step(state, "planner", "L R")  # the R after the limit is not played
    assert r.local_reward == pytest.approx(-0.049) and r.team_reward == pytest.approx(-5.0)
    assert r.done and r.info["failed"] and r.info["moves"] == 1 and not paper.success(after)
    assert after.moves == 200 and after.board == state.board
    assert "move limit reached" in after.history[-1]
    _, r = paper.step(state, "tool", "L")  # the tool's simulated step carries the failure too
    assert r.local_reward == pytest.approx(-0.049 - 5.0) and not r.done
    _, r = compact.step(state, "planner", "L")
    assert r.team_reward == 0.0 and not r.done
    # R solves on the 200th move: a success (local 1.09 as above, team 10), not a failure
    _, r = paper.step(state, "planner", "R")
    assert r.local_reward == pytest.approx(1.09) and r.team_reward == pytest.approx(10.0)
    assert not r.info["failed"]
    # Plan-Path: limit 10,000; a bump at 9,999 moves: -0.06, team -1
    _, pp = _both("plan_path", size=4)
    after, r = pp.step(path_state(moves=9_999), "planner", "U")
    assert r.local_reward == pytest.approx(-0.06) and r.team_reward == pytest.approx(-1.0)
    assert r.done and not pp.success(after)


def test_paper_configs_use_pettingllms_and_quickstart_compact():
    from pathlib import Path

    from jmarl.config import read_yaml_file

    configs = Path(__file__).resolve().parents[1] / "configs"
    for name in ("plan_path", "sokoban"):
        env = read_yaml_file(configs / "at_grpo" / f"{name}.yaml")["env"]
        assert env["options"]["reward"] == "pettingllms"
        assert make(env["name"], **env["options"]).coefficients.malformed_reward == -2.0
    quick = read_yaml_file(configs / "quickstart.yaml")["env"]
    assert make(quick["name"], **quick["options"]).reward == "compact"
