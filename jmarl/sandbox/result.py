"""What a sandboxed run ends in: `SandboxResult` and its status, one of STATUSES.

  "ok"       the program exited with code 0;
  "error"    it exited with a non-zero code (an uncaught exception: traceback in stderr);
  "timeout"  it ran past the wall-clock timeout or its CPU-time limit;
  "memory"   it raised MemoryError (it hit the address-space limit);
  "killed"   it died from a signal (segfault, abort...) or flooded its output past the cap.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from jmarl.sandbox.audit_hook import MEMORY_EXIT
from jmarl.sandbox.launcher import SETUP_EXIT

STATUSES = ("ok", "error", "timeout", "memory", "killed")


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed program.

    status: one of STATUSES; stdout/stderr: the decoded output (UTF-8, invalid bytes replaced),
    each cut at the output cap; duration_s: wall-clock seconds from start to cleanup.
    """

    status: str
    stdout: str
    stderr: str
    duration_s: float


def classify(wait_status: str, launcher_code: int | None, timed_out: bool, flooded: bool) -> str:
    """The status of a run from the program's wait status ("exit N" / "signal N", as the
    launcher reports it; "" when it reported none), the launcher's exit code, and whether the
    parent stopped the run for its timeout or an output flood."""
    if timed_out:
        return "timeout"
    if flooded:
        return "killed"
    kind, _, number = wait_status.partition(" ")
    if kind == "exit" and number.isdigit():
        code = int(number)
        if code == 0:
            return "ok"
        return "memory" if code == MEMORY_EXIT else "error"
    if kind == "signal" and number.isdigit():
        return "timeout" if int(number) == signal.SIGXCPU else "killed"
    # No status: the launcher failed before the program ran, or the init process was killed.
    return "error" if launcher_code == SETUP_EXIT else "killed"
