"""Typed conversion: `from_dict(cls, data, path)` builds a frozen dataclass from plain YAML
values, checking keys, types and declared ranges, with the dotted key and the fix in every
`JmarlError`; `parse_bytes` reads sizes ("4GiB", "4e9"). Knows no run setting: the schema is
`jmarl.config.schema`.

Ranges are declared next to the field (`_field(0.0, ge=0.0)`), checks that involve several
fields live in a `_validate(self, path)` method of the dataclass; `from_dict` runs both.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import field
from typing import Any, Literal, Mapping, Sequence, TypeVar

from jmarl.errors import JmarlError

T = TypeVar("T")


def _field(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None, factory=None):
    """A dataclass field with an allowed range (ge/gt/le/lt) checked by `from_dict`."""
    meta = {"range": (ge, gt, le, lt)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    """A readable name for a type annotation."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (tuple, list, collections.abc.Sequence):
        return "list"
    if origin in (dict, collections.abc.Mapping):
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping (section)"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _wrong_type(path: str, tp: Any, value: Any) -> JmarlError:
    return JmarlError(
        f"{path or 'config'}: expected {_type_name(tp)}, got {type(value).__name__} {_show(value)}"
    )


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else ""


def _check_range(path: str, value: Any, bounds: tuple) -> None:
    ge, gt, le, lt = bounds
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    parts, ok = [], True
    if ge is not None:
        parts.append(f">= {ge}")
        ok &= value >= ge
    if gt is not None:
        parts.append(f"> {gt}")
        ok &= value > gt
    if le is not None:
        parts.append(f"<= {le}")
        ok &= value <= le
    if lt is not None:
        parts.append(f"< {lt}")
        ok &= value < lt
    if isinstance(value, float) and math.isnan(value):
        ok = False
    if not ok:
        raise JmarlError(f"{path}: must be {' and '.join(parts)}, got {value!r}")


