"""Coding problems for the Code env: a built-in generated set and a JSONL loader.

A `Problem` carries its statement, the function to write (or None for a stdin/stdout program),
hidden tests and visible examples as assert snippets, and reference solutions (one program, and a
helper `aux` + main split for the helper/main variant).

Built-in problems come from templates (sum of multiples, Caesar shift, rotation, ...) whose
parameters are drawn from a seed. A problem's identity is its template and parameters; its
hash puts it in the training or the evaluation split, so an evaluation problem is never a
training problem, whichever seeds produce them. Hidden-test inputs are drawn from the seed and
expected values come from running the reference solution in this process (our own code).

`load_jsonl(path)` reads HumanEval (prompt/canonical_solution/test/entry_point), MBPP
(text/code/test_list) and APPS (question/solutions/input_output) records.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import random
import re
import string
from dataclasses import dataclass
from typing import Any, Callable

from jmarl.envs.common import read_jsonl
from jmarl.errors import JmarlError

NUM_HIDDEN_TESTS = 8
NUM_EXAMPLES = 2


@dataclass(frozen=True)
class Problem:
    """One coding task.

    task_id: a stable identifier; description: the statement shown to the agents (with the
    signature and examples); entry_point: the function to write, or None for a program reading
    stdin and writing stdout; signature: its `def` line ("" for programs); tests: hidden assert
    snippets; examples: visible assert snippets; setup: code the tests need (imports);
    reference: a correct program; aux_reference/main_reference: a correct helper `aux` and a
    correct main part that calls it (the helper/main variant). References may be None.

    Test snippets may call `_same(value, expected)` (type-strict equality) and, for programs,
    `run_program(stdin) -> stdout`; both are provided by the test harness.
    """

    task_id: str
    description: str
    entry_point: str | None
    signature: str
    tests: tuple[str, ...]
    examples: tuple[str, ...]
    setup: str = ""
    reference: str | None = None
    aux_reference: str | None = None
    main_reference: str | None = None


def problem_hash(identity: str) -> float:
    """A uniform number in [0, 1) from the problem's identity (sha256)."""
    digest = hashlib.sha256(identity.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_eval_identity(identity: str, eval_fraction: float) -> bool:
    """Whether the problem with this identity belongs to the held-out evaluation split."""
    return problem_hash(identity) < eval_fraction


# ------------------------------------------------------------------------------------ templates


@dataclass(frozen=True)
class _Template:
    """A family of problems; the functions take the sampled parameters `p`."""

    name: str
    sample_params: Callable[[random.Random], dict]
    describe: Callable[[dict], str]
    signature: Callable[[dict], str]
    reference: Callable[[dict], str]  # one function named `name`
    aux: Callable[[dict], str]  # a helper named `aux`
    main: Callable[[dict], str]  # `name`, calling aux
    sample_args: Callable[[random.Random, dict], tuple]


def _ints(rng: random.Random, lo: int, hi: int, n_lo: int, n_hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(n_lo, n_hi))]


def _word(rng: random.Random, alphabet: str, n_lo: int, n_hi: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(n_lo, n_hi)))


def _two_distinct(rng: random.Random, lo: int, hi: int) -> tuple[int, int]:
    a, b = rng.sample(range(lo, hi + 1), 2)
    return a, b


