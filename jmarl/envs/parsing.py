"""Turning model text into actions and answers; number normalisation.

Every function here takes arbitrary text (clipped with `clip_text`) and returns a parsed value
or None; none of them raises on any input.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fractions import Fraction

from jmarl.envs.common import clip_text

# ---------------------------------------------------------------------------------------------
# Moves on a grid: "U R R D", "UP, RIGHT", '["U", "R"]', "URRD", arrows.

_MOVE_WORDS = {"up": "U", "down": "D", "left": "L", "right": "R", "u": "U", "d": "D", "l": "L",
               "r": "R", "↑": "U", "↓": "D", "←": "L", "→": "R"}
# Whole words (any case), runs of upper-case U/D/L/R ("URRD"), single lower-case letters, arrows.
_MOVE_RE = re.compile(r"\b(?:(?i:up|down|left|right)|[UDLR]+|[udlr])\b|[↑↓←→]")
_MARKER_RE = re.compile(r"(?i)\b(?:actions?|moves?|answer|final|plan|solution|grid)\b\s*[:=]")
_FENCE_RE = re.compile(r"```[^\n`]*\n(.*?)```", re.S)
_PY_FENCE_RE = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.S | re.I)


def after_last_marker(text: str) -> str:
    """The text after the last "Actions:"/"Answer:"-style marker (all of it if none)."""
    last = None
    for last in _MARKER_RE.finditer(text):
        pass
    return text[last.end():] if last else text


def strip_code_blocks(text: str) -> str:
    """`text` without its ``` fenced blocks."""
    return _FENCE_RE.sub(" ", text)


def parse_moves(text: object, max_moves: int) -> tuple[str, ...] | None:
    """Parses a move list into ("U"|"D"|"L"|"R", ...), at most `max_moves` long; None if none.

    Accepts "U R R D", "up, right", '["U", "R"]', "URRD", arrows; if the text has a marker such
    as "Actions:", only what follows the last marker counts.
    """
    segment = after_last_marker(strip_code_blocks(clip_text(text)))
    moves: list[str] = []
    for match in _MOVE_RE.finditer(segment):
        token = match.group(0)
        word = _MOVE_WORDS.get(token.lower())
        moves.extend([word] if word else list(token))  # an upper-case run such as "URRD"
        if len(moves) >= max_moves:
            break
    return tuple(moves[:max_moves]) if moves else None


# ---------------------------------------------------------------------------------------------
# Digit grids (Sudoku): rows of digits, JSON nested lists, or n*n digits in a row.

_ROW_CHARS_RE = re.compile(r"^[\s\d.\-_|,;:\[\]+*]*$")
_CELL_RE = re.compile(r"[0-9._*]")
_ROW_LABEL_RE = re.compile(r"^\s*row\s*\d+\s*[:.)=-]?", re.I)  # "Row 1: 1 2 3 4"


def parse_grid(text: object, n: int) -> tuple[tuple[int, ...], ...] | None:
    """Parses an n x n grid of digits (0, '.', '_' or '*' = empty) into a tuple of rows.

    Accepts n lines of n cells (separators |,; and spaces ignored, "Row 1:" labels dropped; the
    last such block wins), a JSON list of lists, or exactly n*n cells after the last marker.
    Digits above n are returned as written (Sudoku treats them as blanks). None if no grid.
    """
    text = strip_code_blocks(clip_text(text))
    rows: list[tuple[int, ...]] = []
    best: list[tuple[int, ...]] | None = None
    for line in text.splitlines():
        line = _ROW_LABEL_RE.sub("", line)
        cells = _CELL_RE.findall(line) if _ROW_CHARS_RE.match(line) else []
        if len(cells) == n:
            rows.append(tuple(int(c) if c.isdigit() else 0 for c in cells))
            if len(rows) >= n:
                best = rows[-n:]
        elif cells or not _ROW_CHARS_RE.match(line):  # blank/"----" lines keep a block going
            rows = []
    if best is not None:
        return tuple(best)
    for candidate in re.findall(r"\[\s*\[[^\[\]]*\](?:\s*,\s*\[[^\[\]]*\])*\s*\]", text[-4000:]):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if (len(value) == n and all(isinstance(r, list) and len(r) == n for r in value)
                and all(isinstance(c, int) and 0 <= c <= 9 for r in value for c in r)):
            return tuple(tuple(r) for r in value)
    segment = after_last_marker(text)
    cells = _CELL_RE.findall(segment) if _ROW_CHARS_RE.match(segment) else []
    if len(cells) == n * n:
        flat = [int(c) if c.isdigit() else 0 for c in cells]
        return tuple(tuple(flat[r * n:(r + 1) * n]) for r in range(n))
    return None


# ---------------------------------------------------------------------------------------------
# Answers: \boxed{...}, "#### 42", "Answer: 42", the last number; normalisation.

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


def extract_boxed(text: object) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if none."""
    text = clip_text(text)
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1].strip() if depth == 0 else None


def extract_answer(text: object) -> str | None:
    """The final answer in `text`: \\boxed{}, then "####", then "answer: ...", then the last
    number. None if there is none."""
    text = clip_text(text)
    boxed = extract_boxed(text)
    if boxed:
        return boxed
    hashes = text.rfind("####")
    if hashes >= 0:
        rest = text[hashes + 4:].strip().splitlines()
        if rest and rest[0].strip():
            return rest[0].strip()
    marked = None
    for marked in re.finditer(r"(?i)(?:final answer|answer)\s*(?:is|:|=)\s*([^\n]+)", text):
        pass
    if marked:
        value = marked.group(1).strip().rstrip(".").strip()
        if value:
            return value
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


_FRAC_RE = re.compile(r"^\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
_LATEX_JUNK_RE = re.compile(r"\\[,!;: ]|\\text\{[^}]*\}|\\mathrm\{[^}]*\}|\\left|\\right|\\?\$|\\%")


def parse_number(value: object) -> Fraction | None:
    """`value` as an exact number, or None.

    Handles "1,234", "$5", "50%" (= 50), "3.0", "-2", "1e3", "3/4", "\\frac{3}{4}",
    "\\dfrac34"-free LaTeX, and a short phrase holding exactly one number ("42 apples").
    """
    s = clip_text(value, 200).strip()
    s = _LATEX_JUNK_RE.sub("", s).replace("%", "").strip().rstrip(".").strip()
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
    frac = _FRAC_RE.match(s.replace(" ", ""))
    if frac:
        return _ratio(frac.group(1), frac.group(2))
    if re.fullmatch(r"-?[\d.]+\s*/\s*-?[\d.]+", s):
        num, den = s.split("/")
        return _ratio(num.strip(), den.strip())
    if re.fullmatch(_NUMBER_RE.pattern, s):
        return _decimal(s)
    numbers = _NUMBER_RE.findall(s)
    if len(numbers) == 1 and len(s) <= 40 and not re.search(r"[-+*/^=(){}\\]",
                                                             _NUMBER_RE.sub("", s)):
        return _decimal(numbers[0])  # "42 apples", not "x + 1"
    return None


_MAX_DIGITS = 100  # longer numbers (or exponents beyond +-100) are not answers


def _decimal(s: str) -> Fraction | None:
    s = s.replace(",", "")
    mantissa, _, exponent = s.lower().partition("e")
    try:
        if len(mantissa) > _MAX_DIGITS or (exponent and abs(int(exponent)) > _MAX_DIGITS):
            return None
        return Fraction(s)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def _ratio(num: str, den: str) -> Fraction | None:
    a, b = _decimal(num), _decimal(den)
    if a is None or b is None or b == 0:
        return None
    return a / b


def canonical_answer(value: object) -> str:
    """A canonical text of an answer: "p/q" for numbers, else squeezed lower-case text."""
    number = parse_number(value)
    if number is not None:
        return str(number)
    s = clip_text(value, 500)
    s = _LATEX_JUNK_RE.sub("", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", s).strip(".").lower()


def answers_match(predicted: object, gold: object, rel_tol: float = 1e-6) -> bool:
    """True if two answers are the same number (relative tolerance `rel_tol`) or the same text."""
    if predicted is None or gold is None:
        return False
    a, b = parse_number(predicted), parse_number(gold)
    if a is not None and b is not None:
        return abs(a - b) <= Fraction(rel_tol) * max(Fraction(1), abs(b))
    return bool(canonical_answer(gold)) and canonical_answer(predicted) == canonical_answer(gold)


# ---------------------------------------------------------------------------------------------
# Programs: a ```python block run in the sandbox; its stdout is the proposal.


