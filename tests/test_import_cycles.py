"""Dependencies inside `jmarl/` point one way: no import cycle between its modules, read from
the AST (every `import`, at module level or inside a function, counts)."""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jmarl"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its __init__)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _absolute(node: ast.ImportFrom, package: list[str]) -> str:
    """The dotted module a `from ... import` names, relative ones resolved against `package`."""
    if not node.level:
        return node.module or ""
    parts = package[: len(package) - node.level + 1]
    return ".".join(parts + [node.module] if node.module else parts)


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports (`from a import b` counts `a.b` when
    that is a module, else `a`; the packages above an imported module are not counted)."""
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def import_cycles() -> list[set[str]]:
    """The strongly connected components of more than one module of the import graph."""
    modules = _modules()
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's algorithm
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(component)

    for name in sorted(graph):
        if name not in order:
            visit(name)
    return cycles


def test_no_import_cycle():
    assert import_cycles() == [], "import cycle(s) inside jmarl/"


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    package = tmp_path / "jmarl"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from jmarl.sub import b\n")
    (package / "sub" / "__init__.py").write_text("from jmarl.sub.b import g\n")
    (package / "sub" / "b.py").write_text("from .. import a\n")
    (package / "c.py").write_text("import jmarl.a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert import_cycles() == [{"jmarl.a", "jmarl.sub.b"}]  # c imports a, sub imports b: neither is in it


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def imports_into(source: str, target: str) -> dict[str, set[str]]:
    """Module of package `source` (dotted) -> the modules of package `target` it imports (only
    those that import any), read like `import_cycles` (imports inside functions count)."""
    modules = _modules()
    found = {name: {m for m in _imported(name, path, modules) if _inside(m, target)}
             for name, path in modules.items() if _inside(name, source)}
    return {name: targets for name, targets in found.items() if targets}


def test_sharding_does_not_import_the_models():
    """models -> sharding, one way: the specs take the axis trees the model declares as arguments."""
    assert imports_into("jmarl.sharding", "jmarl.models") == {}, "jmarl/sharding imports jmarl.models"


def test_the_checker_sees_sharding_import_a_model(tmp_path, monkeypatch):
    package = tmp_path / "jmarl"
    for sub in ("models", "sharding"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "models" / "model.py").write_text("from jmarl.sharding import specs\n")  # the allowed way
    (package / "sharding" / "specs.py").write_text("def f():\n    from ..models.model import g\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert imports_into("jmarl.sharding", "jmarl.models") == {"jmarl.sharding.specs": {"jmarl.models.model"}}


def test_nothing_imports_the_command_line():
    """jmarl.run is an entry point: the process set-up it shares with the memory check lives in
    jmarl.process, so no module of the package imports it."""
    importers = {name for name, path in _modules().items()
                 if name != "jmarl.run" and "jmarl.run" in _imported(name, path, _modules())}
    assert importers == set(), f"{sorted(importers)} import jmarl.run"


def test_the_models_import_only_leaves_and_sharding():
    """jmarl/models sits below the plans, the learner and the rollouts: of the rest of the package
    it imports only leaves (errors, padding, host_memory) and the sharding rules."""
    allowed = {"jmarl.errors", "jmarl.padding", "jmarl.host_memory"}
    modules = _modules()
    above = {}
    for name, path in modules.items():
        if _inside(name, "jmarl.models"):
            found = {m for m in _imported(name, path, modules)
                     if not _inside(m, "jmarl.models") and not _inside(m, "jmarl.sharding") and m not in allowed}
            if found:
                above[name] = found
    assert above == {}, f"jmarl/models imports modules above it: {above}"
