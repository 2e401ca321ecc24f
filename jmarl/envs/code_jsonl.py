"""Coding problems from JSONL files for the Code env: `load_jsonl(path)` reads HumanEval
(prompt/canonical_solution/test/entry_point), MBPP (text/code/test_list) and APPS
(question/solutions/input_output) records as `jmarl.envs.code_problems.Problem`s.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from jmarl.envs.code_problems import Problem
from jmarl.envs.common import read_jsonl
from jmarl.errors import JmarlError



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
