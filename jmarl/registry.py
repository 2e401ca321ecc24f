"""Names that select a value: a registered one, or your own given as `package.module:NAME`
(`algo.name` a `jmarl.algos.Method`, `workflow.plan` a `jmarl.workflows.Plan`)."""

from __future__ import annotations

import importlib
from typing import Mapping, TypeVar

from jmarl.errors import JmarlError

T = TypeVar("T")


def lookup(name: str, registry: Mapping[str, T], kind: type, *, public: str, setting: str, unknown: str,
           build: str) -> T:
    """The value `name` selects: `registry[name]`, or the `kind` instance `package.module:NAME`
    names. JmarlError otherwise: `unknown` (e.g. "unknown algorithm") with the registered
    choices, or the import failure, or the wrong type naming `public` (where users import
    `kind` from) and `build` (how to make one); `setting` is the config key the name came from."""
    if name in registry:
        return registry[name]
    if ":" not in name:
        raise JmarlError(
            f"{unknown} {name!r}; choose one of {', '.join(sorted(registry))} "
            f"(or give your own {kind.__name__} as 'package.module:NAME')"
        )
    module_name, attr = name.split(":", 1)
    try:
        value = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise JmarlError(f"{setting} {name!r} cannot be imported ({e}); check the module path and name") from None
    if not isinstance(value, kind):
        raise JmarlError(f"{setting} {name!r} is a {type(value).__name__}, not a {public}; build one with {build}")
    return value
