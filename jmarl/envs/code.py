"""Code: agents write Python that is run against hidden tests in the sandbox.

Two variants (`variant=`):

* "coder_tester" (AT-GRPO): agents ("coder", "tester"). The coder writes the function (or, for
  stdin/stdout problems, the program); the tester writes assert-style tests. Rewards:
    coder  local = team = hidden pass ratio of the coder's program (passed / hidden tests);
    tester local = (1 - w) * agreement + w * validity (w = `tester_validity_weight`, default
                   0.5; w = 0 scores agreement alone), where
      agreement = 1 if (the coder's program passes all the tester's tests) equals (it passes all
                  hidden tests), else 0;
      validity  = fraction of the tester's tests that the reference solution passes
                  (without a reference solution: local = agreement);
      a reply with no test scores 0; team = the coder's hidden pass ratio.
  The tester is scored against the coder's program in the running state (the coder acts first
  in `turn_order`). The episode ends once the coder's program passes all of the tester's
  tests (at least one), or after `max_turns`; each later turn shows both agents the previous
  program, the tests, and which tests failed.

* "helper_main" (MAGRPO): agents ("aux", "main"). `aux` writes a helper function named `aux`;
  `main` writes the entry-point function, which may call `aux`. The joint program is the aux
  code followed by the main code. Rewards:
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
  Later turns show both agents the joint program's results on the visible examples. The
  episode ends after `max_turns` (default 1 in this variant).

Every StepResult's `info` reports the parsed code and each reward component. `step` never
raises: the code is the ```python fenced blocks of the reply (joined), else any fenced blocks,
else the text after an unclosed fence, else the whole text; code longer than
`max_code_chars` or that does not compile scores as non-compiling (and is never run).

Programs run in `jmarl.envs.sandbox` through a harness that reports each test's outcome on
lines tagged with a random nonce read from stdin before the program runs, so printing "PASS",
exiting early, looping or crashing wins nothing. A test ending in `assert <expr> == <literal>`
(or `_same(<expr>, <literal>)`, type-strict, as the built-in hidden tests are written, or
`_same_lines(run_program(...), <literal>)`) is a value check: the harness only computes
<expr> and reports its repr (built-in data only), and this process compares it with the
literal, which never enters the sandbox, so no trick inside the program can fake a pass.
Other tests (e.g. `assert abs(f(x) - y) < 1e-6`) are judged inside the harness, with a
top-level `assert a == b` checked as `_eq(a, b)` (built-in data only, so an object claiming
equality with everything fails) and the helper names restored before each test; a program
written to inspect the harness's own frames could forge those reports (the sandbox still
contains whatever it does).

Problems: built-in generated ones (default, see `jmarl.envs.code_problems`), or a HumanEval /
MBPP / APPS JSONL file (`path=`). Training seeds draw training problems and evaluation seeds
evaluation problems; the split is a hash of the problem (fraction `eval_fraction` held out).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import inspect
import json
import os
import re
import secrets
import textwrap
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from jmarl.envs import code_problems
from jmarl.envs.base import EVAL_SEED_START, StepResult, is_eval_seed
from jmarl.envs.code_problems import Problem
from jmarl.envs.sandbox import SandboxResult, run_many
from jmarl.errors import JmarlError

VARIANTS = ("coder_tester", "helper_main")
PROMPT_STYLES = ("full", "compact")
_AGENTS = {"coder_tester": ("coder", "tester"), "helper_main": ("aux", "main")}
MAX_TESTER_TESTS = 20
_MAX_REPLY_CHARS = 200_000
_SHOWN_CODE_CHARS = 3_000

# ------------------------------------------------------------------------------------ parsing

_PY_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```", re.S | re.I)
_ANY_FENCE_RE = re.compile(r"```[^\n`]*\r?\n(.*?)```", re.S)
_OPEN_FENCE_RE = re.compile(r"```[^\n`]*\r?\n(.*)\Z", re.S)


def extract_code(text: Any) -> str:
    """The Python code in a model reply (see the module docstring); never raises."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        text = "" if text is None else str(text)
    text = text[:_MAX_REPLY_CHARS].replace("\x00", "")
    blocks = _PY_FENCE_RE.findall(text) or _ANY_FENCE_RE.findall(text)
    if blocks:
        return "\n\n".join(b.strip("\n") for b in blocks) + "\n"
    unclosed = _OPEN_FENCE_RE.search(text)
    if unclosed:
        return unclosed.group(1)
    return text


def _parse(code: str, max_chars: int) -> ast.Module | None:
    """The AST of `code`, or None if it is empty, too long, or does not compile."""
    if not code.strip() or len(code) > max_chars:
        return None
    try:
        tree = ast.parse(code)
        compile(tree, "solution.py", "exec")  # compiles only (e.g. catches 'return' outside def)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError, OverflowError):
        return None
    return tree


