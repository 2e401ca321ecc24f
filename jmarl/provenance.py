"""Provenance of a result file: the code, command, machine and libraries that made it.

Every result JSON the repository keeps (evidence tables, benchmarks, memory plans, base-success
tables, device runs) carries `record(command)` under the key `provenance`:

    {"commit": "4eefe4a", "dirty": false, "diff": null, "command": "python -m benchmarks.run ...",
     "machine": "AMD EPYC 9B14, 2 CPUs", "versions": {"python": "3.11.7", "jax": "0.10.2", ...},
     "date": "2026-11-28 01:02 UTC"}

`dirty` is true when the files that make results (`WATCHED_PATHS`: the package, the configs, the
benchmarks and scripts, the dependency pins; not the result files under `OUTPUT_PATHS`) differ from the commit: tracked changes and new,
untracked files alike. `diff` is then a hash of that difference (tracked diff plus each untracked
file's name and bytes), so two results from one dirty tree can be told to be the same code. A
result whose `dirty` is true cannot be traced to a commit and is to be re-run on a clean one.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

KEY = "provenance"
WATCHED_PATHS: tuple[str, ...] = ("jmarl", "configs", "benchmarks", "scripts", "pyproject.toml")
# what the watched paths hold that is a result, not code: a run writing its own JSON there (or an
# earlier result re-run beside it) leaves the code it ran the same
OUTPUT_PATHS: tuple[str, ...] = ("benchmarks/results",)
FIELDS: tuple[str, ...] = ("commit", "dirty", "diff", "command", "machine", "versions", "date")
LIBRARIES: tuple[str, ...] = ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "transformers", "trl")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _git(root: Path, *args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True).stdout


def code_state(root: str | os.PathLike = REPO_ROOT, paths: Sequence[str] = WATCHED_PATHS,
               outputs: Sequence[str] = OUTPUT_PATHS) -> dict[str, Any]:
    """{"commit": short HEAD, "dirty": bool, "diff": hash of the difference or None} of the checkout
    at `root`, over `paths` less `outputs` (tracked changes and untracked, not ignored files); {}
    outside git."""
    root = Path(root)
    spec = [*paths, *(f":(exclude){p}" for p in outputs)]
    try:
        commit = _git(root, "rev-parse", "--short", "HEAD").decode().strip()
        tracked = _git(root, "diff", "HEAD", "--binary", "--", *spec)
        untracked = [n for n in _git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", *spec)
                     .decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        return {}
    digest = hashlib.sha256(tracked)
    for name in sorted(untracked):
        digest.update(b"\0new file\0" + name.encode() + b"\0")
        try:
            digest.update((root / name).read_bytes())
        except OSError:
            pass
    dirty = bool(tracked) or bool(untracked)
    return {"commit": commit, "dirty": dirty, "diff": digest.hexdigest()[:12] if dirty else None}


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; else the platform's processor string)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The widest vector extension a CPU offers, by its /proc/cpuinfo flag, widest first. XLA:CPU
# generates code for the host's extensions, so runs of the same code and seed on CPUs that differ
# here round differently and drift apart: a CPU model name alone ("AMD EPYC") does not tell them.
_VECTOR_FLAGS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4.2"),
                 ("sve", "SVE"), ("asimd", "NEON"))


def vector_extension(flags: str | None = None) -> str | None:
    """The widest vector extension among the CPU's flags (`flags`: a /proc/cpuinfo flags or
    Features line's words; default this machine's), e.g. "AVX-512"; None when unknown."""
    if flags is None:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.partition(":")[2] for line in f if line.startswith(("flags", "Features"))), "")
        except OSError:
            return None
    have = set(flags.split())
    return next((name for flag, name in _VECTOR_FLAGS if flag in have), None)


def machine() -> str:
    """What measured: the accelerator's name and count when JAX (already imported) runs on one,
    else the CPU model, its widest vector extension and this process's CPU count."""
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            devices = jax.devices()
            if devices and devices[0].platform != "cpu":
                return f"{devices[0].device_kind} x{len(devices)} ({devices[0].platform})"
        except RuntimeError:
            pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 0
    vector = vector_extension()
    return f"{cpu_model()}{f' ({vector})' if vector else ''}, {cpus} CPUs"


def library_versions(libraries: Sequence[str] = LIBRARIES) -> dict[str, str]:
    """Python's version and each installed library's (absent ones left out)."""
    out = {"python": platform.python_version()}
    for name in libraries:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def record(command: str | Sequence[str] | None = None, root: str | os.PathLike = REPO_ROOT) -> dict[str, Any]:
    """The provenance of a result made now by `command` (default: this process's command line)."""
    if command is None:
        command = [Path(sys.executable).name, *sys.argv]
    if not isinstance(command, str):
        command = " ".join(str(c) for c in command)
    code = code_state(root) or {"commit": None, "dirty": None, "diff": None}
    return {**code, "command": command, "machine": machine(), "versions": library_versions(), "date": utc_now()}


def missing(result: Any) -> list[str]:
    """The provenance fields a result dict lacks (all of them when it has no record)."""
    prov = result.get(KEY) if isinstance(result, dict) else None
    if not isinstance(prov, dict):
        return list(FIELDS)
    return [f for f in FIELDS if f not in prov or (f != "diff" and prov[f] in (None, ""))]
