"""A sandbox for model-written Python: hostile code ends in a defined result, never harm.

`run_python(code, stdin)` runs one program in a separate process tree and returns a
`SandboxResult(status, stdout, stderr, duration_s)` with status one of:

  "ok"       the program exited with code 0;
  "error"    it exited with a non-zero code (an uncaught exception: traceback in stderr);
  "timeout"  it ran past the wall-clock timeout or its CPU-time limit;
  "memory"   it raised MemoryError (it hit the address-space limit);
  "killed"   it died from a signal (segfault, abort...) or flooded its output past the cap.

How a run is contained (`isolation_level()` says which level this machine achieves):

  "namespaces" (running as root): a launcher process puts the program in fresh network, PID,
      mount, IPC and UTS namespaces. The network namespace holds only a downed loopback, so
      no address (not even 127.0.0.1) is reachable. In the mount namespace every mount is
      remounted read-only and nosuid; the working directory is a fresh size-limited tmpfs
      mounted over /tmp (the only writable place; the host's /tmp is hidden), /proc is a new
      procfs that shows only the sandbox's own processes, and a directory that hides the
      interpreter from other users (e.g. /root) is covered by an empty tmpfs into which only
      the interpreter's install tree is bound. The program then drops root for a fresh
      unprivileged uid/gid (one per run, so runs cannot signal each other and share no
      process count) with no supplementary groups and no_new_privs.
  "userns" (not root, unprivileged user namespaces allowed): a user namespace carrying the
      same network, PID, IPC and UTS namespaces; no uid change and no read-only filesystem.
  "rlimits" (no namespaces): resource limits only (and, as root, the uid drop when the
      interpreter is reachable by other users).

At every level: a minimal environment (nothing inherited from the parent), `python -I -S -B`
reading the source from an inherited file descriptor (no path to the private job directory),
resource limits (CPU time, address space, file size, open files, processes, no core dumps),
the launcher as child subreaper with parent-death signals, and an audit hook in the program's
interpreter that refuses network calls, writes outside the working directory and reading other
processes' /proc entries (and, at the "rlimits" level, process creation, signals and ctypes).
The audit hook is defense in depth only: ctypes can bypass it, the kernel mechanisms cannot be.
The parent reads output incrementally and stops at `max_output_bytes`; on timeout, on output
flood, or when the program ends, every remaining process of the run is killed (the PID
namespace's init dying kills the rest) and reaped, and the temporary directory is removed.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from jmarl.errors import JmarlError

STATUSES = ("ok", "error", "timeout", "memory", "killed")
ISOLATION_LEVELS = ("namespaces", "userns", "rlimits")

# Exit code the in-sandbox runner uses for an uncaught MemoryError.
_MEMORY_EXIT = 97
# Exit code the launcher uses when it could not set up the requested isolation.
_SETUP_EXIT = 125
# Range of the per-run unprivileged uids/gids used at the "namespaces" level (no passwd entry
# needed; far above normal system and user ids and below the overflow id 2**32 - 2).
_UID_BASE = 3_000_000_000
_UID_SPAN = 1 << 24
_WORKDIR_TMPFS_MB = 64
_MAX_FILE_MB = 16
_MAX_OPEN_FILES = 64
_MAX_PROCESSES = 32
_KILL_GRACE_S = 2.0


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


# --------------------------------------------------------------------------------------------
# Code that runs inside the sandbox's processes. Each function is self-contained (its imports
# are inside it) because its source is shipped with `python -I -S -c`, without jmarl on the path.
# --------------------------------------------------------------------------------------------


def _launcher_main(config: dict) -> None:
    """The launcher (process L, runs as the parent's user): isolates, forks init, relays status.

    L makes itself a child subreaper, enters new namespaces (per `config["level"]`), then forks
    I, which becomes PID 1 of the new PID namespace, sets up the mount namespace, and forks the
    program P. P applies rlimits, drops privileges and execs the interpreter running the
    program. I writes P's wait status ("exit N" / "signal N") to the status pipe.
    """
    import ctypes
    import os
    import resource
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, clone_newuts, clone_newipc = 0x00020000, 0x04000000, 0x08000000
    clone_newuser, clone_newpid, clone_newnet = 0x10000000, 0x20000000, 0x40000000
    ms_rdonly, ms_nosuid, ms_nodev, ms_noexec = 1, 2, 4, 8
    ms_remount, ms_bind, ms_rec, ms_private = 32, 4096, 16384, 1 << 18
    ms_noatime, ms_nodiratime, ms_relatime = 1024, 2048, 1 << 21
    mnt_detach = 2
    pr_set_pdeathsig, pr_set_child_subreaper, pr_set_no_new_privs = 1, 36, 38

    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(source, target, fstype, flags, data=None) -> None:
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        ret = libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
        check(ret, f"mount {target}")

    status_fd = config["status_fd"]
    level = config["level"]
    limits = config["limits"]

    def setup_mounts() -> None:
        """In I, inside a fresh mount namespace: read-only world, tmpfs workdir, own /proc."""
        check(libc.unshare(clone_newns), "unshare(CLONE_NEWNS)")
        mount(None, "/", None, ms_rec | ms_private)
        # Expose the interpreter's install tree if an ancestor hides it from other users.
        prefix = config["python_prefix"]
        hidden = None
        parts = prefix.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            path = "/" + "/".join(parts[:i])
            if not os.stat(path).st_mode & 0o001:
                hidden = path
                break
        if hidden is not None:
            stage = config["stage"]
            mount(prefix, stage, None, ms_bind | ms_rec)
            mount("tmpfs", hidden, "tmpfs", ms_nosuid | ms_nodev, "mode=0755,size=1m")
            os.makedirs(prefix, mode=0o755, exist_ok=True)
            mount(stage, prefix, None, ms_bind | ms_rec)
            check(libc.umount2(stage.encode(), mnt_detach), f"umount {stage}")
        # The program's private, size-limited working directory (normally over /tmp).
        work = config["sandbox_root"]
        mount(
            "tmpfs",
            work,
            "tmpfs",
            ms_nosuid | ms_nodev,
            f"size={config['tmpfs_mb']}m,nr_inodes=4096,mode=0700,"
            f"uid={config['uid']},gid={config['gid']}",
        )
        # Every other mount becomes read-only (keeping its nodev/noexec/atime flags).
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
        keep = {"nodev": ms_nodev, "noexec": ms_noexec, "noatime": ms_noatime,
                "nodiratime": ms_nodiratime, "relatime": ms_relatime}
        for line in lines:
            fields = line.split()
            target = fields[4].encode().decode("unicode_escape")
            if target == work:
                continue
            flags = ms_bind | ms_remount | ms_rdonly | ms_nosuid
            for opt in fields[5].split(","):
                flags |= keep.get(opt, 0)
            try:
                mount(None, target, None, flags)
            except OSError as e:
                # A mount hidden under another one cannot be reached; everything else must go.
                if e.errno not in (2, 13, 22) or target == "/":
                    raise
        mount("proc", "/proc", "proc", ms_nosuid | ms_nodev | ms_noexec)
        os.chdir(work)

    def become_program(program_fd: int) -> None:
        """In P: limits, identity, then exec the interpreter (never returns)."""
        os.close(status_fd)
        os.set_inheritable(program_fd, True)
        cpu = limits["cpu_s"]
        rl = [
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_AS, (limits["as_bytes"],) * 2),
            (resource.RLIMIT_FSIZE, (limits["fsize_bytes"],) * 2),
            (resource.RLIMIT_NOFILE, (limits["nofile"],) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if level != "rlimits":
            rl.append((resource.RLIMIT_NPROC, (limits["nproc"],) * 2))
        for what, value in rl:
            resource.setrlimit(what, value)
        check(libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        if config["drop_uid"]:
            os.setgroups([])
            os.setgid(config["gid"])
            os.setuid(config["uid"])
            if os.getuid() == 0 or os.geteuid() == 0:
                raise OSError("could not drop root")
        check(libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        exe = config["exe"]
        argv = [exe, "-I", "-S", "-B", "-c", config["runner"], str(program_fd), level]
        os.execve(exe, argv, config["env"])

    def init_main() -> None:
        """In I (PID 1 of the new PID namespace, if any): fork P, reap everything, report."""
        check(libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        # The source reaches the interpreter as an open file descriptor: the program needs no
        # path to the (private, possibly hidden) job directory.
        program_fd = os.open(config["program"], os.O_RDONLY)
        if level == "namespaces":
            setup_mounts()
        program = os.fork()
        if program == 0:
            try:
                become_program(program_fd)
            except BaseException as e:  # noqa: BLE001 - report any setup failure, then die
                os.write(2, f"[sandbox] program setup failed: {e!r}\n".encode())
            os._exit(_SETUP_EXIT)
        # As PID 1, reap every process of the namespace until the program itself ends.
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == program:
                break
        if os.WIFSIGNALED(status):
            msg = f"signal {os.WTERMSIG(status)}"
        else:
            msg = f"exit {os.WEXITSTATUS(status)}"
        os.write(status_fd, msg.encode())
        os._exit(0)

    check(libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
    check(libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if os.getppid() != config["parent_pid"]:
        os._exit(_SETUP_EXIT)
    flags = clone_newnet | clone_newpid | clone_newipc | clone_newuts
    if level == "userns":
        flags |= clone_newuser
    if level != "rlimits":
        check(libc.unshare(flags), "unshare")
    init = os.fork()
    if init == 0:
        try:
            init_main()
        except BaseException as e:  # noqa: BLE001 - report any setup failure, then die
            os.write(2, f"[sandbox] setup failed: {e!r}\n".encode())
        os._exit(_SETUP_EXIT)

    def descendants() -> list:
        children = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        stat = f.read()
                except OSError:
                    continue
                ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
                children.setdefault(ppid, []).append(int(entry))
        found, todo = [], [os.getpid()]
        while todo:
            for child in children.get(todo.pop(), []):
                found.append(child)
                todo.append(child)
        return found

    # Reap I; then kill and reap whatever is left below us (orphans come to us as subreaper;
    # with a PID namespace nothing is left once I, its init, is gone).
    os.waitpid(init, 0)
    for _ in range(100):
        rest = descendants()
        if not rest:
            break
        for pid in rest:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    os._exit(0)


def _runner_main() -> None:
    """The program's interpreter (process P): install the audit hook, run the program.

    argv: [program_fd, level]. An uncaught MemoryError exits with code 97 after its traceback.
    """
    import os
    import sys
    import traceback

    program_fd, level = int(sys.argv[1]), sys.argv[2]
    with os.fdopen(program_fd, "rb") as f:
        source = f.read()
    root = os.path.realpath(os.getcwd())
    strict = level == "rlimits"
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_events = {
        "os.remove": 1, "os.rmdir": 1, "os.rename": 2, "os.mkdir": 1, "os.chmod": 1,
        "os.chown": 1, "os.truncate": 1, "os.link": 2, "os.symlink": 2, "os.utime": 1,
        "os.chflags": 1, "os.lchflags": 1, "os.setxattr": 1, "os.removexattr": 1,
        "shutil.rmtree": 1, "shutil.move": 2, "shutil.copyfile": 2,
    }
    banned = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
              "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"}
    if strict:
        banned |= {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec",
                   "os.system", "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill",
                   "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof",
                   "os.startfile", "pty.spawn", "sys.addaudithook", "os.chdir", "os.fchdir"}

    def inside(path) -> bool:
        if isinstance(path, int):
            return True
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        real = os.path.realpath(os.path.join(root, os.fspath(path)))
        return real == root or real.startswith(root + os.sep) or real == "/dev/null"

    def hook(event: str, args: tuple) -> None:
        if event in banned:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, (str, bytes)):
                text = os.fsdecode(path)
                if text.startswith("/proc/") and not text.startswith(("/proc/self/",
                                                                      "/proc/thread-self/")):
                    raise PermissionError(f"sandbox: reading {text} is not allowed")
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
                mode is None and flags is not None and flags & write_flags)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in path_events:
            for path in args[: path_events[event]]:
                if path is not None and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the working "
                                          "directory")

    sys.addaudithook(hook)
    del sys.argv[1:]
    sys.argv[0] = "program.py"
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "program.py"}
    try:
        code = compile(source, "program.py", "exec")
        exec(code, namespace)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the program's own error, reported as-is
        is_memory = isinstance(e, MemoryError)
        if is_memory:
            namespace.clear()
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        traceback.print_exception(type(e), e, tb)
        sys.exit(_MEMORY_EXIT if is_memory else 1)


def _shipped_source(fn, call: str) -> str:
    """The source of `fn` (with the module constants it reads) plus a call, for `python -c`."""
    consts = f"_MEMORY_EXIT = {_MEMORY_EXIT}\n_SETUP_EXIT = {_SETUP_EXIT}\n"
    return consts + textwrap.dedent(inspect.getsource(fn)) + "\n" + call + "\n"


_LAUNCHER_SRC = _shipped_source(
    _launcher_main, "import json, sys\n_launcher_main(json.loads(sys.argv[1]))"
)
_RUNNER_SRC = _shipped_source(_runner_main, "_runner_main()")


# --------------------------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------------------------


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


def _reachable_by_others(path: str) -> bool:
    """Whether users other than the owner can traverse to and execute `path`."""
    parts = os.path.realpath(path).strip("/").split("/")
    for i in range(1, len(parts) + 1):
        if not os.stat("/" + "/".join(parts[:i])).st_mode & 0o001:
            return False
    return True


def _python_prefix() -> tuple[str, str]:
    """(interpreter executable, its install prefix), with symlinks resolved."""
    exe = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not exe.startswith(prefix + os.sep):
        prefix = os.path.dirname(os.path.dirname(exe))
    return exe, prefix


def _run(
    code: str,
    stdin: str,
    level: str,
    *,
    timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
) -> SandboxResult:
    """Runs `code` at isolation `level` (see the module docstring)."""
    start = time.monotonic()
    exe, prefix = _python_prefix()
    jobdir = tempfile.mkdtemp(prefix="jmarl-sandbox-")  # mode 0700: private to this process
    work = os.path.join(jobdir, "work")
    stage = os.path.join(jobdir, "stage")
    os.mkdir(work, 0o700)
    os.mkdir(stage, 0o700)
    program = os.path.join(jobdir, "program.py")
    with open(program, "wb") as f:
        f.write(code.encode("utf-8", errors="surrogatepass"))
    uid = gid = _UID_BASE + secrets.randbelow(_UID_SPAN)
    drop_uid = os.geteuid() == 0 and (level == "namespaces" or (
        level == "rlimits" and _reachable_by_others(exe)))
    if drop_uid:
        os.chown(work, uid, gid)
        if level != "namespaces":
            os.chmod(jobdir, 0o711)  # the program must reach its working directory by path
    # At the namespaces level the working directory is a fresh tmpfs over /tmp (hiding the
    # host's /tmp), unless the interpreter itself lives under /tmp.
    under_tmp = prefix == "/tmp" or prefix.startswith("/tmp/")
    sandbox_root = "/tmp" if (level == "namespaces" and os.path.isdir("/tmp")
                              and not os.path.islink("/tmp") and not under_tmp) else work
    config = {
        "level": level,
        "uid": uid,
        "gid": gid,
        "drop_uid": drop_uid,
        "work": work,
        "sandbox_root": sandbox_root,
        "stage": stage,
        "program": program,
        "exe": exe,
        "python_prefix": prefix,
        "tmpfs_mb": _WORKDIR_TMPFS_MB,
        "parent_pid": os.getpid(),
        "runner": _RUNNER_SRC,
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
    status = _classify(wait_status, proc.returncode, timed_out, flooded)
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


def _classify(wait_status: str, launcher_code: int | None, timed_out: bool, flooded: bool) -> str:
    """The status of a run from the program's wait status ("exit N" / "signal N")."""
    if timed_out:
        return "timeout"
    if flooded:
        return "killed"
    kind, _, number = wait_status.partition(" ")
    if kind == "exit" and number.isdigit():
        code = int(number)
        if code == 0:
            return "ok"
        return "memory" if code == _MEMORY_EXIT else "error"
    if kind == "signal" and number.isdigit():
        return "timeout" if int(number) == signal.SIGXCPU else "killed"
    # No status: the launcher failed before the program ran, or the init process was killed.
    return "error" if launcher_code == _SETUP_EXIT else "killed"


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


_LEVEL_LOCK = threading.Lock()
_LEVEL: str | None = None


def _probe(level: str) -> bool:
    """Whether a trivial program runs correctly at `level` on this machine."""
    try:
        result = _run("print(6 * 7)", "", level, timeout_s=10.0, memory_mb=512,
                      max_output_bytes=1024)
    except OSError:
        return False
    return result.status == "ok" and result.stdout.strip() == "42"


def isolation_level() -> str:
    """The strongest isolation level that works here (probed once): one of ISOLATION_LEVELS.

    "namespaces" needs root (or CAP_SYS_ADMIN); "userns" needs unprivileged user namespaces;
    "rlimits" always works.
    """
    global _LEVEL
    with _LEVEL_LOCK:
        if _LEVEL is None:
            candidates = ("namespaces", "userns") if os.geteuid() == 0 else ("userns",)
            _LEVEL = next((lv for lv in candidates if _probe(lv)), "rlimits")
        return _LEVEL


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
      SandboxResult(status, stdout, stderr, duration_s); see the module docstring.
    Raises:
      JmarlError for invalid limits (a caller's mistake, not the program's).
    """
    _check_options(timeout_s, memory_mb, max_output_bytes)
    if not isinstance(code, str) or not isinstance(stdin, str):
        raise JmarlError("run_python takes the program and its stdin as str")
    start = time.monotonic()
    try:
        return _run(code, stdin, isolation_level(), timeout_s=timeout_s, memory_mb=memory_mb,
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
    isolation_level()  # probe once, before the threads start
    with ThreadPoolExecutor(max_workers=min(max_workers, len(codes))) as pool:
        futures = [
            pool.submit(run_python, code, stdin, timeout_s=timeout_s, memory_mb=memory_mb,
                        max_output_bytes=max_output_bytes)
            for code, stdin in zip(codes, stdins)
        ]
        return [f.result() for f in futures]