def _defines(tree: ast.Module | None, name: str) -> bool:
    """Whether `tree` defines a top-level function `name`."""
    if tree is None:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
               for n in tree.body)


def _calls(tree: ast.Module | None, name: str) -> bool:
    """Whether `tree` calls `name(...)` anywhere."""
    if tree is None:
        return False
    try:
        return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
                   for n in ast.walk(tree))
    except RecursionError:
        return False


def _binds(node: ast.stmt, names: set[str]) -> bool:
    """Whether the statement (re)defines one of `names` at top level."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name in names
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) in names for a in node.names)
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    return any(isinstance(n, ast.Name) and n.id in names for t in targets for n in ast.walk(t))


def parse_tests(code: str, protected: set[str], max_chars: int,
                max_tests: int = MAX_TESTER_TESTS) -> tuple[str, ...]:
    """The tester's tests: one snippet per top-level `assert` or `def test_*()` function.

    The other top-level statements (imports, helpers) are kept before every test, except those
    that would redefine a `protected` name (the function under test). () if nothing parses.
    """
    tree = _parse(code, max_chars)
    if tree is None:
        return ()
    setup, tests = [], []
    for node in tree.body:
        if isinstance(node, ast.Assert):
            tests.append(ast.unparse(node))
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            if not node.args.args and not _binds(node, protected):
                tests.append(f"{ast.unparse(node)}\n{node.name}()")
        elif not isinstance(node, ast.Expr) and not _binds(node, protected):
            setup.append(ast.unparse(node))  # imports, helpers; bare calls are dropped
    prefix = "\n".join(setup)
    return tuple(f"{prefix}\n{t}" if prefix else t for t in tests[:max_tests])


# ---------------------------------------------------------------------------------- running


def _harness_main() -> None:
    """Runs inside the sandbox: reads {nonce, program, tests, ...} from stdin, runs each test.

    tests: [source, is_value] pairs. An assert test prints "<nonce> <i> PASS|FAIL" (passed if
    it raises nothing; a top-level `assert a == b` is checked as `_eq(a, b)`). A value test
    assigns `__value__`; its repr is printed as "<nonce> <i> VALUE <repr>" when it is built-in
    data, and the parent compares it with the expected value, which never enters this
    process. Each test has a SIGALRM time limit; the program's own output goes to /dev/null.
    """
    import ast
    import io
    import json
    import os
    import signal
    import sys

    payload = json.loads(sys.stdin.read())
    nonce, program, setup = payload["nonce"], payload["program"], payload["setup"]
    tests, limit, program_mode = payload["tests"], payload["timeout"], payload["program_mode"]
    payload_max_value_chars = payload["max_value_chars"]
    del payload
    write, encode = os.write, str.encode
    setitimer, itimer_real = signal.setitimer, signal.ITIMER_REAL
    _type, _len, _zip, _all, _sorted = type, len, zip, all, sorted
    _list, _tuple, _dict = list, tuple, dict

    def _same(value, expected):
        """Equality that also requires identical (built-in) types, recursively."""
        if _type(value) is not _type(expected):
            return False
        if _type(expected) in (_list, _tuple):
            return _len(value) == _len(expected) and _all(
                _same(a, b) for a, b in _zip(value, expected))
        if _type(expected) is _dict:
            return _sorted(map(repr, value)) == _sorted(map(repr, expected)) and _all(
                k in value and _same(value[k], expected[k]) for k in expected)
        return value == expected

    plain_types = (int, float, complex, str, bytes, bool, type(None))

    def _plain(value):
        """Whether `value` is built only from built-in data types (no custom __eq__)."""
        kind = _type(value)
        if kind in (_list, _tuple, set, frozenset):
            return _all(_plain(item) for item in value)
        if kind is _dict:
            return _all(_plain(k) and _plain(v) for k, v in value.items())
        return kind in plain_types

    def _eq(value, expected):
        """`value == expected` for built-in data only (an always-equal object fails)."""
        return _plain(value) and _plain(expected) and value == expected

    class EqualityRewrite(ast.NodeTransformer):
        """`assert a == b` -> `assert _eq(a, b)` (top-level asserts of a test)."""

        def visit_Assert(self, node):
            test = node.test
            if (isinstance(test, ast.Compare) and _len(test.ops) == 1
                    and isinstance(test.ops[0], ast.Eq)):
                node.test = ast.Call(ast.Name("_eq", ast.Load()),
                                     [test.left, test.comparators[0]], [])
            return node

    def compile_test(source, filename):
        tree = ast.fix_missing_locations(EqualityRewrite().visit(ast.parse(source)))
        return compile(tree, filename, "exec")

    def _same_lines(output, expected):
        """Equal outputs up to trailing whitespace on lines and trailing blank lines."""
        def norm(text):
            return "\n".join(line.rstrip() for line in str(text).strip("\n").split("\n"))
        return _type(output) is str and norm(output) == norm(expected)

    def run_program(stdin_text=""):
        """Runs the program with `stdin_text` as stdin; returns what it printed."""
        saved = sys.stdin, sys.stdout
        sys.stdin, sys.stdout = io.StringIO(stdin_text), io.StringIO()
        try:
            exec(compile(program, "solution.py", "exec"), {"__name__": "__main__"})
        except SystemExit:
            pass
        finally:
            captured = sys.stdout
            sys.stdin, sys.stdout = saved
        return captured.getvalue()

    def on_alarm(signum, frame):
        raise TimeoutError("test timed out")

    signal.signal(signal.SIGALRM, on_alarm)
    sys.stdout = open(os.devnull, "w")
    sys.stdin = io.StringIO("")
    helpers = {"_same": _same, "_same_lines": _same_lines, "_eq": _eq,
               "run_program": run_program}
    base = {"__name__": "solution", **helpers}
    loaded = True
    try:
        setitimer(itimer_real, 2 * limit)
        exec(compile(setup, "setup.py", "exec"), base)
        if not program_mode:
            exec(compile(program, "solution.py", "exec"), base)
    except BaseException:  # noqa: BLE001 - any failure to load fails every test
        loaded = False
    finally:
        setitimer(itimer_real, 0)
    _repr, max_value_chars = repr, payload_max_value_chars
    for index, (test, is_value) in enumerate(tests):
        report = "FAIL"
        if loaded:
            scope = _dict(base)
            scope.update(helpers)  # the program may have rebound these names
            try:
                setitimer(itimer_real, limit)
                exec(compile_test(test, f"test_{index}.py"), scope)
                if is_value:
                    value = scope["__value__"]
                    if _plain(value):
                        text = _repr(value)
                        if _len(text) <= max_value_chars and "\n" not in text:
                            report = "VALUE " + text
                else:
                    report = "PASS"
            except BaseException:  # noqa: BLE001 - a failing test
                report = "FAIL"
            finally:
                setitimer(itimer_real, 0)
        write(1, encode(f"{nonce} {index} {report}\n"))


_HARNESS_SRC = textwrap.dedent(inspect.getsource(_harness_main)) + "\n_harness_main()\n"


@dataclass(frozen=True)
class ProgramCheck:
    """A program and the test snippets to run against it (see `run_tests`)."""

    program: str
    tests: tuple[str, ...]
    setup: str = ""
    program_mode: bool = False


_MAX_VALUE_CHARS = 100_000


@dataclass(frozen=True)
class _Check:
    """A test as the harness runs it. kind "assert": pass/fail is reported by the harness;
    "strict" / "loose" / "lines": the harness reports a value that is compared here with
    `expected` (type-strictly, with ==, or as program output up to trailing whitespace)."""

    source: str
    kind: str = "assert"
    expected: Any = None


def _value_check(test: str) -> _Check:
    """Turns a test ending in `assert <expr> == <literal>`, `assert _same(<expr>, <literal>)` or
    `assert _same_lines(<expr>, <literal>)` into a value check (else an assert check), so the
    expected value is never shown to the program."""
    plain = _Check(test)
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return plain
    if not tree.body or not isinstance(tree.body[-1], ast.Assert):
        return plain
    cond = tree.body[-1].test
    if isinstance(cond, ast.Compare) and len(cond.ops) == 1 and isinstance(cond.ops[0], ast.Eq):
        pairs = [(cond.left, cond.comparators[0]), (cond.comparators[0], cond.left)]
        kind = "loose"
    elif (isinstance(cond, ast.Call) and isinstance(cond.func, ast.Name) and len(cond.args) == 2
          and not cond.keywords and cond.func.id in ("_same", "_same_lines")):
        pairs = [(cond.args[0], cond.args[1])]
        kind = "strict" if cond.func.id == "_same" else "lines"
    else:
        return plain
    for computed, literal in pairs:
        try:
            expected = ast.literal_eval(literal)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if kind == "lines" and not isinstance(expected, str):
            return plain
        assign = ast.Assign(targets=[ast.Name("__value__", ast.Store())], value=computed)
        module = ast.Module(body=[*tree.body[:-1], assign], type_ignores=[])
        try:
            source = ast.unparse(ast.fix_missing_locations(module))
        except (RecursionError, ValueError):
            return plain
        return _Check(source, kind, expected)
    return plain


def _same_value(value: Any, expected: Any) -> bool:
    """Equality that also requires identical types, recursively (built-in data)."""
    if type(value) is not type(expected):
        return False
    if isinstance(expected, (list, tuple)):
        return len(value) == len(expected) and all(map(_same_value, value, expected))
    if isinstance(expected, dict):
        return value.keys() == expected.keys() and all(
            _same_value(value[k], expected[k]) for k in expected)
    return value == expected


def _output_lines(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").split("\n"))


def _check_passed(check: _Check, report: str) -> bool:
    """Whether the harness's report for `check` ("PASS", "FAIL", "VALUE <repr>") passes."""
    if check.kind == "assert":
        return report == "PASS"
    if not report.startswith("VALUE "):
        return False
    try:
        value = ast.literal_eval(report[len("VALUE "):])
        if check.kind == "strict":
            return _same_value(value, check.expected)
        if check.kind == "lines":
            return isinstance(value, str) and _output_lines(value) == _output_lines(
                check.expected)
        return bool(value == check.expected)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _harness_input(job: ProgramCheck, checks: Sequence[_Check], nonce: str,
                   test_timeout_s: float) -> str:
    return json.dumps({"nonce": nonce, "program": job.program, "setup": job.setup,
                       "tests": [[c.source, c.kind != "assert"] for c in checks],
                       "timeout": test_timeout_s, "program_mode": job.program_mode,
                       "max_value_chars": _MAX_VALUE_CHARS})


