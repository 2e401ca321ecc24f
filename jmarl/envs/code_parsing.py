"""Reading Python out of a model reply, for the code env (`jmarl.envs.code`).

`extract_code` never raises: the code is the ```python fenced blocks of the reply (joined),
else any fenced blocks, else the text after an unclosed fence, else the whole text.
`parse_code` is the env's "does it compile" check: code longer than the env's
`max_code_chars` or that does not compile has no tree, scores as non-compiling and is never
run. `parse_tests` splits a tester's reply into runnable tests; `defines` and `calls` look for
a function in a tree.
"""

from __future__ import annotations

import ast
import re
from typing import Any

MAX_TESTER_TESTS = 20
_MAX_REPLY_CHARS = 200_000

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


def parse_code(code: str, max_chars: int) -> ast.Module | None:
    """The AST of `code`, or None if it is empty, too long, or does not compile."""
    if not code.strip() or len(code) > max_chars:
        return None
    try:
        tree = ast.parse(code)
        compile(tree, "solution.py", "exec")  # compiles only (e.g. catches 'return' outside def)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError, OverflowError):
        return None
    return tree


def defines(tree: ast.Module | None, name: str) -> bool:
    """Whether `tree` defines a top-level function `name`."""
    if tree is None:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
               for n in tree.body)


def calls(tree: ast.Module | None, name: str) -> bool:
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
    tree = parse_code(code, max_chars)
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
