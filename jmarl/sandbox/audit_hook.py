"""The program's interpreter: installs an audit hook, then runs the model-written program.

This file runs inside the sandbox, not in jmarl: the launcher execs `python -I -S -B -c` with its
whole source (shipped by `jmarl.sandbox.spawn`), the program's file descriptor, the level and the
bound paths as arguments. So it imports only the standard library, and only inside `main`.

The hook refuses network calls, writes outside the working directory and reading other
processes' /proc entries (at "landlock" and "rlimits" also reading or listing outside the working
directory and the interpreter's and system's directories, process creation, signals and ctypes).
It is defence in depth only: ctypes can bypass it, the kernel mechanisms cannot be.
"""

# Exit code for a program that ended with an uncaught MemoryError.
MEMORY_EXIT = 97


def main() -> None:
    """The program's interpreter (process P): install the audit hook, run the program.

    argv: [program_fd, level, JSON list of the bound paths]. An uncaught MemoryError exits with
    code MEMORY_EXIT after its traceback.
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
        sys.exit(MEMORY_EXIT if is_memory else 1)


if __name__ == "__main__":  # `python -c` runs this file as __main__
    main()
