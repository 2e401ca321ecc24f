"""Coding problems for the Code env: the `Problem` record and the built-in generated set.

A `Problem` carries its statement, the function to write (or None for a stdin/stdout program),
hidden tests and visible examples as assert snippets, and reference solutions (one program, and a
helper `aux` + main split for the helper/main variant).

Built-in problems come from templates (sum of multiples, Caesar shift, rotation, ...) whose
parameters are drawn from a seed. A problem's identity is its template and parameters; its
hash puts it in the training or the evaluation split, so an evaluation problem is never a
training problem, whichever seeds produce them. Hidden-test inputs are drawn from the seed and
expected values come from running the reference solution in this process (our own code).

Problems from JSONL files (HumanEval, MBPP, APPS): `jmarl.envs.code_jsonl`.
"""

from __future__ import annotations

import hashlib
import math
import random
import string
from dataclasses import dataclass
from typing import Any, Callable

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
