"""A sandbox for model-written Python: hostile code ends in a defined result, never harm.

`run_python(code, stdin)` runs one program in a separate process tree and returns a
`SandboxResult(status, stdout, stderr, duration_s)` with status one of:

  "ok"       the program exited with code 0;
  "error"    it exited with a non-zero code (an uncaught exception: traceback in stderr);
  "timeout"  it ran past the wall-clock timeout or its CPU-time limit;
  "memory"   it raised MemoryError (it hit the address-space limit);
  "killed"   it died from a signal (segfault, abort...) or flooded its output past the cap.

How a run is contained (`isolation_level()` says which level this machine achieves; docs/sandbox.md
has the table):

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
      fd/stdin/stdout/stderr links); a new
      /proc showing only the run's processes; and its working directory /tmp, a fresh
      size-limited tmpfs, the only writable place. The launcher pivot_roots into it and
      detaches the old root: no home directory, no host /tmp, nothing else of the host exists.
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
      (`require_isolation`: `sandbox.isolation: allow_weak` in the config, or
      JMARL_SANDBOX_ISOLATION=allow_weak).

At every level: a minimal environment (nothing inherited from the parent), `python -I -S -B`
reading the source from an inherited file descriptor (no path to the private job directory),
resource limits (CPU time, address space, file size, open files, processes, no core dumps),
the launcher as child subreaper with parent-death signals, and an audit hook in the program's
interpreter that refuses network calls, writes outside the working directory and reading other
processes' /proc entries (and, at "landlock" and "rlimits", reading or listing outside the working
directory and the interpreter's and system's directories, process creation, signals and ctypes).
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
ISOLATION_LEVELS = ("namespaces", "userns", "landlock", "rlimits")

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
    """The launcher (process L): isolates, forks init, relays the program's wait status.

    L makes itself a child subreaper, enters new namespaces (per `config["level"]`; at "userns"
    a user namespace mapping one uid/gid to itself), then forks I, which becomes PID 1 of the
    new PID namespace, builds the program's private root filesystem (see `setup_root`), and
    forks the program P. P applies rlimits, drops every capability (and, as root, its uid) and
    execs the interpreter running the program. I writes P's wait status ("exit N" /
    "signal N") to the status pipe.
    """
    import ctypes
    import json
    import os
    import platform
    import resource
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, clone_newuts, clone_newipc = 0x00020000, 0x04000000, 0x08000000
    clone_newuser, clone_newpid, clone_newnet = 0x10000000, 0x20000000, 0x40000000
    ms_rdonly, ms_nosuid, ms_nodev, ms_noexec = 1, 2, 4, 8
    ms_remount, ms_bind, ms_rec, ms_private = 32, 4096, 16384, 1 << 18
    ms_noatime, ms_nodiratime, ms_relatime = 1024, 2048, 1 << 21
    st_relatime = 4096
    mnt_detach = 2
    pr_set_pdeathsig, pr_capbset_drop = 1, 24
    pr_set_child_subreaper, pr_set_no_new_privs = 36, 38
    sys_pivot_root = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
    sys_mount_setattr = 442  # the same number on every architecture (Linux >= 5.12)

    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(source, target, fstype, flags, data=None) -> None:
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        ret = libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
        check(ret, f"mount {target}")

    def make_readonly(target: str, extra: int) -> None:
        """Read-only and nosuid (plus `extra` flags) on `target` and every mount below it."""

        class MountAttr(ctypes.Structure):
            _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                        ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

        attr = MountAttr(ms_rdonly | ms_nosuid | extra, 0, 0, 0)  # MOUNT_ATTR_* == MS_* here
        ret = libc.syscall(ctypes.c_long(sys_mount_setattr), ctypes.c_int(-100),
                           target.encode(), ctypes.c_uint(0x8000), ctypes.byref(attr),
                           ctypes.c_size_t(ctypes.sizeof(attr)))
        if ret == 0:
            return
        # Older kernels: remount the mount and each mount below it, one by one (keeping the
        # flags a user namespace may not clear).
        with open("/proc/self/mountinfo") as f:
            points = [line.split()[4].encode().decode("unicode_escape") for line in f]
        for point in [target] + [p for p in points if p.startswith(target.rstrip("/") + "/")]:
            st = os.statvfs(point)
            flags = ms_bind | ms_remount | ms_rdonly | ms_nosuid | extra
            flags |= st.f_flag & (ms_nodev | ms_noexec | ms_noatime | ms_nodiratime)
            if st.f_flag & st_relatime:
                flags |= ms_relatime
            mount(None, point, None, flags)

    status_fd = config["status_fd"]
    level = config["level"]
    limits = config["limits"]

    def setup_root() -> None:
        """In I, in a fresh mount namespace: a private root filesystem, then pivot_root into it.

        The new root is an empty tmpfs holding only: the interpreter's install tree and the
        system's library and command directories (bind mounts, read-only, nosuid, nodev), a
        minimal /dev (null, zero, full, random, urandom, the fd/std* links), a new /proc of the sandbox's PID
        namespace, and the program's size-limited writable tmpfs working directory. The old
        root is detached: nothing else of the host (home directories, /tmp, /etc...) exists.
        """
        if sys_pivot_root is None:
            raise OSError(f"pivot_root: unknown syscall number on {platform.machine()}")
        os.umask(0o022)
        check(libc.unshare(clone_newns), "unshare(CLONE_NEWNS)")
        mount(None, "/", None, ms_rec | ms_private)
        new = config["root_mount"]
        mount("tmpfs", new, "tmpfs", ms_nosuid | ms_nodev, "mode=0755,size=1m,nr_inodes=4096")
        for src in config["binds"]:
            dst = new + src
            if os.path.isdir(src):
                os.makedirs(dst, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.close(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644))
            mount(src, dst, None, ms_bind | ms_rec)
            make_readonly(dst, ms_nodev)
        for path, target in config["links"]:
            os.makedirs(os.path.dirname(new + path), exist_ok=True)
            if not os.path.lexists(new + path):
                os.symlink(target, new + path)
        os.mkdir(new + "/dev", 0o755)
        for name in ("null", "zero", "full", "random", "urandom"):
            if os.path.exists("/dev/" + name):
                dst = f"{new}/dev/{name}"
                os.close(os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644))
                mount("/dev/" + name, dst, None, ms_bind)
                st = os.statvfs(dst)
                flags = ms_bind | ms_remount | ms_nosuid | ms_noexec
                flags |= st.f_flag & (ms_nodev | ms_noatime | ms_nodiratime)
                if st.f_flag & st_relatime:
                    flags |= ms_relatime
                mount(None, dst, None, flags)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
            os.symlink(target, f"{new}/dev/{name}")
        os.mkdir(new + "/proc", 0o555)
        mount("proc", new + "/proc", "proc", ms_nosuid | ms_nodev | ms_noexec)
        work = config["sandbox_root"]
        os.makedirs(new + work, mode=0o755, exist_ok=True)
        mount("tmpfs", new + work, "tmpfs", ms_nosuid | ms_nodev,
              f"size={config['tmpfs_mb']}m,nr_inodes=4096,mode=0700,"
              f"uid={config['uid']},gid={config['gid']}")
        # Enter the new root and detach the old one (and with it every host mount).
        os.chdir(new)
        check(libc.syscall(ctypes.c_long(sys_pivot_root), b".", b"."), "pivot_root")
        check(libc.umount2(b".", mnt_detach), "umount old root")
        os.chdir("/")
        mount(None, "/", None, ms_bind | ms_remount | ms_rdonly | ms_nosuid | ms_nodev)
        os.chdir(work)

    def restrict_landlock() -> None:
        """In P (no_new_privs set): a Landlock domain for P and everything it starts.

        Filesystem (ABI >= 1): read and execute only in the bound paths (interpreter, system
        libraries and commands), everything in the working directory, /dev/null read-write,
        /dev/zero and /dev/urandom read; nothing else (no home, no /tmp, no /proc, no /etc).
        ABI >= 4: no TCP connect or bind. ABI >= 6: no abstract unix sockets or signals out
        of the domain. Raises (so the level is not reached) if Landlock is unavailable.
        """
        sys_create, sys_add_rule, sys_restrict = 444, 445, 446
        abi = libc.syscall(ctypes.c_long(sys_create), None, ctypes.c_size_t(0), ctypes.c_uint(1))
        if abi < 1:
            check(-1, "landlock_create_ruleset(VERSION)")
        fs_bits = {1: 13, 2: 14, 3: 15, 4: 15, 5: 16}.get(abi, 16)
        handled_fs = (1 << fs_bits) - 1
        execute, write_file, read_file, read_dir = 1, 2, 4, 8
        ioctl_dev = 1 << 15 if abi >= 5 else 0

        class RulesetAttr(ctypes.Structure):
            _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64),
                        ("scoped", ctypes.c_uint64)]

        class PathBeneath(ctypes.Structure):
            _pack_ = 1
            _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

        attr = RulesetAttr(handled_fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
        size = 8 if abi < 4 else 16 if abi < 6 else 24
        ruleset = libc.syscall(ctypes.c_long(sys_create), ctypes.byref(attr),
                               ctypes.c_size_t(size), ctypes.c_uint(0))
        if ruleset < 0:
            check(-1, "landlock_create_ruleset")
        file_rights = execute | write_file | read_file | (1 << 14 if abi >= 3 else 0) | ioctl_dev

        def allow(path: str, rights: int) -> None:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                if not os.path.isdir(path):
                    rights &= file_rights
                rule = PathBeneath(rights & handled_fs, fd)
                ret = libc.syscall(ctypes.c_long(sys_add_rule), ctypes.c_int(ruleset),
                                   ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint(0))
                check(0 if ret == 0 else -1, f"landlock_add_rule {path}")
            finally:
                os.close(fd)

        for path in config["binds"]:
            allow(path, execute | read_file | read_dir)
        allow(config["work"], handled_fs & ~execute)
        for name, rights in (("null", read_file | write_file), ("zero", read_file),
                             ("urandom", read_file)):
            if os.path.exists("/dev/" + name):
                allow("/dev/" + name, rights)
        ret = libc.syscall(ctypes.c_long(sys_restrict), ctypes.c_int(ruleset), ctypes.c_uint(0))
        check(0 if ret == 0 else -1, "landlock_restrict_self")
        os.close(ruleset)

    def become_program(program_fd: int) -> None:
        """In P: limits, identity, no capabilities, then exec the interpreter (never returns)."""
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
        # Empty the capability bounding set: the program can never hold a capability, not even
        # in its own namespaces (no remount, no mount) nor as root (an exec grants none). An
        # ordinary user without namespaces lacks CAP_SETPCAP and cannot drop it (EPERM); it keeps
        # a full bounding set but holds no capability, and no_new_privs stops an exec granting one.
        for cap in range(64):
            if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
                err = ctypes.get_errno()
                if err == 22 or (err == 1 and os.geteuid() != 0 and level in
                                 ("landlock", "rlimits")):
                    break
                check(-1, f"prctl(CAPBSET_DROP, {cap})")
        check(libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        if config["drop_uid"]:
            os.setgroups([])
            os.setgid(config["gid"])
            os.setuid(config["uid"])
            if os.getuid() == 0 or os.geteuid() == 0:
                raise OSError("could not drop root")
        if level == "landlock":
            restrict_landlock()
        check(libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        exe = config["exe"]
        argv = [exe, "-I", "-S", "-B", "-c", config["runner"], str(program_fd), config["hook"],
                json.dumps(config["binds"])]
        os.execve(exe, argv, config["env"])

    def init_main(program_fd: int) -> None:
        """In I (PID 1 of the new PID namespace, if any): fork P, reap everything, report."""
        check(libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        if level in ("namespaces", "userns"):
            setup_root()
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
    # The source reaches the interpreter as an open file descriptor: the program needs no path
    # to the (private, then invisible) job directory.
    program_fd = os.open(config["program"], os.O_RDONLY)
    flags = clone_newnet | clone_newpid | clone_newipc | clone_newuts
    if level == "userns" and config["drop_uid"]:
        # Root at this level: a helper left in the parent user namespace maps root and the
        # run's fresh uid/gid into the new one (the launcher keeps reaching the interpreter
        # as root; the program becomes the fresh uid, and no process of the run that the
        # program can reach is the host's root).
        go_r, go_w = os.pipe()
        done_r, done_w = os.pipe()
        helper = os.fork()
        if helper == 0:
            try:
                os.close(go_w)
                os.close(done_r)
                if os.read(go_r, 1) == b"1":
                    target = os.getppid()
                    ids = {"uid_map": config["uid"], "gid_map": config["gid"]}
                    for name, fresh in ids.items():
                        with open(f"/proc/{target}/{name}", "w") as f:
                            f.write(f"0 0 1\n{fresh} {fresh} 1\n")
                    os.write(done_w, b"1")
            finally:
                os._exit(0)
        os.close(go_r)
        os.close(done_w)
        try:
            check(libc.unshare(flags | clone_newuser), "unshare")
            os.write(go_w, b"1")
            mapped = os.read(done_r, 1) == b"1"
        finally:
            os.close(go_w)
            os.close(done_r)
            os.waitpid(helper, 0)
        if not mapped:
            raise OSError("could not map the user namespace's ids")
    elif level == "userns":
        uid, gid = os.geteuid(), os.getegid()
        check(libc.unshare(flags | clone_newuser), "unshare")
        # Map this uid/gid to themselves (the only ids an unprivileged user may map).
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1\n"),
                           ("gid_map", f"{gid} {gid} 1\n")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    elif level == "namespaces":
        check(libc.unshare(flags), "unshare")
    init = os.fork()
    if init == 0:
        try:
            init_main(program_fd)
        except BaseException as e:  # noqa: BLE001 - report any setup failure, then die
            os.write(2, f"[sandbox] setup failed: {e!r}\n".encode())
        os._exit(_SETUP_EXIT)
    os.close(program_fd)

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
    import json
    import os
    import sys
    import traceback

    program_fd, level = int(sys.argv[1]), sys.argv[2]
    # At "landlock" and "rlimits" (no private root filesystem) the hook limits reading to these
    # (the interpreter's and system's directories) and the working directory.
    readable = json.loads(sys.argv[3]) + [
        "/dev/null", "/dev/zero", "/dev/urandom", "/proc/self", "/proc/thread-self"]
    with os.fdopen(program_fd, "rb") as f:
        source = f.read()
    root = os.path.realpath(os.getcwd())
    strict = level in ("landlock", "rlimits")
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

    def readable_path(path) -> bool:
        if not strict or inside(path):
            return True
        text = os.path.abspath(os.path.join(root, os.fsdecode(path)))
        real = os.path.realpath(text)
        return any(p == r or p.startswith(r.rstrip("/") + "/") for r in readable
                   for p in (text, real))

    def hook(event: str, args: tuple) -> None:
        if event in banned:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if strict and event in ("os.listdir", "os.scandir", "open"):
            path = args[0] if args else None
            if isinstance(path, (str, bytes, os.PathLike)) and not readable_path(path):
                raise PermissionError(f"sandbox: reading {path!r} outside the working "
                                      "directory is not allowed")
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


# What the private root filesystem of the "namespaces" and "userns" levels holds besides the
# interpreter's install tree: the system's shared libraries and loader cache (which the
# interpreter and its extension modules load) and the system's command directories (so that
# a program may start `sh`, `cat`... which see the same private filesystem). Read-only.
_SYSTEM_PATHS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/lib32", "/lib32",
                 "/usr/bin", "/bin", "/etc/ld.so.cache")


def _root_layout(exe: str, prefix: str) -> tuple[list[str], list[list[str]]]:
    """(directories/files to bind read-only, [symlink, target] pairs) of the private root.

    Host paths that are symlinks (e.g. /lib -> usr/lib) are recreated as the same symlinks and
    their targets bound; a path below an already bound one is not bound again.
    """
    todo = [prefix, os.path.dirname(exe), *_SYSTEM_PATHS]
    homes = {os.path.realpath(os.path.expanduser("~"))}
    try:
        import pwd

        homes.add(os.path.realpath(pwd.getpwuid(os.geteuid()).pw_dir))
    except (ImportError, KeyError):
        pass
    if any(h == prefix or h.startswith(prefix.rstrip("/") + "/") for h in homes):
        # The interpreter is installed over the home directory itself (e.g. --prefix=$HOME):
        # bind only the interpreter, its standard library and its shared library.
        import sysconfig

        base = {"base": sys.base_prefix, "installed_base": sys.base_prefix,
                "platbase": sys.base_exec_prefix, "installed_platbase": sys.base_exec_prefix}
        todo = [exe, *(os.path.realpath(sysconfig.get_path(k, vars=base))
                       for k in ("stdlib", "platstdlib")), *_SYSTEM_PATHS]
        libdir, lib = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
        if libdir and lib and os.path.exists(os.path.join(libdir, lib)):
            todo.append(os.path.realpath(os.path.join(libdir, lib)))
        todo = [t for t in todo if t]
    binds: list[str] = []
    links: list[list[str]] = []
    seen: set[str] = set()
    while todo:
        path = todo.pop(0)
        if path in seen or not os.path.lexists(path):
            continue
        seen.add(path)
        if os.path.islink(path):
            links.append([path, os.readlink(path)])
            todo.append(os.path.realpath(path))
            continue
        real = os.path.realpath(path)
        if real != path:
            todo.append(real)
            continue
        binds.append(real)
    binds.sort(key=len)
    kept: list[str] = []
    for b in binds:
        if not any(b == k or b.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(b)
    return kept, links


def _run(
    code: str,
    stdin: str,
    level: str,
    *,
    timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
    hook_level: str | None = None,
) -> SandboxResult:
    """Runs `code` at isolation `level` (see the module docstring).

    `hook_level` (tests only): run the audit hook as at that level instead, e.g. "userns" at
    "landlock" to show what the kernel alone contains when the hook is bypassed.
    """
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
    root = os.geteuid() == 0
    if level == "userns" and not root:
        uid, gid = os.geteuid(), os.getegid()  # mapped to themselves in the user namespace
    drop_uid = root and (level in ("namespaces", "userns") or (
        level in ("landlock", "rlimits") and _reachable_by_others(exe)))
    if drop_uid and level in ("landlock", "rlimits"):
        os.chown(work, uid, gid)
        os.chmod(jobdir, 0o711)  # the program must reach its working directory by path
    binds, links = _root_layout(exe, prefix)
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
    """Whether a trivial program runs correctly at `level` on this machine (and, at "namespaces"
    and "userns", sees the private root filesystem: no /etc/passwd; at "landlock" the launcher
    fails unless the Landlock domain is in force)."""
    try:
        result = _run("import os\nprint(6 * 7, os.path.exists('/etc/passwd'))", "", level,
                      timeout_s=10.0, memory_mb=512, max_output_bytes=1024)
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
    keep the program off the user's files there: see `require_isolation`.
    """
    global _LEVEL
    with _LEVEL_LOCK:
        if _LEVEL is None:
            candidates = ("namespaces", "userns", "landlock") if os.geteuid() == 0 else (
                "userns", "landlock")
            _LEVEL = next((lv for lv in candidates if _probe(lv)), "rlimits")
        return _LEVEL


