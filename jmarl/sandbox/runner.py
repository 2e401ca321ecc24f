"""Running model-written programs: `run_python` (one) and `run_many` (several at once).

Both check the caller's limits, apply the isolation policy (`policy.require_isolation`: the
level is probed once, a weak one refused under "strict", the level logged once), then run each
program through `spawn.run_at_level`. Neither raises on anything the program does.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from jmarl.errors import JmarlError
from jmarl.sandbox.policy import require_isolation
from jmarl.sandbox.result import SandboxResult
from jmarl.sandbox.spawn import run_at_level


def _check_options(timeout_s: float, memory_mb: int, max_output_bytes: int) -> None:
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 3600):
        raise JmarlError(f"sandbox timeout_s must be in (0, 3600] seconds, got {timeout_s!r}")
    if not (isinstance(memory_mb, int) and memory_mb >= 64):
        raise JmarlError(f"sandbox memory_mb must be an int >= 64 (the interpreter needs it), "
                         f"got {memory_mb!r}")
    if not (isinstance(max_output_bytes, int) and max_output_bytes >= 0):
        raise JmarlError(f"sandbox max_output_bytes must be an int >= 0, got {max_output_bytes!r}")


def run_python(
    code: str,
    stdin: str = "",
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
) -> SandboxResult:
    """Runs the Python program `code` with `stdin` in the sandbox; never raises on any code.

    Args:
      code: the program's source (any text; a syntax error is status "error").
      stdin: text fed to the program's standard input.
      timeout_s: wall-clock limit; the CPU-time limit is ceil(timeout_s) seconds.
      memory_mb: address-space limit of the program's interpreter.
      max_output_bytes: cap on each of stdout and stderr; a program writing more is killed.
    Returns:
      SandboxResult(status, stdout, stderr, duration_s); see `jmarl.sandbox.result`.
    Raises:
      JmarlError for invalid limits (a caller's mistake, not the program's), and where the
      machine offers only a weak isolation level under the "strict" policy
      (`require_isolation`).
    """
    _check_options(timeout_s, memory_mb, max_output_bytes)
    if not isinstance(code, str) or not isinstance(stdin, str):
        raise JmarlError("run_python takes the program and its stdin as str")
    level = require_isolation()
    start = time.monotonic()
    try:
        return run_at_level(code, stdin, level, timeout_s=timeout_s, memory_mb=memory_mb,
                            max_output_bytes=max_output_bytes)
    except OSError as e:  # the machine could not start a process (no fds, no memory...)
        return SandboxResult("error", "", f"[sandbox] could not run the program: {e}",
                             time.monotonic() - start)


def run_many(
    codes: Sequence[str],
    stdins: Sequence[str] | None = None,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
    max_workers: int | None = None,
) -> list[SandboxResult]:
    """Runs several programs concurrently (at most `max_workers` at once, default: CPU count).

    Returns one SandboxResult per program, in the order of `codes`.
    """
    if stdins is None:
        stdins = [""] * len(codes)
    if len(stdins) != len(codes):
        raise JmarlError(f"run_many got {len(codes)} programs but {len(stdins)} stdins")
    _check_options(timeout_s, memory_mb, max_output_bytes)
    if max_workers is None:
        max_workers = os.cpu_count() or 1
    if not (isinstance(max_workers, int) and max_workers >= 1):
        raise JmarlError(f"run_many max_workers must be an int >= 1, got {max_workers!r}")
    if not codes:
        return []
    require_isolation()  # probe once (and refuse a weak level), before the threads start
    with ThreadPoolExecutor(max_workers=min(max_workers, len(codes))) as pool:
        futures = [
            pool.submit(run_python, code, stdin, timeout_s=timeout_s, memory_mb=memory_mb,
                        max_output_bytes=max_output_bytes)
            for code, stdin in zip(codes, stdins)
        ]
        return [f.result() for f in futures]