_TEMPLATES: tuple[_Template, ...] = (
    _Template(
        name="sum_multiples",
        sample_params=lambda rng: dict(zip("ab", sorted(_two_distinct(rng, 2, 9)))),
        describe=lambda p: f"Return the sum of all integers in [1, n] that are divisible by "
        f"{p['a']} or by {p['b']} (0 if there are none).",
        signature=lambda p: "def sum_multiples(n: int) -> int:",
        reference=lambda p: (
            "def sum_multiples(n):\n"
            f"    return sum(i for i in range(1, n + 1)\n"
            f"               if i % {p['a']} == 0 or i % {p['b']} == 0)\n"
        ),
        aux=lambda p: "def aux(n, k):\n    m = n // k\n    return k * m * (m + 1) // 2\n",
        main=lambda p: (
            "def sum_multiples(n):\n"
            f"    both = {p['a'] * p['b'] // math.gcd(p['a'], p['b'])}\n"
            f"    return aux(n, {p['a']}) + aux(n, {p['b']}) - aux(n, both)\n"
        ),
        sample_args=lambda rng, p: (rng.randint(0, 300),),
    ),
    _Template(
        name="count_chars",
        sample_params=lambda rng: {"chars": "".join(sorted(rng.sample("abcdefghij", 3)))},
        describe=lambda p: f"Return how many characters of the string s are one of the letters "
        f"{', '.join(repr(c) for c in p['chars'])}.",
        signature=lambda p: "def count_chars(s: str) -> int:",
        reference=lambda p: (
            f"def count_chars(s):\n    return sum(1 for c in s if c in {p['chars']!r})\n"
        ),
        aux=lambda p: f"def aux(c):\n    return c in {p['chars']!r}\n",
        main=lambda p: "def count_chars(s):\n    return sum(1 for c in s if aux(c))\n",
        sample_args=lambda rng, p: (_word(rng, "abcdefghij xyz", 0, 20),),
    ),
    _Template(
        name="affine_filter",
        sample_params=lambda rng: (lambda m: {"a": rng.randint(-4, 5), "b": rng.randint(-9, 9),
                                              "m": m, "r": rng.randint(0, m - 1)})(
            rng.randint(2, 5)),
        describe=lambda p: f"Return the list of {p['a']} * x + {p['b']} for every x in xs with "
        f"x % {p['m']} == {p['r']}, in order.",
        signature=lambda p: "def affine_filter(xs: list[int]) -> list[int]:",
        reference=lambda p: (
            "def affine_filter(xs):\n"
            f"    return [{p['a']} * x + {p['b']} for x in xs if x % {p['m']} == {p['r']}]\n"
        ),
        aux=lambda p: f"def aux(x):\n    return {p['a']} * x + {p['b']}\n",
        main=lambda p: (
            f"def affine_filter(xs):\n    return [aux(x) for x in xs if x % {p['m']} == {p['r']}]\n"
        ),
        sample_args=lambda rng, p: (_ints(rng, -20, 20, 0, 10),),
    ),
    _Template(
        name="rotate_left",
        sample_params=lambda rng: {"k": rng.choice([-3, -2, -1, 1, 2, 3, 4, 5, 7])},
        describe=lambda p: f"Return the list xs rotated left by {p['k']} positions (a negative "
        "amount rotates right; the amount wraps around the length; an empty list stays empty).",
        signature=lambda p: "def rotate_left(xs: list[int]) -> list[int]:",
        reference=lambda p: (
            "def rotate_left(xs):\n"
            "    if not xs:\n"
            "        return []\n"
            f"    k = {p['k']} % len(xs)\n"
            "    return xs[k:] + xs[:k]\n"
        ),
        aux=lambda p: "def aux(k, n):\n    return k % n if n else 0\n",
        main=lambda p: (
            f"def rotate_left(xs):\n    k = aux({p['k']}, len(xs))\n    return xs[k:] + xs[:k]\n"
        ),
        sample_args=lambda rng, p: (_ints(rng, 0, 9, 0, 8),),
    ),
    _Template(
        name="caesar_shift",
        sample_params=lambda rng: {"k": rng.randint(1, 25)},
        describe=lambda p: f"Shift every lowercase letter of s forward by {p['k']} places in the "
        "alphabet, wrapping from 'z' to 'a'; leave every other character unchanged.",
        signature=lambda p: "def caesar_shift(s: str) -> str:",
        reference=lambda p: (
            "def caesar_shift(s):\n"
            "    out = []\n"
            "    for c in s:\n"
            "        if 'a' <= c <= 'z':\n"
            f"            c = chr((ord(c) - 97 + {p['k']}) % 26 + 97)\n"
            "        out.append(c)\n"
            "    return ''.join(out)\n"
        ),
        aux=lambda p: (
            "def aux(c):\n"
            "    if 'a' <= c <= 'z':\n"
            f"        return chr((ord(c) - 97 + {p['k']}) % 26 + 97)\n"
            "    return c\n"
        ),
        main=lambda p: "def caesar_shift(s):\n    return ''.join(aux(c) for c in s)\n",
        sample_args=lambda rng, p: (_word(rng, string.ascii_lowercase + " XY!", 0, 16),),
    ),
    _Template(
        name="recurrence",
        sample_params=lambda rng: {"a": rng.randint(1, 4), "b": rng.randint(1, 4),
                                   "m": rng.choice([97, 101, 1000, 1009]), "f0": rng.randint(0, 3),
                                   "f1": rng.randint(1, 5)},
        describe=lambda p: f"Return f(n) where f(0) = {p['f0']}, f(1) = {p['f1']} and "
        f"f(n) = ({p['a']} * f(n - 1) + {p['b']} * f(n - 2)) % {p['m']} for n >= 2.",
        signature=lambda p: "def recurrence(n: int) -> int:",
        reference=lambda p: (
            "def recurrence(n):\n"
            f"    x, y = {p['f0']}, {p['f1']}\n"
            "    for _ in range(n):\n"
            f"        x, y = y, ({p['a']} * y + {p['b']} * x) % {p['m']}\n"
            "    return x\n"
        ),
        aux=lambda p: (
            f"def aux(prev, prev2):\n    return ({p['a']} * prev + {p['b']} * prev2) % {p['m']}\n"
        ),
        main=lambda p: (
            "def recurrence(n):\n"
            f"    x, y = {p['f0']}, {p['f1']}\n"
            "    for _ in range(n):\n"
            "        x, y = y, aux(y, x)\n"
            "    return x\n"
        ),
        sample_args=lambda rng, p: (rng.randint(0, 60),),
    ),
    _Template(
        name="digit_sum",
        sample_params=lambda rng: {"base": rng.randint(2, 16)},
        describe=lambda p: f"Return the sum of the digits of the non-negative integer n written "
        f"in base {p['base']}.",
        signature=lambda p: "def digit_sum(n: int) -> int:",
        reference=lambda p: (
            "def digit_sum(n):\n"
            "    total = 0\n"
            "    while n:\n"
            f"        n, d = divmod(n, {p['base']})\n"
            "        total += d\n"
            "    return total\n"
        ),
        aux=lambda p: (
            "def aux(n):\n"
            "    digits = []\n"
            "    while n:\n"
            f"        n, d = divmod(n, {p['base']})\n"
            "        digits.append(d)\n"
            "    return digits\n"
        ),
        main=lambda p: "def digit_sum(n):\n    return sum(aux(n))\n",
        sample_args=lambda rng, p: (rng.choice([0, rng.randint(1, 50), rng.randint(50, 10**6)]),),
    ),
    _Template(
        name="count_pairs",
        sample_params=lambda rng: {"target": rng.randint(-5, 12)},
        describe=lambda p: f"Return the number of index pairs i < j with xs[i] + xs[j] == "
        f"{p['target']}.",
        signature=lambda p: "def count_pairs(xs: list[int]) -> int:",
        reference=lambda p: (
            "def count_pairs(xs):\n"
            "    n = len(xs)\n"
            "    return sum(1 for i in range(n) for j in range(i + 1, n)\n"
            f"               if xs[i] + xs[j] == {p['target']})\n"
        ),
        aux=lambda p: f"def aux(x, y):\n    return x + y == {p['target']}\n",
        main=lambda p: (
            "def count_pairs(xs):\n"
            "    n = len(xs)\n"
            "    return sum(1 for i in range(n) for j in range(i + 1, n) if aux(xs[i], xs[j]))\n"
        ),
        sample_args=lambda rng, p: (_ints(rng, p["target"] - 8, 8, 2, 10),),
    ),
    _Template(
        name="run_length",
        sample_params=lambda rng: {"count_first": rng.random() < 0.5,
                                   "sep": rng.choice(["", "-", ":"])},
        describe=lambda p: "Run-length encode s: for each maximal run of one repeated character, "
        + ("write the run length then the character" if p["count_first"]
           else "write the character then the run length")
        + (f", joining the runs with {p['sep']!r}" if p["sep"] else ", with no separator")
        + ". An empty string encodes to ''.",
        signature=lambda p: "def run_length(s: str) -> str:",
        reference=lambda p: (
            "def run_length(s):\n"
            "    runs = []\n"
            "    i = 0\n"
            "    while i < len(s):\n"
            "        j = i\n"
            "        while j < len(s) and s[j] == s[i]:\n"
            "            j += 1\n"
            + ("        runs.append(str(j - i) + s[i])\n" if p["count_first"]
               else "        runs.append(s[i] + str(j - i))\n")
            + "        i = j\n"
            f"    return {p['sep']!r}.join(runs)\n"
        ),
        aux=lambda p: (
            "def aux(ch, count):\n"
            + ("    return str(count) + ch\n" if p["count_first"]
               else "    return ch + str(count)\n")
        ),
        main=lambda p: (
            "def run_length(s):\n"
            "    runs = []\n"
            "    i = 0\n"
            "    while i < len(s):\n"
            "        j = i\n"
            "        while j < len(s) and s[j] == s[i]:\n"
            "            j += 1\n"
            "        runs.append(aux(s[i], j - i))\n"
            "        i = j\n"
            f"    return {p['sep']!r}.join(runs)\n"
        ),
        sample_args=lambda rng, p: ("".join(rng.choice("aab") * rng.randint(1, 3)
                                            for _ in range(rng.randint(0, 6))),),
    ),
    _Template(
        name="kth_largest",
        sample_params=lambda rng: {"k": rng.randint(1, 3)},
        describe=lambda p: f"Return the {p['k']}-th largest distinct value in xs (k = 1 is the "
        f"maximum), or None if xs has fewer than {p['k']} distinct values.",
        signature=lambda p: "def kth_largest(xs: list[int]) -> int | None:",
        reference=lambda p: (
            "def kth_largest(xs):\n"
            "    values = sorted(set(xs), reverse=True)\n"
            f"    return values[{p['k'] - 1}] if len(values) >= {p['k']} else None\n"
        ),
        aux=lambda p: "def aux(xs):\n    return sorted(set(xs), reverse=True)\n",
        main=lambda p: (
            "def kth_largest(xs):\n"
            "    values = aux(xs)\n"
            f"    return values[{p['k'] - 1}] if len(values) >= {p['k']} else None\n"
        ),
        sample_args=lambda rng, p: (_ints(rng, -5, 9, 0, 7),),
    ),
    _Template(
        name="clamp_sum",
        sample_params=lambda rng: dict(zip(("lo", "hi"), sorted(_two_distinct(rng, -10, 15)))),
        describe=lambda p: f"Return the sum of the values of xs after clamping each one to the "
        f"range [{p['lo']}, {p['hi']}].",
        signature=lambda p: "def clamp_sum(xs: list[int]) -> int:",
        reference=lambda p: (
            f"def clamp_sum(xs):\n    return sum(min(max(x, {p['lo']}), {p['hi']}) for x in xs)\n"
        ),
        aux=lambda p: f"def aux(x):\n    return min(max(x, {p['lo']}), {p['hi']})\n",
        main=lambda p: "def clamp_sum(xs):\n    return sum(aux(x) for x in xs)\n",
        sample_args=lambda rng, p: (_ints(rng, -30, 30, 0, 10),),
    ),
    _Template(
        name="long_words",
        sample_params=lambda rng: {"min_len": rng.randint(2, 5), "upper": rng.random() < 0.5},
        describe=lambda p: f"Split s on single spaces and return, in order, the words with at "
        f"least {p['min_len']} characters, "
        + ("upper-cased." if p["upper"] else "reversed (each word's characters in reverse order)."),
        signature=lambda p: "def long_words(s: str) -> list[str]:",
        reference=lambda p: (
            "def long_words(s):\n"
            f"    return [w.upper() if {p['upper']} else w[::-1] for w in s.split(' ') "
            f"if len(w) >= {p['min_len']}]\n"
        ),
        aux=lambda p: "def aux(w):\n" + ("    return w.upper()\n" if p["upper"]
                                         else "    return w[::-1]\n"),
        main=lambda p: (
            "def long_words(s):\n"
            f"    return [aux(w) for w in s.split(' ') if len(w) >= {p['min_len']}]\n"
        ),
        sample_args=lambda rng, p: (
            " ".join(_word(rng, "abcde", 1, 7) for _ in range(rng.randint(0, 6))),),
    ),
)

