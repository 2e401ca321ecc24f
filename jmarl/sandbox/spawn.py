"""One sandboxed run, from the parent's side: job directory, launcher, output, cleanup.

`run_at_level` writes the program to a private job directory, starts the launcher
(`launcher.py`, shipped as `python -I -S -B -c` source with the run's config as JSON; it passes
`audit_hook.py`'s source on to the program's interpreter), feeds stdin, reads stdout and stderr
incrementally up to the cap, and on exit, timeout or flood kills and reaps every remaining process
of the run and removes the job directory. It checks no policy: `runner.run_python` does.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from jmarl.sandbox import audit_hook, launcher
from jmarl.sandbox.filesystem import python_prefix, reachable_by_others, root_layout
from jmarl.sandbox.result import SandboxResult, classify

# Range of the per-run unprivileged uids/gids used at the "namespaces" level (no passwd entry
# needed; far above normal system and user ids and below the overflow id 2**32 - 2).
_UID_BASE = 3_000_000_000
_UID_SPAN = 1 << 24
_WORKDIR_TMPFS_MB = 64
_MAX_FILE_MB = 16
_MAX_OPEN_FILES = 64
_MAX_PROCESSES = 32
_KILL_GRACE_S = 2.0

# The two programs that run inside the sandbox, each shipped whole as `python -c` source.
_LAUNCHER_SRC = Path(launcher.__file__).read_text(encoding="utf-8")
_AUDIT_HOOK_SRC = Path(audit_hook.__file__).read_text(encoding="utf-8")


def run_at_level(
    code: str,
    stdin: str,
    level: str,
    *,
    timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
    hook_level: str | None = None,
) -> SandboxResult:
    """Runs `code` with `stdin` at isolation `level` (see `jmarl.sandbox`); no policy check.

    `hook_level` (tests only): run the audit hook as at that level instead, e.g. "userns" at
    "landlock" to show what the kernel alone contains when the hook is bypassed.
    """
    start = time.monotonic()
    exe, prefix = python_prefix()
    jobdir = tempfile.mkdtemp(prefix="jmarl-sandbox-")  # mode 0700: private to this process
    work = os.path.join(jobdir, "work")
    stage = os.path.join(jobdir, "stage")
    os.mkdir(work, 0o700)
    os.mkdir(stage, 0o700)
    program = os.path.join(jobdir, "program.py")
    with open(program, "wb") as f:
        f.write(code.encode("utf-8", errors="surrogatepass"))
    uid = gid = _UID_BASE + secrets.randbelow(_UID_SPAN)
    root = os.geteuid() == 0
    if level == "userns" and not root:
        uid, gid = os.geteuid(), os.getegid()  # mapped to themselves in the user namespace
    drop_uid = root and (level in ("namespaces", "userns") or (
        level in ("landlock", "rlimits") and reachable_by_others(exe)))
    if drop_uid and level in ("landlock", "rlimits"):
        os.chown(work, uid, gid)
        os.chmod(jobdir, 0o711)  # the program must reach its working directory by path
    binds, links = root_layout(exe, prefix)
    # The new root is built on a tmpfs mounted (in the run's own mount namespace) over /tmp,
    # or over the job's directory when something that must be bound lives under /tmp.
    under_tmp = any(b == "/tmp" or b.startswith("/tmp/") for b in binds)
    tmp_ok = os.path.isdir("/tmp") and not os.path.islink("/tmp") and not under_tmp
    root_mount = "/tmp" if tmp_ok else stage
    if level in ("landlock", "rlimits"):
        sandbox_root = work
    else:
        sandbox_root = "/tmp" if not under_tmp else "/sandbox"
    config = {
        "level": level,
        "hook": hook_level or level,
        "uid": uid,
        "gid": gid,
        "drop_uid": drop_uid,
        "work": work,
        "sandbox_root": sandbox_root,
        "root_mount": root_mount,
        "binds": binds,
        "links": links,
        "program": program,
        "exe": exe,
        "tmpfs_mb": _WORKDIR_TMPFS_MB,
        "parent_pid": os.getpid(),
        "runner": _AUDIT_HOOK_SRC,
        "env": _minimal_env(sandbox_root),
        "limits": {
            "cpu_s": max(1, math.ceil(timeout_s)),
            "as_bytes": int(memory_mb) << 20,
            "fsize_bytes": _MAX_FILE_MB << 20,
            "nofile": _MAX_OPEN_FILES,
            "nproc": _MAX_PROCESSES,
        },
    }
    status_r, status_w = os.pipe()
    config["status_fd"] = status_w
    stdout = bytearray()
    stderr = bytearray()
    timed_out = flooded = False
    try:
        proc = subprocess.Popen(
            [exe, "-I", "-S", "-B", "-c", _LAUNCHER_SRC, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_minimal_env(work),
            cwd=work,
            start_new_session=True,
            pass_fds=(status_w,),
        )
        os.close(status_w)
        status_w = -1
        try:
            timed_out, flooded = _pump(proc, stdin.encode("utf-8", errors="replace"), stdout,
                                       stderr, start + timeout_s, max_output_bytes)
        finally:
            _kill_descendants(proc.pid)
            try:
                proc.wait(timeout=_KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
        os.set_blocking(status_r, False)
        try:
            wait_status = os.read(status_r, 256).decode()
        except BlockingIOError:
            wait_status = ""
    finally:
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)
        _remove_tree(jobdir)
    status = classify(wait_status, proc.returncode, timed_out, flooded)
    if flooded:
        stderr += f"\n[sandbox] output exceeded {max_output_bytes} bytes; killed".encode()
    elif status == "timeout":
        stderr += f"\n[sandbox] timed out after {timeout_s:g} s".encode()
    elif status == "killed" and wait_status.startswith("signal "):
        number = int(wait_status.split()[1])
        name = signal.Signals(number).name if number in signal.valid_signals() else str(number)
        stderr += f"\n[sandbox] killed by signal {name}".encode()
    return SandboxResult(
        status=status,
        stdout=bytes(stdout[:max_output_bytes]).decode("utf-8", errors="replace"),
        stderr=bytes(stderr).decode("utf-8", errors="replace"),
        duration_s=time.monotonic() - start,
    )


def _pump(
    proc: subprocess.Popen,
    data: bytes,
    stdout: bytearray,
    stderr: bytearray,
    deadline: float,
    cap: int,
) -> tuple[bool, bool]:
    """Feeds stdin and collects stdout/stderr until EOF or the deadline; returns (timed_out,
    flooded). Each stream keeps at most `cap` + 1 bytes; the rest is never read."""
    sel = selectors.DefaultSelector()
    buffers = {proc.stdout.fileno(): stdout, proc.stderr.fileno(): stderr}
    for fd in buffers:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    stdin_fd = proc.stdin.fileno()
    offset = 0
    if data:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    try:
        while any(fd in sel.get_map() for fd in buffers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True, False
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        offset += os.write(fd, data[offset : offset + 65536])
                    except (BrokenPipeError, OSError):
                        offset = len(data)
                    if offset >= len(data):
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = buffers[fd]
                buf += chunk[: cap + 1 - len(buf)]
                if len(buf) > cap:
                    return False, True
        # Both outputs closed; the program may still be running (e.g. it closed stdout).
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return True, False
        return False, False
    finally:
        sel.close()


def _remove_tree(path: str) -> None:
    """Removes `path` even where the program left unreadable or unwritable entries."""

    def make_writable_and_retry(func, target, _exc):
        try:
            os.chmod(os.path.dirname(target), 0o700)
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


def _descendants(pid: int) -> list[int]:
    """Host pids of every live descendant of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_descendants(pid: int) -> None:
    """SIGKILLs every descendant of the launcher `pid` (the launcher itself reaps them)."""
    for _ in range(20):
        rest = _descendants(pid)
        if not rest:
            return
        for child in rest:
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)


def _minimal_env(work: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8"}
