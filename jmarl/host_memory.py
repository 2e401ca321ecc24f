"""Host memory policy on CPU: run programs on the calling thread and keep freed host memory.

XLA's CPU runtime allocates each program's temporary buffer (hundreds of MB to GB for a train
step) with `posix_memalign` when the program runs, and frees it when the program ends. By
default JAX runs CPU programs on a worker thread ("async dispatch"); glibc serves a large request
on a worker thread's own arena with a fresh `mmap` (those arenas are made of heaps of at most
64 MB) and unmaps it on free, so every execution faults in and zeroes every page of its buffer
again (page faults the benchmark below counts).

The policy:
- JAX runs CPU programs inline on the thread that calls them
  (`jax_cpu_enable_async_dispatch=False`; from the main Python thread that is glibc's main
  arena, which can grow to any size);
- glibc serves large blocks from the heap rather than `mmap` (`M_MMAP_MAX=0`) and never trims
  the heap (`M_TRIM_THRESHOLD=-1`),
so the buffer freed by one step is the memory the next step gets: 0 page faults per step after
the first. What it saves on a GRPO iteration is measured by `python -m benchmarks.host_memory`
(alternating processes, the trainer's own `time/*`; the figures: docs/configs.md). Either half alone does not help
(an inline program on the default allocator still `mmap`s, and a worker thread on an arena of
its own `mmap`s whatever `M_MMAP_MAX` says; whether it gets one of its own is up to glibc).
The price: the process keeps its peak host memory, and a Python thread blocks while its CPU
program runs (no overlap of host work with CPU programs).

Who applies it: `import jmarl` changes nothing. The command line (`python -m jmarl.run`) and
the benchmarks' entry points call `apply_on_cpu()` before JAX starts its backends; a program of
your own that drives jmarl on CPU can call it too, first thing. It applies only where JAX will
run on the CPU alone (`cpu_only`, decided without starting JAX's backends: JAX_PLATFORMS /
`jax_platforms` when set, e.g. "cpu"; else no accelerator plugin installed: CUDA, ROCm, TPU or
any other `jax_plugins` plugin). On a GPU or TPU host, or with any platform besides "cpu" named,
the allocator and JAX's dispatch are left alone: there the CPU runs no large programs, and a
process-wide allocator change is not jmarl's to make. A host with an accelerator plugin
installed but no accelerator: set JAX_PLATFORMS=cpu to get the policy.

`JMARL_KEEP_HOST_MEMORY=0` opts out (`apply_on_cpu` then does nothing); a
JAX_CPU_ENABLE_ASYNC_DISPATCH set in the environment is respected. The dispatch half takes
effect only if it is applied before JAX starts its CPU backend (`host_memory_policy()` says
whether it did). Not glibc (macOS, musl): the allocator half does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import sys
import warnings

ENV_VAR = "JMARL_KEEP_HOST_MEMORY"
JAX_DISPATCH_FLAG = "jax_cpu_enable_async_dispatch"
# Python modules of JAX's accelerator plugins (and TPU runtimes) that JAX would load when present.
ACCELERATOR_MODULES = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin",
                       "libtpu", "libtpu_nightly")
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
    default (on), so that a typo never stops the CLI."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    warnings.warn(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not understood; set it to 0 (leave the allocator and "
                  "JAX's CPU dispatch alone) or 1 (the default); keeping the default", RuntimeWarning, stacklevel=2)
    return True


def _jax_backends_started() -> bool | None:
    """Whether JAX has created its backends (after which the dispatch flag no longer applies);
    None where this JAX cannot say (the query is private to JAX, hence guarded)."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return None
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else None


def run_cpu_programs_inline() -> bool:
    """Sets JAX to run CPU programs on the calling thread, unless the environment already says
    (JAX_CPU_ENABLE_ASYNC_DISPATCH) or this JAX has no such flag; returns whether CPU programs run
    inline from now on."""
    import jax

    if JAX_DISPATCH_FLAG not in jax.config.values:
        return False
    if JAX_DISPATCH_FLAG.upper() not in os.environ and _jax_backends_started() is False:
        jax.config.update(JAX_DISPATCH_FLAG, False)
    return not jax.config.values[JAX_DISPATCH_FLAG]


