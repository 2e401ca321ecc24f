"""Loading a run config: YAML (a safe loader that also reads `1e-6` as a float; YAML 1.1 insists
on `1.0e-6`), dotted `key=value` overrides, validation into a `Config`, and dumping it back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from jmarl.config.convert import from_dict, to_dict
from jmarl.config.resolve import method_named, validate_options
from jmarl.config.schema import Config
from jmarl.errors import JmarlError


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader whose float resolver also accepts exponents without a dot (1e-6)."""


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _ch in "-+0123456789.":
    _Loader.yaml_implicit_resolvers[_ch] = [
        (tag, rx)
        for tag, rx in _Loader.yaml_implicit_resolvers.get(_ch, [])
        if tag != "tag:yaml.org,2002:float"
    ]
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str) -> Any:
    """Parses YAML `text`; `source` names where it came from in the error message."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise JmarlError(f"cannot parse {source}{where}: {problem}") from None


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    """The mapping in YAML file `path` (an empty file is {})."""
    p = Path(path)
    if not p.is_file():
        raise JmarlError(f"config file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise JmarlError(f"cannot read config file {p}: {e}") from None
    data = parse_yaml(text, f"config file {p}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JmarlError(
            f"config file {p}: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    return data


def apply_override(data: dict[str, Any], override: str) -> dict[str, Any]:
    """A copy of `data` with one `dotted.key=value` override applied (value parsed as YAML)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise JmarlError(f"bad override {override!r}: expected key=value, e.g. train.steps=10")
    value = parse_yaml(text, f"override {override!r}") if text.strip() else None
    parts = key.split(".")
    out = dict(data)
    node = out
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            raise JmarlError(
                f"bad override {override!r}: {'.'.join(parts[: i + 1])!r} is a value, not a section"
            )
        node[part] = dict(child)
        node = node[part]
    node[parts[-1]] = value
    return out


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Validates a merged config dict into a `Config` (fills `workflow.plan` and
    `workflow.group_size` from the method's defaults where they are not given)."""
    data = dict(data)
    algo = data.get("algo")
    workflow = data.get("workflow")
    name = algo.get("name", "grpo") if isinstance(algo, Mapping) else "grpo" if algo is None else None
    if isinstance(name, str) and (workflow is None or isinstance(workflow, Mapping)):
        method = method_named(name)
        defaults = {"plan": method.default_plan, "group_size": method.default_group_size}
        data["workflow"] = {**defaults, **(workflow or {})}
    config = from_dict(Config, data)
    validate_options(config)
    return config


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Reads YAML file `path` (None: start from {}), applies `key=value` overrides, validates."""
    data = read_yaml_file(path) if path is not None else {}
    for override in overrides:
        data = apply_override(data, override)
    return config_from_dict(data)


def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as plain dicts/lists/scalars (what `dump_yaml` writes)."""
    return to_dict(config)


def dump_yaml(config: Config) -> str:
    """The config as YAML text; `load_config` on it gives an equal `Config`."""
    return yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False)
