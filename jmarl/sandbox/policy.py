"""The isolation policy: whether a weak level may run model-written code at all.

"strict" (the default) refuses a level that cannot keep the program off the user's files
(`levels.WEAK_LEVELS`); "allow_weak" accepts it. Set from the config's `sandbox.isolation`
(`set_isolation_policy`) or the JMARL_SANDBOX_ISOLATION variable. `require_isolation`, which
every run of model-written code goes through, applies it and logs the level once per process;
`run_summary` reports that level for a run's summary.
"""

from __future__ import annotations

import os
import sys

from jmarl.errors import JmarlError
from jmarl.sandbox.levels import DESCRIPTIONS, WEAK_LEVELS, isolation_level, probed_level

ISOLATION_POLICIES = ("strict", "allow_weak")
_POLICY: str | None = None  # set_isolation_policy's; None: $JMARL_SANDBOX_ISOLATION or strict
_LOGGED = False  # whether require_isolation has logged the level (code has run)


def set_isolation_policy(policy: str) -> None:
    """Sets the policy for weak isolation levels: "strict" (refuse) or "allow_weak"."""
    global _POLICY
    if policy not in ISOLATION_POLICIES:
        raise JmarlError(f"sandbox.isolation must be one of {ISOLATION_POLICIES}, got {policy!r}")
    _POLICY = policy


def isolation_policy() -> str:
    """The policy in force: `set_isolation_policy`'s, else $JMARL_SANDBOX_ISOLATION, else
    "strict"."""
    policy = _POLICY or os.environ.get("JMARL_SANDBOX_ISOLATION") or "strict"
    if policy not in ISOLATION_POLICIES:
        raise JmarlError(f"JMARL_SANDBOX_ISOLATION must be one of {ISOLATION_POLICIES}, got "
                         f"{policy!r}")
    return policy


def require_isolation(log: bool = True) -> str:
    """The isolation level model-written code will run at; with `log`, the first call that
    runs code says which (one line on stderr, once per process).

    Raises:
      JmarlError if the level is weak (cannot keep the program off the user's files) and the
      policy is "strict", naming the setting that accepts it.
    """
    global _LOGGED
    level = isolation_level()
    policy = isolation_policy()
    if level in WEAK_LEVELS and policy == "strict":
        raise JmarlError(
            f"the code sandbox can only reach isolation level {level!r} on this machine (no "
            f"user namespaces: {DESCRIPTIONS[level]}), so a model-written program could read "
            "this user's files; running model-written code is refused. To accept the weaker "
            "isolation, set `sandbox.isolation: allow_weak` in the config (or "
            "JMARL_SANDBOX_ISOLATION=allow_weak); see docs/sandbox.md")
    if log and not _LOGGED:
        _LOGGED = True
        print(f"[jmarl] sandbox: isolation level {level!r} ({DESCRIPTIONS[level]})"
              + (", accepted by sandbox.isolation: allow_weak" if level in WEAK_LEVELS else ""),
              file=sys.stderr, flush=True)
    return level


def run_summary() -> dict[str, str]:
    """{"sandbox_isolation": level} once model-written code has run in this process (the level
    it ran at, as logged), else {}: what a run's summary records."""
    level = probed_level()
    return {"sandbox_isolation": level} if _LOGGED and level is not None else {}