def _parse_outcomes(result: SandboxResult, nonce: str,
                    checks: Sequence[_Check]) -> tuple[bool, ...]:
    """One bool per check from the harness's nonce-tagged report lines (missing = failed)."""
    passed = [False] * len(checks)
    seen = set()
    for line in result.stdout.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit():
            index = int(parts[1])
            if index < len(checks) and index not in seen:
                seen.add(index)
                passed[index] = _check_passed(checks[index], parts[2])
    return tuple(passed)


def _run_uncached(jobs: tuple[ProgramCheck, ...], test_timeout_s: float,
                  memory_mb: int) -> tuple[tuple[bool, ...], ...]:
    """Runs every job (each with tests) in its own sandbox, all through one `run_many`."""
    nonces = [secrets.token_hex(16) for _ in jobs]
    checks = [[_value_check(t) for t in job.tests] for job in jobs]
    inputs = [_harness_input(job, c, nonce, test_timeout_s)
              for job, c, nonce in zip(jobs, checks, nonces)]
    longest = max(len(job.tests) for job in jobs)
    results = run_many([_HARNESS_SRC] * len(jobs), inputs,
                       timeout_s=test_timeout_s * (longest + 2) + 2.0, memory_mb=memory_mb,
                       max_output_bytes=64 * 1024 + longest * (_MAX_VALUE_CHARS + 64),
                       max_workers=max(1, min(len(jobs), os.cpu_count() or 1)))
    return tuple(_parse_outcomes(r, nonce, c) for r, nonce, c in zip(results, nonces, checks))