TEMPLATE_NAMES = tuple(t.name for t in _TEMPLATES)


def _call_value(source: str, entry_point: str, args: tuple) -> Any:
    """Runs our own reference `source` in-process and calls `entry_point(*args)`."""
    namespace: dict = {"math": math}
    exec(compile(source, f"<reference {entry_point}>", "exec"), namespace)  # our own code
    return namespace[entry_point](*args)


def _args_text(args: tuple) -> str:
    return ", ".join(repr(a) for a in args)


def _params_text(params: dict) -> str:
    return ",".join(f"{k}={params[k]!r}" for k in sorted(params))


def _builtin_problem(template: _Template, params: dict, rng: random.Random,
                     n_tests: int) -> Problem:
    """The problem for `template` with `params`; test inputs are drawn from `rng`.

    Hidden tests compare type-strictly (`_same`), so an object that claims equality with
    everything does not pass; the visible examples are shown as plain `==` asserts.
    """
    reference = template.reference(params)
    name = template.name
    cases: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for _ in range((NUM_EXAMPLES + n_tests) * 20):
        args = template.sample_args(rng, params)
        text = _args_text(args)
        if text in seen:
            continue
        seen.add(text)
        cases.append((text, _call_value(reference, name, args)))
        if len(cases) == NUM_EXAMPLES + n_tests:
            break
    examples = tuple(f"assert {name}({a}) == {e!r}" for a, e in cases[:NUM_EXAMPLES])
    tests = tuple(f"assert _same({name}({a}), {e!r})" for a, e in cases[NUM_EXAMPLES:])
    description = (
        f"{template.describe(params)}\n\n"
        f"Write the function:\n{template.signature(params)}\n\n"
        "Examples:\n" + "\n".join(examples)
    )
    return Problem(
        task_id=f"builtin:{name}({_params_text(params)})",
        description=description,
        entry_point=name,
        signature=template.signature(params),
        tests=tests,
        examples=examples,
        reference=reference,
        aux_reference=template.aux(params),
        main_reference=template.main(params),
    )