# Whether a level that cannot keep the program off the user's files may run model-written
# code: "strict" (the default) refuses, "allow_weak" accepts. Set from the config's
# `sandbox.isolation` (`set_isolation_policy`) or the JMARL_SANDBOX_ISOLATION variable.
ISOLATION_POLICIES = ("strict", "allow_weak")
WEAK_LEVELS = ("rlimits",)
_POLICY: str | None = None
_LOGGED = False
_DESCRIPTIONS = {
    "namespaces": "private read-only root filesystem, no network, own PID namespace, fresh uid",
    "userns": "user namespace: private read-only root filesystem, no network, own PID "
              "namespace",
    "landlock": "Landlock: no file outside the working directory, the interpreter and the "
                "system libraries; no TCP",
    "rlimits": "resource limits and an audit hook only: the program is NOT kept off this "
               "user's files by the kernel",
}


def set_isolation_policy(policy: str) -> None:
    """Sets the policy for weak isolation levels: "strict" (refuse) or "allow_weak"."""
    global _POLICY
    if policy not in ISOLATION_POLICIES:
        raise JmarlError(f"sandbox.isolation must be one of {ISOLATION_POLICIES}, got {policy!r}")
    _POLICY = policy


def isolation_policy() -> str:
    """The policy in force: `set_isolation_policy`'s, else $JMARL_SANDBOX_ISOLATION, else
    "strict"."""
    policy = _POLICY or os.environ.get("JMARL_SANDBOX_ISOLATION") or "strict"
    if policy not in ISOLATION_POLICIES:
        raise JmarlError(f"JMARL_SANDBOX_ISOLATION must be one of {ISOLATION_POLICIES}, got "
                         f"{policy!r}")
    return policy


