"""Parsing of moves, grids and answers; number normalisation; text clipping; frozen maps."""

import pickle
from fractions import Fraction

import pytest

from jmarl.envs.common import MAX_TEXT_CHARS, FrozenMap, clip_text, freeze_memory
from jmarl.envs.parsing import (answers_match, canonical_answer, extract_answer, extract_boxed,
                                extract_python, parse_grid, parse_moves, parse_number)


@pytest.mark.parametrize("text,moves", [
    ("U R R D", "URRD"),
    ("UP, RIGHT, right, down", "URRD"),
    ('["U", "R", "L"]', "URL"),
    ("URRD", "URRD"),
    ("I think we should go up. Actions: D D L", "DDL"),  # only what follows the last marker
    ("Plan:\nleft\nleft\nup", "LLU"),
    ("↑ → ↓ ←", "URDL"),
    ("u r d l", "URDL"),
    ("```python\nprint('U U')\n```\nActions: R", "R"),  # code blocks are not moves
])
def test_parse_moves(text, moves):
    assert parse_moves(text, max_moves=100) == tuple(moves)


@pytest.mark.parametrize("text", ["", "hello world", "Actions: none", "dull ruler", "\x00\xff"])
def test_parse_moves_none(text):
    assert parse_moves(text, max_moves=100) is None


def test_parse_moves_caps_length():
    assert parse_moves("U " * 1000, max_moves=7) == ("U",) * 7


GRID = ((1, 2, 3, 4), (3, 4, 1, 2), (2, 1, 4, 3), (4, 3, 2, 1))


@pytest.mark.parametrize("text", [
    "1 2 3 4\n3 4 1 2\n2 1 4 3\n4 3 2 1",
    "Grid:\n1 2 | 3 4\n3 4 | 1 2\n---------\n2 1 | 4 3\n4 3 | 2 1\n",
    "1234\n3412\n2143\n4321",
    "[[1,2,3,4],[3,4,1,2],[2,1,4,3],[4,3,2,1]]",
    "My answer: [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]] done",
    "Grid: 1234 3412 2143 4321",
    "Row 1: 1 2 3 4\nRow 2: 3 4 1 2\nrow 3) 2 1 4 3\nROW4 4 3 2 1",
    "draft:\n0 0 0 0\n0 0 0 0\n0 0 0 0\n0 0 0 0\nfinal:\n1 2 3 4\n3 4 1 2\n2 1 4 3\n4 3 2 1",
])
def test_parse_grid(text):
    assert parse_grid(text, 4) == GRID


def test_parse_grid_blanks_and_failures():
    assert parse_grid(". 2 _ 4\n3 4 1 2\n2 1 4 3\n4 3 2 *", 4) == (
        (0, 2, 0, 4), (3, 4, 1, 2), (2, 1, 4, 3), (4, 3, 2, 0))
    assert parse_grid("1 2 3\n4 5 6\n7 8 9", 4) is None
    assert parse_grid("row one is 1 2 3 4", 4) is None
    assert parse_grid("", 4) is None


@pytest.mark.parametrize("text,answer", [
    ("so \\boxed{42} is it", "42"),
    ("\\boxed{\\frac{3}{4}} and later \\boxed{x^{2}}", "x^{2}"),  # the last box, braces balanced
    ("Natalia sold 48 clips.\n#### 72", "72"),
    ("The answer is 1,234.", "1,234"),
    ("Final answer: $5.50", "$5.50"),
    ("3 apples and 4 pears make 7", "7"),
    ("no numbers here", None),
    ("\\boxed{unclosed", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_extract_boxed_none():
    assert extract_boxed("nothing") is None


@pytest.mark.parametrize("text,value", [
    ("1,234", Fraction(1234)), ("$5", Fraction(5)), ("50%", Fraction(50)), ("3.0", Fraction(3)),
    ("-2", Fraction(-2)), ("1e3", Fraction(1000)), ("3/4", Fraction(3, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)), ("\\dfrac{-1}{2}", Fraction(-1, 2)), ("0.5", Fraction(1, 2)),
    ("42 apples", Fraction(42)), ("\\$1,000,000", Fraction(10**6)), ("7.", Fraction(7)),
    ("x + 1", None), ("1/0", None), ("1 and 2", None), ("1e999", None), ("", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_answers_match():
    assert answers_match("\\frac{1}{2}", "0.5")
    assert answers_match("72.0", "72")
    assert answers_match("1,000", "1000")
    assert answers_match("0.30000000000000004", "0.3")  # float noise of a program
    assert not answers_match("0.31", "0.3")
    assert answers_match("New  Delhi", "new delhi")
    assert not answers_match(None, "3")
    assert not answers_match("", "")
    assert canonical_answer("\\dfrac{a}{b}") == canonical_answer("\\frac{a}{b}")


def test_extract_python():
    text = "First\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```"
    assert extract_python(text) == "print(2)\n"
    assert extract_python("```\nprint(3)\n```") is None
    assert extract_python("```python\n\n```") is None


def test_clip_text():
    long = "a" * 10 + "b" * 100_000 + "z" * 10
    clipped = clip_text(long)
    assert len(clipped) == MAX_TEXT_CHARS + 1 and clipped.startswith("a") and clipped.endswith("z")
    assert clip_text(b"\xffok") == "\ufffdok"
    assert clip_text(None) == "None"


def test_frozen_map():
    m = FrozenMap({"b": (1,), "a": (2,)})
    assert m == {"a": (2,), "b": (1,)} and hash(m) == hash(FrozenMap({"a": (2,), "b": (1,)}))
    assert m.set("c", 3)["c"] == 3 and "c" not in m
    with pytest.raises(AttributeError):
        m.x = 1
    assert pickle.loads(pickle.dumps(m)) == m
    assert freeze_memory({"x": ["one", "two"]}) == {"x": ("one", "two")}
    assert freeze_memory({"x": "one"}) == {"x": ("one",)}
    assert freeze_memory(None) == {}
