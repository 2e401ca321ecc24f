"""Host memory policy (opt-in): keep freed host memory in the process instead of handing it back.

XLA's CPU runtime allocates each program's temporary buffer (hundreds of MB to GB for a train
step) with `posix_memalign` on one of its worker threads and frees it when the program ends.
glibc serves such a request with a fresh `mmap` (always, on a worker thread's own arena) and
unmaps it on free, so every execution faults in and zeroes every page again: on the 2-core CPU
of BENCHMARKS.md a cpu-small GRPO iteration takes ~160k page faults and 0.3 s of kernel time
per step for it. With one arena, no mmap for large requests and no trimming, the buffer freed by
one step is the memory the next step gets (0 page faults per step after the first).

The price: all threads then share one arena, and the decode loop's many small allocations
contend for it. Measured at cpu-small on that CPU (interleaved processes): the GRPO update
0.84 -> 0.74 s, generation 0.40 -> 0.45 s, the whole iteration ~5% faster. Because it changes
the allocator of the whole process and slows generation-only work, it is off by default;
`JMARL_KEEP_HOST_MEMORY=1` in the environment before `import jmarl` turns it on
(import applies it, before JAX starts its CPU thread pool in the usual order of things: a
thread's arena is chosen at its first allocation). It also keeps the process at its peak host
memory. Not glibc (macOS, musl): nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings

ENV_VAR = "JMARL_KEEP_HOST_MEMORY"
# glibc <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_STATE = {"applied": False}


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
    """Whether JMARL_KEEP_HOST_MEMORY asks for the policy: 1/true/yes/on; unset, empty or
    0/false/no/off do not; anything else warns (naming the variable and the fix) and does not,
    so that a typo never stops `import jmarl` or the CLI."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    warnings.warn(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not understood; set it to 1 (keep freed host memory) "
                  "or 0; leaving the allocator as it is", RuntimeWarning, stacklevel=2)
    return False


def keep_freed_host_memory() -> bool:
    """Applies the policy (one malloc arena, no mmap for large blocks, no trimming); returns
    whether it is in effect (False where the C library is not glibc). Idempotent."""
    if _STATE["applied"]:
        return True
    libc = _glibc()
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1
             for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))
    _STATE["applied"] = ok
    return ok


def host_memory_policy() -> str:
    """'kept' when `keep_freed_host_memory` is in effect, else 'default' (for benchmark records)."""
    return "kept" if _STATE["applied"] else "default"