def require_isolation(log: bool = True) -> str:
    """The isolation level model-written code will run at; with `log`, the first call that
    runs code says which (one line on stderr, once per process).

    Raises:
      JmarlError if the level is weak (cannot keep the program off the user's files) and the
      policy is "strict", naming the setting that accepts it.
    """
    global _LOGGED
    level = isolation_level()
    policy = isolation_policy()
    if level in WEAK_LEVELS and policy == "strict":
        raise JmarlError(
            f"the code sandbox can only reach isolation level {level!r} on this machine (no "
            f"user namespaces: {_DESCRIPTIONS[level]}), so a model-written program could read "
            "this user's files; running model-written code is refused. To accept the weaker "
            "isolation, set `sandbox.isolation: allow_weak` in the config (or "
            "JMARL_SANDBOX_ISOLATION=allow_weak); see docs/sandbox.md")
    if log and not _LOGGED:
        _LOGGED = True
        print(f"[jmarl] sandbox: isolation level {level!r} ({_DESCRIPTIONS[level]})"
              + (", accepted by sandbox.isolation: allow_weak" if level in WEAK_LEVELS else ""),
              file=sys.stderr, flush=True)
    return level


def run_summary() -> dict[str, str]:
    """{"sandbox_isolation": level} once model-written code has run in this process (the level
    it ran at, as logged), else {}: what a run's summary records."""
    return {"sandbox_isolation": _LEVEL} if _LOGGED and _LEVEL is not None else {}


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
        return _run(code, stdin, level, timeout_s=timeout_s, memory_mb=memory_mb,
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
