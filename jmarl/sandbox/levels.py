"""The isolation levels, and detecting the strongest one this machine gives (probed once).

`isolation_level()` says which level this machine achieves (docs/sandbox.md has the
table):

  "namespaces" (running as root): a launcher puts the program in fresh mount, PID, network,
      IPC and UTS namespaces, and the program drops root for a fresh unprivileged uid/gid (one
      per run, so runs cannot signal each other and share no process count).
  "userns" (not root, unprivileged user namespaces allowed): the same namespaces inside a new
      user namespace that maps the caller's uid/gid to themselves (built without privileges,
      the way bubblewrap does); the program runs as the caller's uid with no capabilities.
      (Root forced to this level maps root and a fresh uid/gid into the user namespace; the
      program runs as the fresh uid.)
  At both levels the program sees a private root filesystem: an empty tmpfs holding only the
      interpreter's install tree and the system's library and command directories (/usr/lib,
      /usr/lib64, /usr/bin and their /lib, /lib64, /bin links, /etc/ld.so.cache), bound
      read-only, nosuid and nodev; a minimal /dev (null, zero, full, random, urandom and the
      fd/stdin/stdout/stderr links); a new /proc showing only the run's processes; and its
      working directory /tmp, a fresh size-limited tmpfs, the only writable place. The
      launcher pivot_roots into it and detaches the old root: no home directory, no host /tmp,
      nothing else of the host exists.
      The network namespace holds only a downed loopback: no address (not even 127.0.0.1) is
      reachable. The capability bounding set is emptied and no_new_privs set before the exec.
  "landlock" (no user namespaces, Landlock available: Linux >= 5.13): the program's process
      tree is confined by a Landlock domain: it may read and execute only in the interpreter's
      install tree and the system's library and command directories, read and write only in
      its working directory (a private directory on the host) and /dev/null; nothing else
      (no home, no /tmp, no /proc, no /etc). With Landlock ABI >= 4 no TCP connect/bind, with
      ABI >= 6 no abstract unix sockets and no signals out of the domain. No PID or network
      namespace: the audit hook also refuses sockets, process creation, signals and ctypes as
      at "rlimits", and a process-count limit applies.
  "rlimits" (no namespaces): resource limits and the audit hook only (and, as root, the uid
      drop when the interpreter is reachable by other users). The kernel does not keep the
      program off the user's files, so this level is refused unless the policy allows it
      (`policy.require_isolation`: `sandbox.isolation: allow_weak` in the config, or
      JMARL_SANDBOX_ISOLATION=allow_weak). WEAK_LEVELS lists it.
"""

from __future__ import annotations

import os
import threading

from jmarl.sandbox.spawn import run_at_level

ISOLATION_LEVELS = ("namespaces", "userns", "landlock", "rlimits")
# The levels that cannot keep the program off the user's files.
WEAK_LEVELS = ("rlimits",)
# One line per level: what it gives (logged when the first program runs, and in the refusal).
DESCRIPTIONS = {
    "namespaces": "private read-only root filesystem, no network, own PID namespace, fresh uid",
    "userns": "user namespace: private read-only root filesystem, no network, own PID "
              "namespace",
    "landlock": "Landlock: no file outside the working directory, the interpreter and the "
                "system libraries; no TCP",
    "rlimits": "resource limits and an audit hook only: the program is NOT kept off this "
               "user's files by the kernel",
}

_LEVEL_LOCK = threading.Lock()
_LEVEL: str | None = None  # the probed level; None until `isolation_level` first runs


def probe(level: str) -> bool:
    """Whether a trivial program runs correctly at `level` on this machine (and, at "namespaces"
    and "userns", sees the private root filesystem: no /etc/passwd; at "landlock" the launcher
    fails unless the Landlock domain is in force)."""
    try:
        result = run_at_level("import os\nprint(6 * 7, os.path.exists('/etc/passwd'))", "",
                              level, timeout_s=10.0, memory_mb=512, max_output_bytes=1024)
    except OSError:
        return False
    if result.status != "ok":
        return False
    answer, _, host_visible = result.stdout.strip().partition(" ")
    return answer == "42" and (level in ("landlock", "rlimits") or host_visible == "False")


def isolation_level() -> str:
    """The strongest isolation level that works here (probed once): one of ISOLATION_LEVELS.

    "namespaces" needs root (or CAP_SYS_ADMIN); "userns" needs unprivileged user namespaces;
    "landlock" needs Landlock (Linux >= 5.13); "rlimits" always works, but the kernel does not
    keep the program off the user's files there: see `jmarl.sandbox.policy.require_isolation`.
    """
    global _LEVEL
    with _LEVEL_LOCK:
        if _LEVEL is None:
            candidates = ("namespaces", "userns", "landlock") if os.geteuid() == 0 else (
                "userns", "landlock")
            _LEVEL = next((lv for lv in candidates if probe(lv)), "rlimits")
        return _LEVEL


def probed_level() -> str | None:
    """The level `isolation_level` found, or None before it has run (never probes)."""
    return _LEVEL
