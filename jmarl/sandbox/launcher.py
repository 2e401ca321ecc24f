"""The launcher: the process that isolates a run, then starts the program's interpreter.

This file runs inside the sandbox, not in jmarl: `jmarl.sandbox.spawn` ships its whole source
to `python -I -S -B -c` (no jmarl on the path, no site-packages), with the run's config as JSON in
argv[1]. So it imports only the standard library, and only inside `main`: importing it in the
parent (for `SETUP_EXIT`) costs nothing.
"""

# Exit code of the launcher, and of the program's process before its exec, when the requested
# isolation could not be set up.
SETUP_EXIT = 125


def main(config: dict) -> None:
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
            os._exit(SETUP_EXIT)
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
        os._exit(SETUP_EXIT)
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
        os._exit(SETUP_EXIT)
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


if __name__ == "__main__":  # `python -c` runs this file as __main__
    import json
    import sys

    main(json.loads(sys.argv[1]))
