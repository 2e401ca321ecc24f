"""Running a test's worker script in several localhost processes (jax.distributed tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script: str, args: Sequence[Sequence[str]], *, timeout: float, xla_flags: str | None = None) -> None:
    """Runs `python -c script *args[i]` for each i at once (CPU JAX, the repo importable), waits
    for all, kills any left on failure, and asserts each exited 0 (showing its output if not)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    procs = [subprocess.Popen([sys.executable, "-c", script, *map(str, a)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for a in args]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"worker {i} failed:\n{log[-3000:]}"


def one_device_xla_flags() -> str:
    """This process's XLA_FLAGS without the simulated device count: for a child run on one CPU
    device that keeps tests/conftest.py's compile-time flags (a tiny run's time is mostly compiling)."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f)