def keep_freed_host_memory() -> bool:
    """Applies the policy (module docstring) unconditionally, whatever the platform; returns
    whether both halves are in effect: large blocks come from a never-trimmed heap (False where
    the C library is not glibc) and CPU programs run inline. Idempotent. Entry points call
    `apply_on_cpu` instead."""
    if not _STATE["allocator"]:
        libc = _glibc()
        _STATE["allocator"] = libc is not None and all(
            libc.mallopt(param, value) == 1 for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))
    if not _STATE["inline"]:
        _STATE["inline"] = run_cpu_programs_inline()
    return _STATE["allocator"] and _STATE["inline"]


def host_memory_policy() -> str:
    """'kept' when both halves are in effect, 'heap only' when only the allocator half is (JAX's
    CPU backend started before the policy was applied, or async dispatch was asked for), else
    'default': not applied (`import jmarl` alone, JMARL_KEEP_HOST_MEMORY=0, an accelerator
    host) or not glibc. For benchmark records."""
    if _STATE["allocator"] and _STATE["inline"]:
        return "kept"
    return "heap only" if _STATE["allocator"] else "default"


def platforms_setting() -> str:
    """The platforms JAX is told to use, lower case ('' when none): `jax.config.jax_platforms`
    (which JAX reads from JAX_PLATFORMS when it is imported), else JAX_PLATFORMS. Reading it
    does not start JAX's backends."""
    import jax

    value = None
    try:
        value = jax.config.values.get("jax_platforms")
    except AttributeError:  # a JAX whose config has no `values`
        value = getattr(jax.config, "jax_platforms", None)
    if value is None:
        value = os.environ.get("JAX_PLATFORMS", "")
    return str(value).strip().lower()


def names_cpu_only(platforms: str) -> bool:
    """Whether a JAX_PLATFORMS-style list ("cpu", "cuda,cpu", ...) names the CPU and nothing else."""
    names = [name.strip() for name in platforms.lower().split(",") if name.strip()]
    return bool(names) and all(name == "cpu" for name in names)


def accelerator_plugins() -> list[str]:
    """The accelerator plugins JAX would load in this environment, found without importing
    them: ACCELERATOR_MODULES that are installed, modules of the `jax_plugins` namespace package
    and entry points of the `jax_plugins` group (JAX's two ways of discovering a plugin)."""
    found = [name for name in ACCELERATOR_MODULES if _find_spec(name) is not None]
    namespace = _find_spec("jax_plugins")
    if namespace is not None:
        import pkgutil

        locations = list(namespace.submodule_search_locations or [])
        found += [f"jax_plugins.{module.name}" for module in pkgutil.iter_modules(locations)]
    try:
        found += [entry.value for entry in importlib.metadata.entry_points(group="jax_plugins")]
    except Exception:  # noqa: BLE001 - unreadable package metadata must not stop a run
        found.append("<unreadable jax_plugins entry points>")  # may hide a plugin: not CPU-only
    return sorted(set(found))


def _find_spec(name: str) -> object | None:
    """importlib's spec of top-level module `name` (not imported), None when not installed."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def cpu_only() -> bool:
    """Whether JAX will run on the CPU alone, decided without starting its backends: once they
    have started, whether the default backend is the CPU; else `platforms_setting()` when set
    (only "cpu" named); else whether no `accelerator_plugins()` is installed."""
    if _jax_backends_started():
        import jax

        return jax.default_backend() == "cpu"
    platforms = platforms_setting()
    if platforms:
        return names_cpu_only(platforms)
    return not accelerator_plugins()


def apply_on_cpu() -> str:
    """The entry points' switch: applies the policy (`keep_freed_host_memory`) when
    JMARL_KEEP_HOST_MEMORY does not opt out and JAX will run on the CPU alone (`cpu_only`);
    otherwise changes nothing. Call it before JAX starts its backends (before any JAX
    computation). Returns `host_memory_policy()`."""
    if requested() and cpu_only():
        keep_freed_host_memory()
    return host_memory_policy()