def extract_python(text: object) -> str | None:
    """The code of the last ```python fenced block in `text`, or None."""
    blocks = _PY_FENCE_RE.findall(clip_text(text))
    return blocks[-1] if blocks and blocks[-1].strip() else None


@dataclass(frozen=True)
class ProgramRun:
    """What running a model's program gave: status ("ok", "error", "timeout", "memory",
    "killed", "unavailable") and its stdout (clipped)."""

    status: str
    stdout: str


def run_program(code: str, stdin: str = "", timeout_s: float = 5.0,
                memory_mb: int = 256) -> ProgramRun:
    """Runs `code` in the sandbox (`jmarl.sandbox.run_python`). A program's failure is a
    result, never an exception; only the sandbox refusing this machine's isolation level
    (`JmarlError`, naming `sandbox.isolation`) is raised: that is the user's setting to change."""
    from jmarl.errors import JmarlError

    try:
        from jmarl.sandbox import run_python  # lazy: the sandbox spawns processes
    except Exception:  # noqa: BLE001 - sandbox missing or broken: a defined failure
        return ProgramRun("unavailable", "")
    try:
        result = run_python(code, stdin, timeout_s=timeout_s, memory_mb=memory_mb,
                            max_output_bytes=64_000)
    except JmarlError:
        raise
    except Exception:  # noqa: BLE001 - any sandbox failure is the program's failure
        return ProgramRun("error", "")
    return ProgramRun(str(result.status), clip_text(result.stdout))