def _same_kind(tp: Any, value: Any) -> bool:
    """Whether `value` is of the kind annotation `tp` takes (a mapping for a section or a dict,
    a list for a sequence, a string for a str or a string Literal, ...), whatever its contents."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin is Literal:
        return any(type(value) is type(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return any(_same_kind(a, value) for a in typing.get_args(tp))
    if origin in (tuple, list, collections.abc.Sequence):
        return isinstance(value, (list, tuple))
    if origin in (dict, collections.abc.Mapping) or dataclasses.is_dataclass(tp):
        return isinstance(value, Mapping)
    if tp in (int, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Validates `value` against annotation `tp` and converts it (lists -> tuples, int -> float)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        hint = _suggest(str(value), [str(a) for a in args]) if isinstance(value, str) else ""
        msg = f"{path}: must be one of {', '.join(repr(a) for a in args)}; got {_show(value)}"
        raise JmarlError(msg + (f" — did you mean {hint!r}?" if hint else ""))
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_null = [a for a in args if a is not type(None)]
        errors = []
        for option in non_null:
            try:
                return _convert(option, value, path)
            except JmarlError as e:
                errors.append(e)
        if len(non_null) == 1:
            raise errors[0]
        # The one option of the value's kind (a mapping for a section, a string for a choice)
        # explains best what is wrong with it; with none or several, name every option.
        fitting = [e for option, e in zip(non_null, errors) if _same_kind(option, value)]
        if len(fitting) == 1:
            raise fitting[0]
        raise _wrong_type(path, tp, value)
    if origin in (tuple, list, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            raise _wrong_type(path, tp, value)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis) and args:
            if len(value) != len(args):
                raise JmarlError(f"{path}: expected a list of {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            raise _wrong_type(path, tp, value)
        ktp, vtp = args if args else (Any, Any)
        return {
            _convert(ktp, k, f"{path} key"): _convert(vtp, v, _join(path, str(k))) for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _wrong_type(path, tp, value)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _wrong_type(path, tp, value)
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise _wrong_type(path, tp, value)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _wrong_type(path, tp, value)
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise _wrong_type(path, tp, value)
        return value
    return value


# Keys older configs may hold that are no longer settings: dotted key -> why, and what to do.
_REMOVED_KEYS: dict[str, str] = {
    "train.ref_policy": (
        "the KL reference is always a frozen copy of the policy RL starts from (the warm-started "
        "one; a LoRA policy's base), and none is built when train.kl_coef is 0; remove the key "
        "(ref_policy: none meant train.kl_coef: 0)"
    ),
    "train.kl_beta": "the KL weight is train.kl_coef (the loss's name for it); rename the key",
}


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Builds dataclass `cls` from a plain dict, validating every key on the way.

    Checks: unknown keys (with a did-you-mean suggestion; a removed key, `_REMOVED_KEYS`, with
    what replaced it), missing required keys, types
    (nested dataclasses, Literal choices, Optional, tuples/lists, dicts; int accepted for float,
    bool never accepted as a number), declared ranges, then `self._validate(path)` (checks across
    fields) if the class defines it.
    `path` is the dotted prefix used in error messages.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise JmarlError(
            f"{path or 'config'}: expected a mapping (section), got {type(data).__name__} {_show(data)}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations in a foreign dataclass: check what we can
        hints = {name: (Any if isinstance(f.type, str) else f.type) for name, f in fields.items()}
    for key in data:
        if key not in fields:
            dotted = _join(path, str(key))
            if dotted in _REMOVED_KEYS:
                raise JmarlError(f"{dotted} is no longer a setting: {_REMOVED_KEYS[dotted]}")
            hint = _suggest(str(key), list(fields))
            if hint:
                raise JmarlError(f"unknown key {dotted!r} — did you mean {_join(path, hint)!r}?")
            where = f"under {path!r}" if path else "at the top level"
            raise JmarlError(f"unknown key {dotted!r}; valid keys {where}: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        dotted = _join(path, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise JmarlError(f"missing required key {dotted!r}")
            continue
        value = _convert(hints[name], data[name], dotted)
        if "range" in f.metadata:
            _check_range(dotted, value, f.metadata["range"])
        kwargs[name] = value
    try:
        obj = cls(**kwargs)
    except JmarlError as e:  # a dataclass that validates itself in __post_init__
        raise JmarlError(f"{path or 'config'}: {e}") from None
    validate = getattr(obj, "_validate", None)
    if callable(validate):
        validate(path)
    return obj


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists/scalars (tuples become lists), for YAML/JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


# Size suffixes (case-insensitive): SI powers of 1000 and binary powers of 1024.
_BYTE_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([-+]?[0-9]+))?\s*([a-z]*)\s*$", re.IGNORECASE)
BYTES_FORMS = (
    "a whole number of bytes (17179869184), a number with an exponent (16e9) or with a unit: "
    "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), case-insensitive, "
    "e.g. 80GiB, 80GB, 1.5GiB"
)


def parse_bytes(text: str | int | float) -> int:
    """A positive size in bytes from `text`: "80GiB" (80 * 2**30), "80GB" (80e9), "16e9", "512 MiB",
    "1.5gib", or a number (an int, or a float with a whole number of bytes such as YAML's 16e9).

    Suffixes are case-insensitive: B, KB, MB, GB, TB are powers of 1000, KiB, MiB, GiB, TiB powers
    of 1024. A fractional byte count is rounded to the nearest byte. Anything else (no number, an
    unknown unit, zero, a negative or non-finite size, a bool) raises JmarlError listing the forms.
    """
    def bad(why: str) -> JmarlError:
        return JmarlError(f"cannot read {text!r} as a size in bytes ({why}); write {BYTES_FORMS}")

    if isinstance(text, bool):
        raise bad("a boolean is not a size")
    if isinstance(text, (int, float)):
        value = float(text)
    elif isinstance(text, str):
        match = _BYTES_RE.match(text)
        if match is None:
            raise bad("expected a number and an optional unit")
        number, exponent, unit = match.groups()
        if unit.lower() not in _BYTE_UNITS:
            hint = _suggest(unit, ["B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB"])
            raise bad(f"unknown unit {unit!r}" + (f", did you mean {hint!r}?" if hint else ""))
        try:
            value = float(number) * 10.0 ** int(exponent or 0) * _BYTE_UNITS[unit.lower()]
        except OverflowError:
            value = math.inf
    else:
        raise bad(f"expected a string or a number, got {type(text).__name__}")
    if not math.isfinite(value) or value < 1:
        raise bad("must be at least 1 byte")
    return int(round(value))
