"""What a run's program sees of the host's files: the interpreter and the system directories.

At "namespaces" and "userns" the program's private root filesystem holds exactly `root_layout`'s
paths, bound read-only (the launcher builds it); at "landlock" they are what the Landlock domain
lets it read and execute, and at "landlock" and "rlimits" what the audit hook lets it read.
"""

from __future__ import annotations

import os
import sys


def reachable_by_others(path: str) -> bool:
    """Whether users other than the owner can traverse to and execute `path`."""
    parts = os.path.realpath(path).strip("/").split("/")
    for i in range(1, len(parts) + 1):
        if not os.stat("/" + "/".join(parts[:i])).st_mode & 0o001:
            return False
    return True


def python_prefix() -> tuple[str, str]:
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
SYSTEM_PATHS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/lib32", "/lib32",
                "/usr/bin", "/bin", "/etc/ld.so.cache")


def root_layout(exe: str, prefix: str) -> tuple[list[str], list[list[str]]]:
    """(directories/files to bind read-only, [symlink, target] pairs) of the private root.

    Host paths that are symlinks (e.g. /lib -> usr/lib) are recreated as the same symlinks and
    their targets bound; a path below an already bound one is not bound again.
    """
    todo = [prefix, os.path.dirname(exe), *SYSTEM_PATHS]
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
                       for k in ("stdlib", "platstdlib")), *SYSTEM_PATHS]
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