# Outcomes per (job, test_timeout_s, memory_mb), least recently used dropped first: a job's
# sandbox run does not depend on the other jobs of its call, so a batch prefetched by
# `Code.step_many` serves the single-job calls of the steps that follow.
_CACHE_SIZE = 4096
_CACHE: collections.OrderedDict[tuple[ProgramCheck, float, int], tuple[bool, ...]] = (
    collections.OrderedDict())
_CACHE_LOCK = threading.Lock()


def run_tests(jobs: Sequence[ProgramCheck], *, test_timeout_s: float = 1.0,
              memory_mb: int = 512) -> list[tuple[bool, ...]]:
    """Runs each job in its own sandbox (concurrently); per job, one bool per test (passed).

    A job with no tests gives (); results are cached per (job, limits) (thread-safe).
    """
    limits = (float(test_timeout_s), int(memory_mb))
    keys = [(j, *limits) for j in jobs]
    out: list[tuple[bool, ...] | None] = []
    with _CACHE_LOCK:
        for job, key in zip(jobs, keys):
            hit = () if not job.tests else _CACHE.get(key)
            if hit is not None and job.tests:
                _CACHE.move_to_end(key)
            out.append(hit)
    todo = tuple(dict.fromkeys(j for j, o in zip(jobs, out) if o is None))
    if todo:
        done = dict(zip(todo, _run_uncached(todo, *limits)))
        with _CACHE_LOCK:
            for job, passed in done.items():
                _CACHE[(job, *limits)] = passed
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
        out = [o if o is not None else done[j] for j, o in zip(jobs, out)]
    return out  # type: ignore[return-value]


def _ratio(passed: Sequence[bool]) -> float:
    return sum(passed) / len(passed) if passed else 0.0


# -------------------------------------------------------------------------------------- state


@dataclass(frozen=True)
class CodeState:
    """One episode (immutable).

    codes: each agent's latest parsed code, in the env's `agents` order ("" before it acts);
    pass_ratio: hidden pass ratio of the current solution (the coder's program / the joint
    program); checked: the (program, tests) pair that `test_results` belong to; test_results:
    the tester's tests on the coder's program (coder_tester) or the examples on the joint
    program (helper_main); feedback: the text shown on the next turn; finished: episode over.
    """

    seed: int
    problem: Problem
    turn: int = 0
    codes: tuple[str, str] = ("", "")
    pass_ratio: float = 0.0
    checked: tuple[str, tuple[str, ...]] = ("", ())
    test_results: tuple[bool, ...] = ()
    feedback: str = ""
    finished: bool = False