def builtin_problem(seed: int, *, want_eval: bool, eval_fraction: float,
                    n_tests: int = NUM_HIDDEN_TESTS) -> Problem:
    """The built-in problem for `seed`, drawn from the split `want_eval` selects.

    Templates and parameters are drawn from `random.Random(seed)` until the problem's identity
    hashes into the requested split, so the train and eval problem sets are disjoint.
    """
    rng = random.Random(f"jmarl-code-{seed}")
    for _ in range(10_000):
        template = rng.choice(_TEMPLATES)
        params = template.sample_params(rng)
        identity = f"builtin:{template.name}({_params_text(params)})"
        if is_eval_identity(identity, eval_fraction) == want_eval:
            return _builtin_problem(template, params, rng, n_tests)
    raise JmarlError(f"no built-in code problem found for the requested split with "
                     f"eval_fraction={eval_fraction}; use a value in (0, 1)")


# ---------------------------------------------------------------------------------- JSONL files


def _function_names(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _split_check_function(test_source: str) -> tuple[str, tuple[str, ...]]:
    """HumanEval's `test` (module code + `def check(candidate)`) -> (setup, assert snippets).

    Each top-level assert of `check` becomes one test; the other statements of `check` are kept
    before every assert. Falls back to one test calling check() when the shape is unexpected.
    """
    try:
        tree = ast.parse(test_source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "", (test_source + "\ncheck(candidate)",)
    setup_nodes, check = [], None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            check = node
        else:
            setup_nodes.append(node)
    setup = "\n".join(ast.unparse(n) for n in setup_nodes)
    if check is None or not check.args.args:
        return setup, (test_source + "\ncheck(candidate)",)
    param = check.args.args[0].arg
    prelude = [n for n in check.body if not isinstance(n, ast.Assert)]
    asserts = [n for n in check.body if isinstance(n, ast.Assert)]
    if not asserts:
        return setup, (test_source + "\ncheck(candidate)",)
    head = "\n".join([f"{param} = candidate"] + [ast.unparse(n) for n in prelude])
    return setup, tuple(f"{head}\n{ast.unparse(a)}" for a in asserts)


def _split_references(reference: str | None,
                      entry_point: str | None) -> tuple[str | None, str | None]:
    """A generic helper/main split of a reference: `aux` does the work, main calls it."""
    if reference is None:
        return None, None
    if entry_point is None:
        aux = (f"_SOLUTION = {reference!r}\n\n\ndef aux():\n"
               "    exec(_SOLUTION, {'__name__': '__main__'})\n")
        return aux, "aux()\n"
    renamed = re.sub(rf"\b{re.escape(entry_point)}\b", "aux", reference)
    main = f"def {entry_point}(*args, **kwargs):\n    return aux(*args, **kwargs)\n"
    return renamed, main


def _humaneval(record: dict) -> Problem:
    entry = record["entry_point"]
    setup, tests = _split_check_function(record["test"])
    tests = tuple(f"candidate = {entry}\n{t}" for t in tests)
    reference = record["prompt"] + record["canonical_solution"]
    aux, main = _split_references(reference, entry)
    return Problem(
        task_id=str(record["task_id"]),
        description=f"Complete the function {entry}:\n\n{record['prompt']}",
        entry_point=entry,
        signature=f"def {entry}(...):",
        tests=tests,
        examples=(),
        setup=setup,
        reference=reference,
        aux_reference=aux,
        main_reference=main,
    )


def _mbpp(record: dict) -> Problem:
    tests = tuple(record["test_list"]) + tuple(record.get("challenge_test_list") or ())
    code = record.get("code")
    names = _function_names(code or "")
    called = [n for n in names if any(re.search(rf"\b{re.escape(n)}\s*\(", t) for t in tests)]
    entry = (called or names or [None])[0]
    if entry is None:
        match = re.search(r"assert\W*(\w+)\s*\(", tests[0]) if tests else None
        entry = match.group(1) if match else None
    if entry is None:
        raise JmarlError("an MBPP record names no function (no def in 'code', no call in tests)")
    aux, main = _split_references(code, entry)
    return Problem(
        task_id=str(record.get("task_id", record["text"][:40])),
        description=f"{record['text']}\n\nYour function must be named {entry}. "
        f"Your code should pass tests like:\n{tests[0] if tests else ''}",
        entry_point=entry,
        signature=f"def {entry}(...):",
        tests=tests,
        examples=tests[:1],
        setup=record.get("test_setup_code") or "",
        reference=code,
        aux_reference=aux,
        main_reference=main,
    )


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except json.JSONDecodeError:
            return None
    return value


def _apps(record: dict) -> Problem:
    io = _maybe_json(record["input_output"]) or {}
    inputs, outputs = io.get("inputs") or [], io.get("outputs") or []
    if not inputs or len(inputs) != len(outputs):
        raise JmarlError("an APPS record has no usable input_output (inputs/outputs)")
    solutions = _maybe_json(record.get("solutions")) or []
    reference = solutions[0] if solutions else None
    entry = io.get("fn_name")
    starter = record.get("starter_code") or ""
    if entry:
        tests = tuple(
            f"_result = {entry}(*{inp!r})\nassert _result == {out!r} or [_result] == {out!r}"
            for inp, out in zip(inputs, outputs)
        )
        how = f"Write the function {entry}.\n{starter}"
    else:
        tests = tuple(
            "assert _same_lines(run_program(%r), %r)" % (_text(inp), _text(out))
            for inp, out in zip(inputs, outputs)
        )
        how = "Write a program that reads standard input and writes standard output."
    aux, main = _split_references(reference, entry or None)
    return Problem(
        task_id=str(record.get("problem_id", record.get("id", record["question"][:40]))),
        description=f"{record['question']}\n\n{how}",
        entry_point=entry or None,
        signature=f"def {entry}(...):" if entry else "",
        tests=tests,
        examples=tests[:1],
        reference=reference,
        aux_reference=aux,
        main_reference=main,
    )


def _text(value: Any) -> str:
    return "\n".join(value) if isinstance(value, list) else str(value)


def load_jsonl(path: str) -> tuple[Problem, ...]:
    """Reads HumanEval, MBPP or APPS records (one JSON object per line) from `path`.

    The format is detected per record: HumanEval has `canonical_solution` and `test`, MBPP has
    `test_list`, APPS has `input_output`.
    """
    problems = []
    for where, record in read_jsonl(path, "code"):
        try:
            if "canonical_solution" in record and "test" in record:
                problems.append(_humaneval(record))
            elif "test_list" in record:
                problems.append(_mbpp(record))
            elif "input_output" in record:
                problems.append(_apps(record))
            else:
                raise JmarlError("unknown record format")
        except (KeyError, TypeError, JmarlError) as e:
            raise JmarlError(
                f"{where}: not a HumanEval (prompt, canonical_solution, test, entry_point), MBPP "
                f"(text, code, test_list) or APPS (question, solutions, input_output) record "
                f"({type(e).__name__}: {e})"
            ) from None
    if not problems:
        raise JmarlError(f"{path!r} holds no problems")
    return tuple(problems)
