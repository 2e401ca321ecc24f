"""The test harness of the code env: runs model-written programs against tests in
`jmarl.sandbox`, many programs per sandbox call, with a cache of outcomes.

Programs run in `jmarl.sandbox` through a harness that reports each test's outcome on
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
"""

from __future__ import annotations

import ast
import collections
import inspect
import json
import os
import secrets
import textwrap
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from jmarl.sandbox import SandboxResult, run_many


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