def _shown(code: str) -> str:
    if len(code) > _SHOWN_CODE_CHARS:
        code = code[:_SHOWN_CODE_CHARS] + "\n# ... (cut)"
    return f"```python\n{code.rstrip()}\n```"


# ---------------------------------------------------------------------------------------- env


@dataclass(frozen=True)
class Code:
    """The Code task (see the module docstring).

    Options: variant ("coder_tester" | "helper_main"); path (a HumanEval/MBPP/APPS JSONL file;
    None: built-in problems); max_turns (default 2 for coder_tester, 1 for helper_main);
    eval_fraction (share of problems held out for evaluation seeds); num_problems (None: every
    problem; N: each split keeps N problems, the built-in problems of the split's first N seeds
    or the file's first N problems of the split, and its seeds cycle through them);
    prompt_style ("full": the role, problem and reply instructions; "compact": one line naming
    the role and the reply form, then the problem and any feedback, for small models);
    num_hidden_tests (built-in problems); test_timeout_s (per test); memory_mb (per program);
    max_code_chars (longer code scores as non-compiling); tester_validity_weight (coder_tester);
    joint_weights (helper_main: weights of structure, syntax, pass ratio, uses_aux).
    """

    name: ClassVar[str] = "code"
    variant: str = "coder_tester"
    path: str | None = None
    max_turns: int | None = None
    eval_fraction: float = 0.2
    num_problems: int | None = None
    prompt_style: str = "full"
    num_hidden_tests: int = code_problems.NUM_HIDDEN_TESTS
    test_timeout_s: float = 1.0
    memory_mb: int = 512
    max_code_chars: int = 20_000
    tester_validity_weight: float = 0.5
    joint_weights: tuple[float, float, float, float] = (0.1, 0.1, 0.6, 0.2)
    agents: tuple[str, ...] = field(init=False)
    turn_order: tuple[str, ...] = field(init=False)
    parallel: bool = field(default=True, init=False)
    _splits: tuple[tuple[Problem, ...], tuple[Problem, ...]] = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise JmarlError(f"code: unknown variant {self.variant!r}; use one of {VARIANTS}")
        if self.max_turns is None:
            object.__setattr__(self, "max_turns", 2 if self.variant == "coder_tester" else 1)
        if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
            raise JmarlError(f"code: max_turns must be an int >= 1, got {self.max_turns!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise JmarlError(f"code: eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.prompt_style not in PROMPT_STYLES:
            raise JmarlError(f"code: prompt_style must be one of {PROMPT_STYLES}, got "
                             f"{self.prompt_style!r}")
        if self.num_problems is not None and not (
                isinstance(self.num_problems, int) and not isinstance(self.num_problems, bool)
                and self.num_problems >= 1):
            raise JmarlError(f"code: num_problems must be an int >= 1 or None (every problem), "
                             f"got {self.num_problems!r}")
        if not (isinstance(self.num_hidden_tests, int) and 1 <= self.num_hidden_tests <= 100):
            raise JmarlError(f"code: num_hidden_tests must be in [1, 100], got "
                             f"{self.num_hidden_tests!r}")
        if not 0.0 < self.test_timeout_s <= 60.0:
            raise JmarlError(f"code: test_timeout_s must be in (0, 60], got {self.test_timeout_s}")
        if not (isinstance(self.memory_mb, int) and self.memory_mb >= 64):
            raise JmarlError(f"code: memory_mb must be an int >= 64, got {self.memory_mb!r}")
        if not 0.0 <= self.tester_validity_weight <= 1.0:
            raise JmarlError(f"code: tester_validity_weight must be in [0, 1], got "
                             f"{self.tester_validity_weight}")
        weights = tuple(self.joint_weights)
        if len(weights) != 4 or any(not isinstance(w, (int, float)) or w < 0 for w in weights):
            raise JmarlError(f"code: joint_weights must be 4 non-negative numbers (structure, "
                             f"syntax, pass ratio, uses_aux), got {self.joint_weights!r}")
        object.__setattr__(self, "joint_weights", tuple(float(w) for w in weights))
        agents = _AGENTS[self.variant]
        object.__setattr__(self, "agents", agents)
        object.__setattr__(self, "turn_order", agents)
        splits: tuple[tuple[Problem, ...], tuple[Problem, ...]] = ((), ())
        if self.path is not None:
            problems = _load(str(self.path))
            train = tuple(p for p in problems if not code_problems.is_eval_identity(
                p.task_id, self.eval_fraction))
            held = tuple(p for p in problems if code_problems.is_eval_identity(
                p.task_id, self.eval_fraction))
            splits = (train, held)
        object.__setattr__(self, "_splits", splits)

    # ---- problems

    def problem(self, seed: int) -> Problem:
        """The problem for `seed` (training seeds: training split; eval seeds: held-out)."""
        if not isinstance(seed, int) or seed < 0:
            raise JmarlError(f"code: seed must be an int >= 0, got {seed!r}")
        want_eval = is_eval_seed(seed)
        index = seed - EVAL_SEED_START if want_eval else seed
        if self.num_problems is not None:
            index %= self.num_problems
        if self.path is None:
            start = EVAL_SEED_START if want_eval else 0
            return code_problems.builtin_problem(start + index, want_eval=want_eval,
                                                 eval_fraction=self.eval_fraction,
                                                 n_tests=self.num_hidden_tests)
        pool = self._splits[1 if want_eval else 0]
        if not pool:
            which = "evaluation" if want_eval else "training"
            raise JmarlError(f"code: {self.path!r} has no {which} problems with eval_fraction="
                             f"{self.eval_fraction}; use more problems or another fraction")
        return pool[index % len(pool)]

    # ---- protocol

    def reset(self, seed: int) -> CodeState:
        return CodeState(seed=seed, problem=self.problem(seed))

    def observe(self, state: CodeState, agent: str) -> str:
        p = state.problem
        if agent not in self.agents:
            return f"Unknown agent {agent!r}; this task's agents are {', '.join(self.agents)}."
        role = _ROLE_TEXT[(self.variant, agent)]
        entry = p.entry_point
        if entry is None:
            target = "a program that reads standard input and writes standard output"
            test_form = 'assert run_program("<stdin text>") == "<expected stdout>"'
        else:
            target = f"the function {entry}"
            test_form = f"assert {entry}(...) == ..."
        fields = {"entry": entry or "the program", "target": target, "test_form": test_form}
        if self.prompt_style == "compact":
            parts = [_COMPACT_TEXT[(self.variant, agent)].format(**fields), p.description]
            if state.feedback:
                parts.append(state.feedback)
            return "\n\n".join(parts)
        parts = [role.format(**fields), "Problem:\n" + p.description]
        if state.feedback:
            parts.append(state.feedback)
        parts.append(_REPLY_TEXT[(self.variant, agent)].format(**fields))
        return "\n\n".join(parts)

    def step(self, state: CodeState, agent: str, text: str) -> tuple[CodeState, StepResult]:
        if state.finished:
            return state, StepResult(0.0, 0.0, True, {"error": "the episode is over"})
        if agent not in self.agents:
            return state, StepResult(0.0, 0.0, False, {"error": f"unknown agent {agent!r}"})
        code = extract_code(text)
        codes = tuple(code if a == agent else c for a, c in zip(self.agents, state.codes))
        state = dataclasses.replace(state, codes=codes)  # type: ignore[arg-type]
        if self.variant == "coder_tester":
            return self._step_coder_tester(state, agent, code)
        return self._step_helper_main(state, agent, code)

    def step_many(self, items: Sequence[tuple[CodeState, str, str]]) -> list[tuple[CodeState, StepResult]]:
        """`[self.step(*item) for item in items]`, with the sandbox runs of every item's step
        (hidden tests, the tester's tests on the program and on the reference) batched through
        one `run_many` first; the steps then read them from `run_tests`' cache."""
        jobs = [job for state, agent, text in items for job in self._step_jobs(state, agent, text)]
        if jobs:
            run_tests(jobs, test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)
        return [self.step(state, agent, text) for state, agent, text in items]

    def _step_jobs(self, state: CodeState, agent: str, text: str) -> list[ProgramCheck]:
        """The sandbox jobs `step(state, agent, text)` runs (mirrors `step`)."""
        if state.finished or agent not in self.agents:
            return []
        code = extract_code(text)
        codes = tuple(code if a == agent else c for a, c in zip(self.agents, state.codes))
        state = dataclasses.replace(state, codes=codes)  # type: ignore[arg-type]
        p = state.problem
        if self.variant == "helper_main":
            program = self._joint_program(state)
        elif agent == "coder":
            program = code
        else:
            program, tests = self._program_and_tests(state)
            if not tests:
                return []
            jobs = []
            if _parse(program, self.max_code_chars) is not None:
                jobs.append(self._job(p, program, tests))
            if p.reference is not None:
                jobs.append(self._job(p, p.reference, tests))
            return jobs
        if _parse(program, self.max_code_chars) is None:
            return []
        return [self._job(p, program, p.tests)]

    def end_turn(self, state: CodeState) -> CodeState:
        if state.finished:
            return state
        turn = state.turn + 1
        if self.variant == "coder_tester":
            program, tests = self._program_and_tests(state)
            results = self._tests_on(state, program, tests)
            feedback = self._coder_tester_feedback(program, tests, results)
            agreed = bool(program.strip()) and bool(results) and all(results)
            state = dataclasses.replace(state, checked=(program, tests), test_results=results)
        else:
            agreed = False
            feedback = ""
            if turn < self.max_turns:  # feedback is only read by a next turn
                results = self._examples_on(state, self._joint_program(state))
                feedback = self._helper_main_feedback(state, results)
                state = dataclasses.replace(state, test_results=results)
        return dataclasses.replace(state, turn=turn, feedback=feedback,
                                   finished=agreed or turn >= self.max_turns)

    def done(self, state: CodeState) -> bool:
        return state.finished

    def success(self, state: CodeState) -> bool:
        return state.pass_ratio >= 1.0

    def solution(self, seed: int) -> str | None:
        """The reference program for `seed` (None where the data has none)."""
        return self.problem(seed).reference

    def expert_text(self, state: CodeState, agent: str) -> str:
        p = state.problem
        if agent == "coder":
            code = p.reference
        elif agent == "tester":
            code = "\n".join(p.examples or p.tests[:3])
        elif agent == "aux":
            code = p.aux_reference
        elif agent == "main":
            code = p.main_reference
        else:
            code = None
        if not code:
            return ""
        return f"```python\n{code.rstrip()}\n```"

    # ---- coder + tester

    def _program_and_tests(self, state: CodeState) -> tuple[str, tuple[str, ...]]:
        program = state.codes[0]
        protected = {state.problem.entry_point or "run_program", "_same", "_same_lines", "_eq",
                     "run_program"}
        tests = parse_tests(state.codes[1], protected, self.max_code_chars)
        return program, tests

    def _job(self, problem: Problem, program: str, tests: Sequence[str]) -> ProgramCheck:
        return ProgramCheck(program=program, tests=tuple(tests), setup=problem.setup,
                       program_mode=problem.entry_point is None)

    def _hidden_ratio(self, problem: Problem, program: str) -> float:
        if _parse(program, self.max_code_chars) is None:
            return 0.0
        [passed] = run_tests([self._job(problem, program, problem.tests)],
                             test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)
        return _ratio(passed)

    def _tests_on(self, state: CodeState, program: str, tests: tuple[str, ...]) -> tuple[bool, ...]:
        if state.checked == (program, tests) and len(state.test_results) == len(tests):
            return state.test_results
        if not tests:
            return ()
        if _parse(program, self.max_code_chars) is None:
            return (False,) * len(tests)
        [passed] = run_tests([self._job(state.problem, program, tests)],
                             test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)
        return passed

    def _step_coder_tester(self, state: CodeState, agent: str,
                           code: str) -> tuple[CodeState, StepResult]:
        p = state.problem
        if agent == "coder":
            syntax_ok = _parse(code, self.max_code_chars) is not None
            ratio = self._hidden_ratio(p, code)
            state = dataclasses.replace(state, pass_ratio=ratio)
            info = {"code": code, "syntax_ok": syntax_ok, "hidden_pass_ratio": ratio,
                    "hidden_tests": len(p.tests)}
            return state, StepResult(ratio, ratio, False, info)
        program, tests = self._program_and_tests(state)
        info: dict[str, Any] = {"code": code, "num_tests": len(tests)}
        if not tests:
            info.update(agreement=0.0, validity=0.0)
            return state, StepResult(0.0, state.pass_ratio, False, info)
        program_ok = _parse(program, self.max_code_chars) is not None
        # A program that does not compile fails every test without being run.
        jobs = [self._job(p, program, tests if program_ok else ())]
        if p.reference is not None:
            jobs.append(self._job(p, p.reference, tests))
        outcomes = run_tests(jobs, test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)
        on_program = outcomes[0] if program_ok else (False,) * len(tests)
        tester_verdict = all(on_program)
        hidden_verdict = state.pass_ratio >= 1.0
        agreement = float(tester_verdict == hidden_verdict)
        info.update(tests_passed_by_coder=sum(on_program), tester_verdict=tester_verdict,
                    hidden_verdict=hidden_verdict, agreement=agreement)
        if p.reference is not None:
            validity = _ratio(outcomes[1])
            w = self.tester_validity_weight
            local = (1.0 - w) * agreement + w * validity
            info["validity"] = validity
        else:
            local = agreement
        state = dataclasses.replace(state, checked=(program, tests), test_results=on_program)
        return state, StepResult(local, state.pass_ratio, False, info)

    def _coder_tester_feedback(self, program: str, tests: tuple[str, ...],
                               results: tuple[bool, ...]) -> str:
        lines = [f"Turn feedback. The coder's current program:\n{_shown(program or '# (none)')}"]
        if not tests:
            lines.append("The tester wrote no runnable tests.")
        else:
            lines.append(f"The tester's tests:\n{_shown(chr(10).join(tests))}")
            failed = [t for t, ok in zip(tests, results) if not ok]
            lines.append(f"Result: {len(tests) - len(failed)} of {len(tests)} tests passed.")
            if failed:
                lines.append("Failing tests:\n" + _shown("\n".join(failed[:5])))
        return "\n".join(lines)

    # ---- helper + main

    def _joint_program(self, state: CodeState) -> str:
        aux, main = state.codes
        return f"{aux.rstrip()}\n\n\n{main}" if aux.strip() else main

    def _examples_on(self, state: CodeState, program: str) -> tuple[bool, ...]:
        p = state.problem
        if not p.examples:
            return ()
        if _parse(program, self.max_code_chars) is None:
            return (False,) * len(p.examples)
        [passed] = run_tests([self._job(p, program, p.examples)],
                             test_timeout_s=self.test_timeout_s, memory_mb=self.memory_mb)
        return passed

    def _step_helper_main(self, state: CodeState, agent: str,
                          code: str) -> tuple[CodeState, StepResult]:
        p = state.problem
        aux_code, main_code = state.codes
        aux_tree = _parse(aux_code, self.max_code_chars)
        main_tree = _parse(main_code, self.max_code_chars)
        aux_ok = _defines(aux_tree, "aux")
        main_ok = (main_tree is not None if p.entry_point is None
                   else _defines(main_tree, p.entry_point))
        joint = self._joint_program(state)
        syntax = bool(main_code.strip()) and _parse(joint, 2 * self.max_code_chars) is not None
        structure = aux_ok and main_ok
        uses_aux = syntax and aux_ok and _calls(main_tree, "aux")
        ratio = self._hidden_ratio(p, joint) if syntax else 0.0
        w_structure, w_syntax, w_pass, w_uses = self.joint_weights
        team = w_structure * structure + w_syntax * syntax + w_pass * ratio + w_uses * uses_aux
        local = float(aux_ok if agent == "aux" else main_ok)
        state = dataclasses.replace(state, pass_ratio=ratio)
        info = {"code": code, "structure": structure, "syntax_ok": syntax,
                "hidden_pass_ratio": ratio, "uses_aux": uses_aux, "aux_defined": aux_ok,
                "main_defined": main_ok, "hidden_tests": len(p.tests)}
        return state, StepResult(local, team, False, info)

    def _helper_main_feedback(self, state: CodeState, results: tuple[bool, ...]) -> str:
        aux, main = state.codes
        lines = [f"Turn feedback. The helper:\n{_shown(aux or '# (none)')}",
                 f"The main function:\n{_shown(main or '# (none)')}"]
        if results:
            failed = [t for t, ok in zip(state.problem.examples, results) if not ok]
            lines.append(f"The examples: {len(results) - len(failed)} of {len(results)} pass.")
            if failed:
                lines.append("Failing examples:\n" + _shown("\n".join(failed)))
        return "\n".join(lines)


_ROLE_TEXT = {
    ("coder_tester", "coder"): "You are the coder in a team of a coder and a unit tester. "
    "Write {target}.",
    ("coder_tester", "tester"): "You are the unit tester in a team of a coder and a unit tester. "
    "Write tests for {target}: each test is one line of the form\n{test_form}\nwith an input you "
    "choose and the correct expected output.",
    ("helper_main", "aux"): "You write a helper function named aux that {entry} will call. "
    "Decide what part of the work aux does. Do not write {entry} itself.",
    ("helper_main", "main"): "You write {target}. A helper function aux, written by a teammate, "
    "will be defined before your code; call it. Do not define aux yourself.",
}
_REPLY_TEXT = {
    ("coder_tester", "coder"): "Reply with the complete solution in one ```python code block.",
    ("coder_tester", "tester"): "Reply with your assert statements in one ```python code block.",
    ("helper_main", "aux"): "Reply with def aux(...) in one ```python code block.",
    ("helper_main", "main"): "Reply with the code for {entry} in one ```python code block.",
}
# prompt_style="compact": one line instead of the role and reply paragraphs (for small models)
_COMPACT_TEXT = {
    ("coder_tester", "coder"): "Coder: write {target} in one ```python block.",
    ("coder_tester", "tester"): "Tester: write tests `{test_form}` in one ```python block.",
    ("helper_main", "aux"): "Aux: write a helper def aux(...) for {entry} in one ```python block.",
    ("helper_main", "main"): "Main: write {target}, calling aux (defined before your code), in "
    "one ```python block.",
}


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime: float, size: int) -> tuple[Problem, ...]:
    return code_problems.load_jsonl(path)


def _load(path: str) -> tuple[Problem, ...]:
    if not os.path.isfile(path):
        raise JmarlError(f"code: problem file {path!r} not found; pass path= an existing "
                         "HumanEval/MBPP/APPS-style JSONL file")
    st = os.stat(path)
    return _load_cached(os.path.abspath(path), st.st_mtime, st.st_size)
