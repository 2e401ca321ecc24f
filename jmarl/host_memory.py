"""Host memory policy on CPU: run programs on the calling thread and keep freed host memory.

XLA's CPU runtime allocates each program's temporary buffer (hundreds of MB to GB for a train
step) with `posix_memalign` when the program runs, and frees it when the program ends. By
default JAX runs CPU programs on a worker thread ("async dispatch"); glibc serves a large request
on a worker thread's own arena with a fresh `mmap` (those arenas are made of heaps of at most
64 MB) and unmaps it on free, so every execution faults in and zeroes every page of its buffer
again: on the 2-core CPU of BENCHMARKS.md a cpu-small GRPO iteration took ~158k page faults per
step for it (`python -m benchmarks.host_memory`).

The policy, applied when `jmarl` is imported:
- JAX runs CPU programs inline on the thread that calls them
  (`jax_cpu_enable_async_dispatch=False`; from the main Python thread that is glibc's main
  arena, which can grow to any size);
- glibc serves large blocks from the heap rather than `mmap` (`M_MMAP_MAX=0`) and never trims
  the heap (`M_TRIM_THRESHOLD=-1`),
so the buffer freed by one step is the memory the next step gets: 0 page faults per step after
the first. Measured on that CPU (`python -m benchmarks.host_memory`: alternating processes, the
trainer's own `time/*`): a GRPO iteration 1.27 -> 1.11 s at cpu-small (update 0.85 -> 0.71 s,
generation 0.41 -> 0.40 s) and 7.82 -> 7.04 s at cpu-medium. Either half alone does not help
(an inline program on the default allocator still `mmap`s, and a worker thread on an arena of
its own `mmap`s whatever `M_MMAP_MAX` says; whether it gets one of its own is up to glibc).
The price: the process keeps its peak host memory, and a Python thread blocks while its CPU
program runs (no overlap of host work with CPU programs; accelerator dispatch is unaffected).

`JMARL_KEEP_HOST_MEMORY=0` before `import jmarl` leaves both alone; a JAX_CPU_ENABLE_ASYNC_DISPATCH
set in the environment is respected. The dispatch half takes effect only if jmarl is imported
before JAX starts its CPU backend (`host_memory_policy()` says whether it did). Not glibc
(macOS, musl): the allocator half does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings

ENV_VAR = "JMARL_KEEP_HOST_MEMORY"
JAX_DISPATCH_FLAG = "jax_cpu_enable_async_dispatch"
# glibc <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

_STATE = {"allocator": False, "inline": False}


def _glibc() -> ctypes.CDLL | None:
    """The process's glibc, or None on another C library / platform."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    return libc


def requested() -> bool:
    """Whether JMARL_KEEP_HOST_MEMORY asks for the policy: unset, empty or 1/true/yes/on do;
    0/false/no/off do not; anything else warns (naming the variable and the fix) and keeps the
    default (on), so that a typo never stops `import jmarl` or the CLI."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    warnings.warn(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not understood; set it to 0 (leave the allocator and "
                  "JAX's CPU dispatch alone) or 1 (the default); keeping the default", RuntimeWarning, stacklevel=2)
    return True


def _jax_backend_started() -> bool:
    """Whether JAX has created its backends (after which the dispatch flag no longer applies)."""
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else True


def run_cpu_programs_inline() -> bool:
    """Sets JAX to run CPU programs on the calling thread, unless the environment already says
    (JAX_CPU_ENABLE_ASYNC_DISPATCH) or this JAX has no such flag; returns whether CPU programs run
    inline from now on."""
    import jax

    if JAX_DISPATCH_FLAG not in jax.config.values:
        return False
    if JAX_DISPATCH_FLAG.upper() not in os.environ and not _jax_backend_started():
        jax.config.update(JAX_DISPATCH_FLAG, False)
    return not jax.config.values[JAX_DISPATCH_FLAG]


def keep_freed_host_memory() -> bool:
    """Applies the policy (module docstring); returns whether both halves are in effect: large
    blocks come from a never-trimmed heap (False where the C library is not glibc) and CPU
    programs run inline. Idempotent."""
    if not _STATE["allocator"]:
        libc = _glibc()
        _STATE["allocator"] = libc is not None and all(
            libc.mallopt(param, value) == 1 for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))
    if not _STATE["inline"]:
        _STATE["inline"] = run_cpu_programs_inline()
    return _STATE["allocator"] and _STATE["inline"]


def host_memory_policy() -> str:
    """'kept' when both halves are in effect, 'heap only' when only the allocator half is (JAX's
    CPU backend started before jmarl was imported, or async dispatch was asked for), else
    'default' (for benchmark records)."""
    if _STATE["allocator"] and _STATE["inline"]:
        return "kept"
    return "heap only" if _STATE["allocator"] else "default"
