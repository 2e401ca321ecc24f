"""Validation helpers shared by the method config dataclasses (raise `JmarlError`)."""

from __future__ import annotations

from typing import Any, Sequence

from jmarl.errors import JmarlError


def check_choice(config: Any, name: str, allowed: Sequence[str]) -> None:
    """Raises if `config.<name>` is not one of `allowed`."""
    value = getattr(config, name)
    if value not in allowed:
        raise JmarlError(
            f"{type(config).__name__}.{name} = {value!r} is not supported; "
            f"choose one of {', '.join(repr(a) for a in allowed)}"
        )


def check_range(
    config: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_none: bool = False,
) -> None:
    """Raises if `config.<name>` lies outside [low, high] (ends inclusive unless told)."""
    value = getattr(config, name)
    if value is None and allow_none:
        return
    cls = type(config).__name__
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise JmarlError(f"{cls}.{name} must be a number, got {value!r}")
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if too_low or too_high:
        left = "[" if low_inclusive else "("
        right = "]" if high_inclusive else ")"
        lo = "-inf" if low is None else repr(low)
        hi = "inf" if high is None else repr(high)
        raise JmarlError(f"{cls}.{name} = {value!r} is out of range; allowed {left}{lo}, {hi}{right}")


def check_int(config: Any, name: str, *, low: int, allow_none: bool = False) -> None:
    """Raises if `config.<name>` is not an int >= low."""
    value = getattr(config, name)
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise JmarlError(
            f"{type(config).__name__}.{name} = {value!r} is invalid; it must be an integer >= {low}"
        )


def check_bool(config: Any, name: str) -> None:
    """Raises if `config.<name>` is not a bool."""
    value = getattr(config, name)
    if not isinstance(value, bool):
        raise JmarlError(f"{type(config).__name__}.{name} = {value!r} must be true or false")
