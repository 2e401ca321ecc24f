"""The sandbox against hostile programs: each ends in a defined status, and nothing escapes.

Each hostile program is checked for: its status; finishing within its timeout plus a margin;
no process of the run left behind (no descendant of this process, no process of a sandbox
uid, no zombie child); its temporary directory removed; and the parent unaffected. The network
and filesystem attacks are tried twice: through Python's API (which the audit hook refuses)
and through raw libc calls via ctypes (which bypass the hook, so only the kernel stops them).
The attacks on a user's files (home directory, a file in the host's /tmp) run at every level
this machine offers, and, as root, again as a throwaway unprivileged uid (userns, landlock and
rlimits levels), the way a researcher runs jmarl.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import glob
import inspect
import json
import os
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from jmarl import sandbox
from jmarl.errors import JmarlError
from jmarl.sandbox import audit_hook, filesystem, launcher, levels, policy, spawn

MARGIN_S = 4.0  # process start-up and kill/cleanup on a loaded 2-core machine
LEVEL = sandbox.isolation_level()
LANDLOCK = levels.probe("landlock")


def _sandbox_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "jmarl-sandbox-*")))


@pytest.fixture(autouse=True)
def private_runs(tmp_path_factory, monkeypatch):
    """Job directories in a private temp dir and a uid range of this test process only, so
    that concurrent test workers cannot see each other's runs as leftovers."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("jobs")))
    monkeypatch.setattr(spawn, "_UID_BASE", 3_000_000_000 + (os.getpid() % 2**16) * 2**12)
    monkeypatch.setattr(spawn, "_UID_SPAN", 2**12)
    # The behaviour tests run at whatever level this machine offers (the refusal of a weak
    # level under the default "strict" policy is tested on its own).
    monkeypatch.setattr(policy, "_POLICY", "allow_weak")


def _proc_table() -> list[tuple[int, int, str, int]]:
    """(pid, ppid, state, real uid) of every process, from /proc."""
    rows = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/status") as f:
                uid_line = next(line for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        rows.append((int(entry), int(fields[1]), fields[0].decode(), int(uid_line.split()[1])))
    return rows


def _leftovers() -> list[tuple[int, int, str, int]]:
    """Processes a run may have left: our children/descendants or sandbox-uid processes."""
    me = os.getpid()
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, ppid, _, _ in table:
        children.setdefault(ppid, []).append(pid)
    mine, todo = set(), [me]
    while todo:
        for child in children.get(todo.pop(), []):
            mine.add(child)
            todo.append(child)
    lo, hi = spawn._UID_BASE, spawn._UID_BASE + spawn._UID_SPAN
    return [row for row in table if row[0] in mine or lo <= row[3] < hi]


@pytest.fixture
def guarded():
    """Runs a program and checks the run left nothing behind and the parent is unaffected."""
    dirs_before = _sandbox_dirs()
    limits_before = {r: resource.getrlimit(r) for r in (resource.RLIMIT_AS, resource.RLIMIT_CPU,
                                                        resource.RLIMIT_NPROC)}
    cwd_before = os.getcwd()

    def run(code: str, stdin: str = "", *, timeout_s: float = 2.0, level: str | None = None,
            **kw) -> sandbox.SandboxResult:
        start = time.monotonic()
        if level is None:
            result = sandbox.run_python(code, stdin, timeout_s=timeout_s, **kw)
        else:
            kw.setdefault("memory_mb", 512)
            kw.setdefault("max_output_bytes", 65536)
            result = spawn.run_at_level(code, stdin, level, timeout_s=timeout_s, **kw)
        elapsed = time.monotonic() - start
        assert result.status in sandbox.STATUSES
        assert elapsed < timeout_s + MARGIN_S, (elapsed, result)
        assert 0 < result.duration_s <= elapsed + 1e-3
        assert _leftovers() == []
        assert _sandbox_dirs() == dirs_before
        return result

    yield run
    assert {r: resource.getrlimit(r) for r in limits_before} == limits_before
    assert os.getcwd() == cwd_before


# ------------------------------------------------------------------------------ normal programs


def test_normal_program_output_and_stdin(guarded):
    r = guarded("import sys\nname = sys.stdin.readline().strip()\nprint('hello', name)\n"
                "print(sum(map(int, sys.stdin.read().split())))", "world\n1 2 3\n4\n")
    assert r.status == "ok"
    assert r.stdout == "hello world\n10\n"
    assert r.stderr == ""


def test_run_summary_names_the_level_code_ran_at():
    """After `run_python` has run model-written code, a run's summary records the level it ran
    at (what `isolation_level()` reports)."""
    r = sandbox.run_python("print(6 * 7)")
    assert r.status == "ok" and r.stdout == "42\n"
    assert sandbox.run_summary() == {"sandbox_isolation": sandbox.isolation_level()}


def test_in_sandbox_programs_are_shipped_whole_and_need_only_the_standard_library():
    """The launcher and the program's interpreter run as `python -I -S -B -c <file's source>`:
    no jmarl and no site-packages there, so each file imports only the standard library."""
    for module, shipped in ((launcher, spawn._LAUNCHER_SRC), (audit_hook, spawn._AUDIT_HOOK_SRC)):
        with open(module.__file__, encoding="utf-8") as f:
            assert shipped == f.read()
        for node in ast.walk(ast.parse(shipped)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in sys.stdlib_module_names, (module.__name__, name)


def test_wrong_program_has_traceback(guarded):
    r = guarded("def f(x):\n    return x[3]\n\nprint('before')\nf([1, 2])\n")
    assert r.status == "error"
    assert r.stdout == "before\n"
    assert "Traceback" in r.stderr and "IndexError" in r.stderr and "line 2" in r.stderr


def test_syntax_error_and_exit_codes(guarded):
    r = guarded("def f(:\n")
    assert r.status == "error" and "SyntaxError" in r.stderr
    assert guarded("import sys; sys.exit(3)").status == "error"
    assert guarded("import sys; print('x'); sys.exit(0)").status == "ok"


def test_large_stdin_is_passed_whole(guarded):
    data = "".join(f"{i}\n" for i in range(40_000))  # ~230 kB, more than a pipe buffer
    r = guarded("import sys\nlines = sys.stdin.read().split()\nprint(len(lines), lines[-1])",
                data)
    assert r.status == "ok" and r.stdout == "40000 39999\n"


def test_program_ignoring_stdin_does_not_hang(guarded):
    r = guarded("print('no read')", "x" * 500_000)
    assert r.status == "ok" and r.stdout == "no read\n"


def test_output_cap_is_exact(guarded):
    ok = guarded("import sys; sys.stdout.write('a' * 1000)", max_output_bytes=1000)
    assert ok.status == "ok" and ok.stdout == "a" * 1000
    over = guarded("import sys; sys.stdout.write('a' * 1001)", max_output_bytes=1000)
    assert over.status == "killed" and over.stdout == "a" * 1000
    assert "output exceeded" in over.stderr


def test_unicode_and_invalid_bytes(guarded):
    r = guarded("import sys\nprint('héllo ✓')\nsys.stdout.flush()\n"
                "sys.stdout.buffer.write(b'\\xff\\xfe')")
    assert r.status == "ok" and r.stdout.startswith("héllo ✓\n") and "\ufffd" in r.stdout


def test_working_directory_is_writable_and_fresh(guarded):
    code = ("import os\nprint(sorted(os.listdir('.')))\nopen('a.txt', 'w').write('x')\n"
            "os.mkdir('d')\nprint(sorted(os.listdir('.')))")
    first = guarded(code)
    second = guarded(code)
    assert first.status == second.status == "ok"
    assert first.stdout == second.stdout == "[]\n['a.txt', 'd']\n"


def test_run_many_keeps_order_and_isolates(guarded):
    codes = [f"print({i} * {i})" for i in range(5)] + ["while True: pass", "1/0"]
    start = time.monotonic()
    results = sandbox.run_many(codes, timeout_s=1.5, max_workers=3)
    assert time.monotonic() - start < 1.5 * 2 + MARGIN_S
    assert [r.status for r in results] == ["ok"] * 5 + ["timeout", "error"]
    assert [r.stdout for r in results[:5]] == [f"{i * i}\n" for i in range(5)]
    stdins = ["1", "2"]
    echoed = sandbox.run_many(["print(int(input()) + 1)"] * 2, stdins, max_workers=2)
    assert [r.stdout for r in echoed] == ["2\n", "3\n"]
    assert _leftovers() == []


def test_bad_options_raise_jmarl_error():
    with pytest.raises(JmarlError, match="timeout_s"):
        sandbox.run_python("print(1)", timeout_s=0)
    with pytest.raises(JmarlError, match="memory_mb"):
        sandbox.run_python("print(1)", memory_mb=1)
    with pytest.raises(JmarlError, match="stdins"):
        sandbox.run_many(["print(1)"], ["a", "b"])


# ----------------------------------------------------------------------------- hostile programs


def test_infinite_loop_times_out(guarded):
    r = guarded("while True:\n    pass", timeout_s=1.5)
    assert r.status == "timeout" and "timed out" in r.stderr


def test_sleep_forever_times_out(guarded):
    r = guarded("import time\nprint('start', flush=True)\ntime.sleep(10_000)", timeout_s=1.0)
    assert r.status == "timeout" and r.stdout == "start\n"


def test_sleeping_child_after_parent_exits_is_killed(guarded):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(10_000)\n"
            "print('parent done')")
    r = guarded(code, timeout_s=2.0)
    assert r.stdout == "parent done\n"  # the orphan is killed when the program ends


def test_huge_allocation_is_memory(guarded):
    r = guarded("x = bytearray(30 * 2**30)\nprint('allocated')")
    assert r.status == "memory" and "MemoryError" in r.stderr and r.stdout == ""
    r = guarded("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))",
                memory_mb=256)
    assert r.status == "memory"


def test_endless_output_is_cut(guarded):
    r = guarded("while True:\n    print('spam' * 100)", max_output_bytes=65536)
    assert r.status == "killed"
    assert len(r.stdout.encode()) == 65536 and set(r.stdout) <= set("spam\n")
    r = guarded("import sys\nwhile True:\n    sys.stderr.write('e' * 1000)",
                max_output_bytes=4096)
    assert r.status == "killed" and r.stderr.startswith("e" * 4096)


def test_fork_bomb_is_contained(guarded):
    code = ("import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n"
            "        pass")
    r = guarded(code, timeout_s=2.0)
    assert r.status in ("timeout", "error")
    # The machine still runs programs normally afterwards.
    assert guarded("print('alive')").stdout == "alive\n"


def test_parent_environment_is_not_visible(guarded, monkeypatch):
    secret = "jmarl-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("JMARL_TEST_SECRET", secret)
    code = (
        "import os\n"
        "print(dict(os.environ))\n"
        "for name in os.listdir('/proc'):\n"
        "    try:\n"
        "        print(open(f'/proc/{name}/environ', 'rb').read())\n"
        "    except Exception as e:\n"
        "        print('denied', type(e).__name__)\n"
        "try:\n"
        "    print(open(f'/proc/{os.getppid()}/environ', 'rb').read())\n"
        "except Exception as e:\n"
        "    print('denied', type(e).__name__)\n"
    )
    r = guarded(code)
    assert secret not in r.stdout and secret not in r.stderr
    assert "JMARL_TEST_SECRET" not in r.stdout
    assert r.stdout.startswith("{") and "denied" in r.stdout


def _listener() -> socket.socket:
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    lst.setblocking(False)
    return lst


def _assert_never_accepted(lst: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        conn, _ = lst.accept()
        conn.close()


def test_cannot_connect_to_local_listener(guarded):
    lst = _listener()
    port = lst.getsockname()[1]
    try:
        py = guarded(
            "import socket\ns = socket.create_connection(('127.0.0.1', %d), timeout=1)\n"
            "s.sendall(b'hello')\nprint('connected')" % port
        )
        assert py.status == "error" and "connected" not in py.stdout
        # Raw libc connect() bypasses the audit hook: only the network namespace stops it.
        raw = guarded(
            "import ctypes, socket, struct\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)\n"
            "addr = struct.pack('=H', socket.AF_INET) + struct.pack('!H', %d)"
            " + socket.inet_aton('127.0.0.1') + bytes(8)\n"
            "ret = libc.connect(fd, addr, len(addr))\n"
            "print(ret, ctypes.get_errno())" % port
        )
        if LEVEL in ("namespaces", "userns"):
            assert raw.status == "ok"
            ret, err = map(int, raw.stdout.split())
            assert ret == -1 and err in (101, 111)  # ENETUNREACH / ECONNREFUSED
        else:
            assert raw.status == "error"  # the hook refuses ctypes at this level
        time.sleep(0.1)
        _assert_never_accepted(lst)
    finally:
        lst.close()


def test_files_outside_workdir_are_untouched(guarded, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious")
    before = sorted(os.listdir(outside))
    attempts = [
        f"open({str(victim)!r}, 'w').write('pwned')",
        f"open({str(outside / 'new.txt')!r}, 'x').write('new')",
        f"import os\nos.remove({str(victim)!r})",
        f"import shutil\nshutil.rmtree({str(outside)!r})",
        f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
        f"import os\nos.chdir('/')\nopen({str(victim)[1:]!r}, 'a').write('x')",
    ]
    for code in attempts:
        r = guarded(code)
        assert r.status == "error", (code, r)
    assert sorted(os.listdir(outside)) == before
    assert victim.read_text() == "precious"


@pytest.mark.skipif(LEVEL in ("landlock", "rlimits"), reason="needs namespaces")
def test_raw_syscalls_cannot_touch_files_outside(guarded, tmp_path):
    # Raw libc calls bypass the audit hook. The host's /tmp is hidden behind the sandbox's own
    # tmpfs; elsewhere, a world-writable directory is protected by the read-only mounts alone.
    shared = tempfile.mkdtemp(prefix="jmarl-sbtest-", dir="/var/tmp")
    try:
        os.chmod(shared, 0o777)
        victim = os.path.join(shared, "victim.txt")
        with open(victim, "w") as f:
            f.write("precious")
        os.chmod(victim, 0o666)
        private = tmp_path / "private.txt"
        private.write_text("secret")
        calls = [
            ("unlink", f"libc.unlink({victim.encode()!r})"),
            ("open-w", f"libc.open({victim.encode()!r}, 0o1001, 0)"),  # O_WRONLY | O_TRUNC
            ("create", f"libc.open({os.path.join(shared, 'new').encode()!r}, 0o101, 0o644)"),
            ("rename", f"libc.rename({victim.encode()!r}, "
                       f"{os.path.join(shared, 'stolen').encode()!r})"),
            ("unlink-tmp", f"libc.unlink({str(private).encode()!r})"),
            ("read-tmp", f"libc.open({str(private).encode()!r}, 0, 0)"),
        ]
        code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n" + "".join(
            f"print({name!r}, {call}, ctypes.get_errno())\n" for name, call in calls)
        r = guarded(code)
        assert r.status == "ok", r.stderr
        for line in r.stdout.splitlines():
            name, ret, err = line.split()
            # EROFS for the read-only mounts; ENOENT for the hidden host /tmp.
            assert int(ret) == -1 and int(err) in (2, 30), line
        assert os.listdir(shared) == ["victim.txt"]
        with open(victim) as f:
            assert f.read() == "precious"
        assert private.read_text() == "secret"
    finally:
        shutil.rmtree(shared)


@pytest.mark.skipif(LEVEL in ("landlock", "rlimits"), reason="needs namespaces")
def test_tmp_is_private_and_size_limited(guarded):
    r = guarded("import os, tempfile\n"
                "print(os.getcwd(), tempfile.gettempdir(), os.listdir('/tmp'))\n"
                "with open('fill', 'wb') as f:\n"
                "    for _ in range(100):\n"
                "        f.write(b'0' * 2**20)\n")
    assert r.stdout == "/tmp /tmp []\n"
    assert r.status == "error" and ("No space left" in r.stderr or "File too large" in r.stderr)


def test_segfault_is_killed(guarded):
    r = guarded("import ctypes\nctypes.string_at(0)")
    if LEVEL in ("landlock", "rlimits"):
        assert r.status == "error"  # ctypes is refused by the hook
    else:
        assert r.status == "killed" and "SIGSEGV" in r.stderr


def test_large_file_is_refused(guarded):
    r = guarded("open('big', 'wb').write(b'0' * (spawn._MAX_FILE_MB + 1) * 2**20)"
                .replace("spawn._MAX_FILE_MB", str(spawn._MAX_FILE_MB)))
    assert r.status == "error" and "File too large" in r.stderr


# ----------------------------------------------------------------------- isolation and fallback


def test_isolation_level_as_root_is_namespaces():
    assert LEVEL in sandbox.ISOLATION_LEVELS
    if os.geteuid() == 0 and sys.platform == "linux":
        assert LEVEL == "namespaces"


@pytest.mark.skipif(LEVEL != "namespaces", reason="needs the namespaces level (root)")
def test_namespaces_level_identity(guarded):
    code = (
        "import os\n"
        "print(os.getuid(), os.getgid(), os.getgroups())\n"
        "print(os.getpid())\n"
        "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
        "try:\n"
        "    print(sorted(os.listdir('/root')))\n"
        "except PermissionError:\n"
        "    print('denied')\n"
    )
    r = guarded(code)
    assert r.status == "ok"
    ids, pid, pids, root = r.stdout.splitlines()
    uid, gid, groups = ids.split(" ", 2)
    assert int(uid) >= spawn._UID_BASE and int(gid) >= spawn._UID_BASE and groups == "[]"
    assert int(pid) == 2  # PID 1 is the sandbox's init; the host's processes are invisible
    assert pids == "['1', '2']"
    _, prefix = filesystem.python_prefix()
    if prefix.startswith("/root/"):
        # /root is covered by an empty tmpfs holding only the interpreter's install tree.
        assert root == str([prefix.split("/")[2]])
    else:
        assert root == "denied"


@pytest.mark.parametrize("level", ["userns", "landlock", "rlimits"])
def test_fallback_levels_still_contain(guarded, level):
    if level == "userns" and LEVEL in ("landlock", "rlimits"):
        pytest.skip("user namespaces unavailable")
    if level == "landlock" and not LANDLOCK:
        pytest.skip("Landlock unavailable")
    lst = _listener()
    try:
        assert guarded("print(input()[::-1])", "abc", level=level).stdout == "cba\n"
        assert guarded("while True: pass", level=level, timeout_s=1.0).status == "timeout"
        assert guarded("x = bytearray(30 * 2**30)", level=level).status == "memory"
        r = guarded("import socket; socket.create_connection(('127.0.0.1', %d), timeout=1)"
                    % lst.getsockname()[1], level=level)
        assert r.status == "error"
        _assert_never_accepted(lst)
        r = guarded("import os\nif os.fork() == 0:\n    import time; time.sleep(1000)\n"
                    "print('forked')", level=level, timeout_s=1.5)
        if level in ("landlock", "rlimits"):
            assert r.status == "error" and "os.fork" in r.stderr  # the hook refuses fork
        else:
            assert r.stdout == "forked\n"  # the child is killed with the PID namespace
    finally:
        lst.close()


# --------------------------------------------------- hostile programs against the user's files
#
# The same hostile programs run as root (in this process, at this machine's level) and as an
# ordinary user (a throwaway uid, at "userns" and at a forced "rlimits"): a fake home directory
# of the user holding a secret, a file of the user in the host's /tmp to overwrite, and a
# listener on 127.0.0.1. Nothing may be read, listed, written or reached.


def _hostile_cases(home: str, secret_file: str, victim: str, port: int) -> list:
    """[name, code, timeout_s] of every hostile (and one normal) program."""
    libc = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    connect = ("import socket, struct\nfd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)\n"
               "addr = struct.pack('=H', socket.AF_INET) + struct.pack('!H', %d)"
               " + socket.inet_aton('127.0.0.1') + bytes(8)\n"
               "print(libc.connect(fd, addr, len(addr)), ctypes.get_errno())\n" % port)
    return [
        ["normal", "import sys\nprint('hello', sum(range(10)))", 2.0],
        ["read_secret", f"print(open({secret_file!r}).read())", 2.0],
        ["list_home", f"import os\nprint(os.listdir({home!r}))", 2.0],
        ["walk_home", f"import os\nprint(list(os.walk({home!r})))", 2.0],
        ["list_tmp", "import os\nprint(os.listdir('/tmp'))", 2.0],
        ["write_victim", f"open({victim!r}, 'w').write('pwned')", 2.0],
        ["libc_read", libc + f"fd = libc.open({secret_file.encode()!r}, 0)\n"
                             "buf = ctypes.create_string_buffer(4096)\n"
                             "n = libc.read(fd, buf, 4096)\n"
                             "print(fd, n, buf.raw[:max(n, 0)])", 2.0],
        # O_WRONLY | O_TRUNC
        ["libc_write", libc + f"fd = libc.open({victim.encode()!r}, 0o1001, 0)\n"
                              "print(fd, libc.write(fd, b'pwned', 5), ctypes.get_errno())", 2.0],
        ["libc_create", libc + f"print(libc.open({(home + '/planted').encode()!r}, 0o101, 0o644),"
                               " ctypes.get_errno())", 2.0],
        ["subprocess_cat", "import subprocess\n"
                           f"r = subprocess.run(['cat', {secret_file!r}], capture_output=True)\n"
                           "print(r.returncode, r.stdout, r.stderr)", 2.0],
        ["posix_spawn_cat", "import os\n"
                            f"pid = os.posix_spawn('/bin/cat', ['cat', {secret_file!r}], {{}})\n"
                            "print(os.waitpid(pid, 0))", 2.0],
        ["shell", "import subprocess\n"
                  f"cmd = 'ls -la {home}; cat {secret_file}; echo pwned > {victim}'\n"
                  "r = subprocess.run(['sh', '-c', cmd], capture_output=True)\n"
                  "print(r.returncode, r.stdout, r.stderr)", 2.0],
        ["connect_python", "import socket\n"
                           f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                           "s.sendall(b'hello')\nprint('connected')", 2.0],
        ["connect_libc", libc + connect, 2.0],
        ["environ", "import os\nprint(dict(os.environ))\n"
                    "for name in os.listdir('/proc'):\n"
                    "    try:\n"
                    "        print(open(f'/proc/{name}/environ', 'rb').read())\n"
                    "    except Exception as e:\n"
                    "        print('denied', type(e).__name__)\n", 2.0],
        ["loop", "while True:\n    pass", 1.0],
        ["memory", "x = bytearray(30 * 2**30)\nprint('allocated')", 2.0],
        ["flood", "while True:\n    print('spam' * 100)", 2.0],
        ["fork_bomb", "import os\nwhile True:\n    try:\n        os.fork()\n"
                      "    except Exception:\n        pass", 2.0],
        ["orphan", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(10_000)\n"
                   "print('parent done')", 2.0],
        ["segfault", "import ctypes\nctypes.string_at(0)", 2.0],
    ]


def _check_hostile(level: str, runs: dict, secrets_: list[str], victim: str, home: str,
                   home_names: list[str], hook: str | None = None) -> None:
    """Asserts every hostile run at `level` was contained; `runs[name] = [status, out, err]`.

    `hook`: the level the audit hook ran as (default: `level`); "userns" at "landlock" leaves
    ctypes and child processes to the kernel alone."""
    for name, (status, out, err) in runs.items():
        for secret in secrets_:
            assert secret not in out and secret not in err, (level, name, out, err)
        for entry in home_names[1:]:  # the home's entries (no program names) were never listed
            assert entry not in out and entry not in err, (level, name, out, err)
        assert "allocated" not in out and "connected" not in out, (level, name, out)
    weak = (hook or level) in ("landlock", "rlimits")  # the hook refuses ctypes, processes
    assert runs["normal"][:2] == ["ok", "hello 45\n"], runs["normal"]
    for name in ("read_secret", "list_home", "connect_python"):
        assert runs[name][0] == "error", (level, name, runs[name])
    # (With namespaces, /tmp is the program's own working directory: writing there is allowed
    # and leaves the host's file alone, checked below.)
    assert runs["write_victim"][0] == "error" or not weak, runs["write_victim"]
    assert runs["walk_home"][1] in ("[]\n", ""), runs["walk_home"]
    assert os.path.basename(victim) not in runs["list_tmp"][1]
    if weak:  # the audit hook refuses ctypes, child processes and reading outside
        for name in ("libc_read", "libc_write", "libc_create", "subprocess_cat",
                     "posix_spawn_cat", "shell", "connect_libc", "segfault"):
            assert runs[name][0] == "error", (level, name, runs[name])
        assert runs["fork_bomb"][0] in ("timeout", "error")
        assert runs["orphan"][0] == "error" and "os.fork" in runs["orphan"][2]
    elif level == "landlock":  # Landlock alone refuses: permission denied, no TCP
        for name in ("libc_read", "libc_write", "libc_create"):
            assert runs[name][0] == "ok" and runs[name][1].split()[0] == "-1", (name, runs[name])
        assert runs["connect_libc"][0] == "ok"
        ret, err = map(int, runs["connect_libc"][1].split())
        assert ret == -1 and err == 13  # EACCES from Landlock (ABI >= 4)
        assert runs["subprocess_cat"][0] == "ok"
        assert "Permission denied" in runs["subprocess_cat"][1]
        assert runs["posix_spawn_cat"][0] == "ok"
        assert "Permission denied" in runs["posix_spawn_cat"][2]
        assert runs["shell"][0] == "ok" and "Permission denied" in runs["shell"][1]
        assert runs["list_tmp"][0] == "error"
        assert runs["segfault"][0] == "killed" and "SIGSEGV" in runs["segfault"][2]
        assert runs["fork_bomb"][0] in ("timeout", "error")
        assert runs["orphan"][1] == "parent done\n"
    else:  # the kernel refuses: the files do not exist in the private root, no network
        for name in ("libc_read", "libc_write", "libc_create"):
            assert runs[name][0] == "ok" and runs[name][1].split()[0] == "-1", (name, runs[name])
        assert runs["connect_libc"][0] == "ok"
        ret, err = map(int, runs["connect_libc"][1].split())
        assert ret == -1 and err in (101, 111)  # ENETUNREACH / ECONNREFUSED
        assert runs["subprocess_cat"][0] == "ok" and "No such file" in runs["subprocess_cat"][1]
        assert runs["posix_spawn_cat"][0] == "ok" and "No such file" in runs["posix_spawn_cat"][2]
        assert runs["shell"][0] == "ok" and "No such file" in runs["shell"][1]
        assert runs["segfault"][0] == "killed" and "SIGSEGV" in runs["segfault"][2]
        assert runs["fork_bomb"][0] in ("timeout", "error")
        assert runs["orphan"][1] == "parent done\n"
        assert runs["environ"][0] == "ok" and "denied" in runs["environ"][1]
    assert runs["loop"][0] == "timeout"
    assert runs["memory"][0] == "memory"
    assert runs["flood"][0] == "killed"
    with open(victim) as f:
        assert f.read() == "precious"
    assert sorted(os.listdir(home)) == sorted(home_names)


def _fake_user_files(base: str, uid: int) -> tuple[str, str, str, str, list[str]]:
    """(home, secret file, victim in the host's /tmp, secret, home entries), owned by `uid`."""
    token = secrets.token_hex(8)
    secret = "jmarl-ssh-key-" + secrets.token_hex(16)
    home = os.path.join(base, "home")
    os.makedirs(os.path.join(home, ".ssh"))
    secret_file = os.path.join(home, ".ssh", "id_rsa")
    with open(secret_file, "w") as f:
        f.write(secret)
    notes = os.path.join(home, f"notes-{token}.txt")
    with open(notes, "w") as f:
        f.write(secret)
    fd, victim = tempfile.mkstemp(prefix="jmarl-victim-", dir="/tmp")
    with os.fdopen(fd, "w") as f:
        f.write("precious")
    for path in (home, os.path.join(home, ".ssh")):
        os.chmod(path, 0o700)
    for path in (secret_file, notes, victim):
        os.chmod(path, 0o600)
    for path in (home, os.path.join(home, ".ssh"), secret_file, notes, victim):
        os.chown(path, uid, uid)
    return home, secret_file, victim, secret, [".ssh", f"notes-{token}.txt"]


@pytest.mark.parametrize("level", sandbox.ISOLATION_LEVELS)
@pytest.mark.slow
def test_hostile_programs_against_user_files(guarded, tmp_path, monkeypatch, level):
    if not levels.probe(level):
        pytest.skip(f"level {level} unavailable here")
    env_secret = "jmarl-env-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("JMARL_TEST_SECRET", env_secret)
    base = tempfile.mkdtemp(prefix="jmarl-sbuser-", dir="/var/tmp")
    lst = _listener()
    try:
        home, secret_file, victim, secret, names = _fake_user_files(base, os.getuid())
        runs = {}
        for name, code, timeout in _hostile_cases(home, secret_file, victim,
                                                  lst.getsockname()[1]):
            r = guarded(code, timeout_s=timeout, memory_mb=512, level=level)
            runs[name] = [r.status, r.stdout, r.stderr]
        _check_hostile(level, runs, [secret, env_secret], victim, home, names)
        _assert_never_accepted(lst)
    finally:
        lst.close()
        shutil.rmtree(base)
        if "victim" in locals():
            os.unlink(victim)


# As root, run a driver as a throwaway uid. The driver needs the interpreter and the repo: if
# one of them sits under a directory other users cannot enter (e.g. /root), a private mount
# namespace of the driver covers that directory with an empty tmpfs holding only that tree.
_SETUP = r'''
import ctypes, json, os, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {dst}: {os.strerror(err)}")
os.umask(0o022)
if libc.unshare(0x00020000) != 0:
    raise OSError(ctypes.get_errno(), "unshare")
mount(None, "/", None, 16384 | (1 << 18))  # MS_REC | MS_PRIVATE
for path, stage in cfg["expose"]:
    mount(path, stage, None, 4096 | 16384)  # MS_BIND | MS_REC
for hidden in cfg["cover"]:
    mount("tmpfs", hidden, "tmpfs", 2 | 4, "mode=0755,size=1m")
for path, stage in cfg["expose"]:
    os.makedirs(path, exist_ok=True)
    mount(stage, path, None, 8192)  # MS_MOVE
os.setgroups([])
os.setgid(cfg["uid"])
os.setuid(cfg["uid"])
os.chdir(cfg["home"])
os.execve(cfg["exe"], [cfg["exe"], "-I", "-S", "-c", cfg["driver"], json.dumps(cfg["args"])],
          cfg["env"])
'''

_DRIVER = r'''
import json, os, sys
args = json.loads(sys.argv[1])
sys.path.insert(0, args["repo"])
from jmarl import sandbox
from jmarl.errors import JmarlError
from jmarl.sandbox import levels, spawn
out = {"uid": os.getuid(), "level": sandbox.isolation_level(), "runs": {}, "left": []}
for level, hook in args["levels"]:
    if level == "userns" and out["level"] != "userns":
        continue
    if level == "landlock" and not levels.probe("landlock"):
        continue
    runs = out["runs"][f"{level} {hook or level}"] = {}
    for name, code, timeout in args["cases"]:
        r = spawn.run_at_level(code, "", level, timeout_s=timeout, memory_mb=512,
                               max_output_bytes=65536, hook_level=hook)
        runs[name] = [r.status, r.stdout[-4000:], r.stderr[-4000:]]
        out["left"] += spawn._descendants(os.getpid())
# The default policy refuses the weak level; allow_weak accepts it.
levels._LEVEL = "rlimits"
try:
    sandbox.run_python("print(1)")
    out["strict"] = "ran"
except JmarlError as e:
    out["strict"] = str(e)
sandbox.set_isolation_policy("allow_weak")
out["allow_weak"] = sandbox.run_python("print(1)").stdout
print(json.dumps(out))
'''


def _hidden_ancestor(path: str) -> str | None:
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _throwaway_uid() -> int:
    used = {row[3] for row in _proc_table()}
    while True:
        uid = 2_900_000_000 + secrets.randbelow(2**20)
        if uid not in used:
            return uid


def _run_as_user(uid: int, home: str, driver: str, args: dict, tmp_path, env=None) -> dict:
    """Runs the `driver` source as `uid` in `home` (through `_SETUP`) with
    `args` + {"repo": ...}; returns the JSON object it prints last."""
    exe, prefix = filesystem.python_prefix()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(sandbox.__file__)))
    repo = os.path.dirname(repo)
    expose, cover = [], []
    for path in sorted({prefix, repo}):
        hidden = _hidden_ancestor(path)
        if hidden is not None:
            expose.append([path, tempfile.mkdtemp(prefix="stage", dir=tmp_path)])
            if hidden not in cover:
                cover.append(hidden)
    cfg = {"uid": uid, "home": home, "exe": exe, "expose": expose, "cover": cover,
           "driver": driver,
           "env": {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", **(env or {})},
           "args": {"repo": repo, **args}}
    proc = subprocess.run([exe, "-I", "-S", "-c", _SETUP, json.dumps(cfg)],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.geteuid() != 0, reason="runs as an ordinary user already (see above)")
@pytest.mark.skipif(LEVEL != "namespaces", reason="root without mount namespaces cannot show a "
                    "throwaway uid the interpreter")
@pytest.mark.slow
def test_hostile_programs_as_unprivileged_user(tmp_path):
    uid = _throwaway_uid()
    base = tempfile.mkdtemp(prefix="jmarl-sbuser-", dir="/var/tmp")
    os.chmod(base, 0o755)
    lst = _listener()
    victim = None
    try:
        home, secret_file, victim, secret, names = _fake_user_files(base, uid)
        env_secret = "jmarl-env-secret-" + secrets.token_hex(8)
        cases = _hostile_cases(home, secret_file, victim, lst.getsockname()[1])
        out = _run_as_user(uid, home, _DRIVER, {
            "cases": cases,
            "levels": [["userns", None], ["landlock", None], ["landlock", "userns"],
                       ["rlimits", None]]}, tmp_path, {"JMARL_TEST_SECRET": env_secret})
        assert out["uid"] == uid
        if LEVEL == "namespaces":  # this kernel allows user namespaces
            assert out["level"] == "userns" and "userns userns" in out["runs"]
        assert out["left"] == []
        if LANDLOCK:
            assert "landlock userns" in out["runs"]
        for key, runs in out["runs"].items():
            level, hook = key.split()
            _check_hostile(level, runs, [secret, env_secret], victim, home, names, hook)
        assert "sandbox.isolation: allow_weak" in out["strict"]
        assert out["allow_weak"] == "1\n"
        _assert_never_accepted(lst)
        assert [row for row in _proc_table() if row[3] == uid] == []  # nothing left running
    finally:
        lst.close()
        shutil.rmtree(base)
        if victim is not None:
            os.unlink(victim)


# ------------------------------------------- privileges, mounts, /dev, IPC and UTS namespaces
#
# A program reports what the kernel says about itself: /proc/self/status (capabilities,
# no_new_privs), /proc/self/mountinfo (its mounts and their options), the names in /dev, its
# IPC and UTS namespaces, the same capabilities through raw prctl/capget (Landlock hides /proc,
# so there only ctypes can ask; the audit hook of "userns" lets it), and whether a System V
# shared-memory segment of the host is visible. It runs at every level as the invoking user
# (root in CI) and, as root, again as a throwaway ordinary user.

_PRIVILEGE_PROBE = r'''
import json, os
out = {"pid": os.getpid(), "cwd": os.getcwd()}

def attempt(key, fn):
    try:
        out[key] = fn()
    except Exception as e:
        out[key] = f"ERR {type(e).__name__} {getattr(e, 'errno', None)}"

def read(path):
    with open(path) as f:
        return f.read()

def kernel():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    bnd = 0
    for cap in range(64):
        ret = libc.prctl(23, cap, 0, 0, 0)  # PR_CAPBSET_READ; EINVAL past the last cap
        if ret < 0:
            break
        bnd |= ret << cap
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # 2 x {effective, permitted, inheritable}
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    return {"nnp": libc.prctl(39, 0, 0, 0, 0),  # PR_GET_NO_NEW_PRIVS
            "bnd": bnd, "eff": data[0] | data[3] << 32, "prm": data[1] | data[4] << 32}

def shm():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    return [libc.shmget(SHM_KEY, 0, 0), ctypes.get_errno()]

attempt("status", lambda: read("/proc/self/status"))
attempt("mountinfo", lambda: read("/proc/self/mountinfo"))
attempt("dev", lambda: sorted(os.listdir("/dev")))
attempt("ipc", lambda: os.readlink("/proc/self/ns/ipc"))
attempt("uts", lambda: os.readlink("/proc/self/ns/uts"))
attempt("kernel", kernel)
attempt("shm", shm)
print(json.dumps(out))
'''

def host_view() -> dict:
    """What the process running the sandbox sees: its bounding set, IPC and UTS namespaces."""
    with open("/proc/self/status") as f:
        bnd = next(line for line in f if line.startswith("CapBnd:")).split()[1]
    return {"bnd": int(bnd, 16), "ipc": os.readlink("/proc/self/ns/ipc"),
            "uts": os.readlink("/proc/self/ns/uts")}


@contextlib.contextmanager
def shm_segment():
    """A System V shared-memory segment of this process (mode 0600), yielding its key: a
    program in the same IPC namespace finds it, one in another cannot (ENOENT)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    while True:
        key = 0x10000000 + secrets.randbelow(0x60000000)
        shmid = libc.shmget(key, 4096, 0o1000 | 0o2000 | 0o600)  # IPC_CREAT | IPC_EXCL
        if shmid >= 0:
            break
        if ctypes.get_errno() != 17:  # EEXIST: another key
            raise OSError(ctypes.get_errno(), "shmget")
    try:
        yield key
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


# The driver run as the throwaway user: the two helpers above, then the probe at each level.
_PRIVILEGE_DRIVER = ("import contextlib, ctypes, os, secrets\n" + inspect.getsource(host_view)
                     + inspect.getsource(shm_segment) + r'''
import json, sys
args = json.loads(sys.argv[1])
sys.path.insert(0, args["repo"])
from jmarl import sandbox
from jmarl.sandbox import filesystem, levels, spawn
out = {"uid": os.getuid(), "level": sandbox.isolation_level(), "host": host_view(),
       "binds": filesystem.root_layout(*filesystem.python_prefix())[0], "runs": {}}
with shm_segment() as key:
    for level, hook in args["levels"]:
        if level == "userns" and out["level"] != "userns":
            continue
        if level == "landlock" and not levels.probe("landlock"):
            continue
        r = spawn.run_at_level(f"SHM_KEY = {key}\n" + args["probe"], "", level,
                               timeout_s=5.0, memory_mb=512, max_output_bytes=1 << 20,
                               hook_level=hook)
        out["runs"][level] = [r.status, r.stdout, r.stderr]
print(json.dumps(out))
''')

# (level, the audit hook's level): at "landlock" the hook of "userns" lets ctypes ask the kernel.
_PRIVILEGE_LEVELS = [["namespaces", None], ["userns", None], ["landlock", "userns"],
                     ["rlimits", None]]
_DEV_NAMES = ("null", "zero", "full", "random", "urandom")


def _check_privileges(level: str, out: dict, host: dict, root: bool, binds: list[str]) -> None:
    """Asserts what `_PRIVILEGE_PROBE` reported at `level` (run as root or not)."""
    ctx = (level, root, out)
    private = level in ("namespaces", "userns")
    # Capabilities and no_new_privs, as /proc/self/status and as prctl/capget report them.
    views = []
    if level == "landlock":
        assert out["status"].startswith("ERR PermissionError"), ctx  # Landlock: no /proc
    else:
        status = dict(line.split(":", 1) for line in out["status"].splitlines())
        # The program's own entry: at "namespaces"/"userns" the sandbox's /proc (PID 2 there).
        assert int(status["Pid"]) == out["pid"], ctx
        assert out["pid"] == 2 or not private, ctx
        views.append({"nnp": int(status["NoNewPrivs"]), "bnd": int(status["CapBnd"], 16),
                      "eff": int(status["CapEff"], 16), "prm": int(status["CapPrm"], 16)})
    if level == "rlimits":
        assert out["kernel"].startswith("ERR PermissionError"), ctx  # the hook refuses ctypes
    else:
        views.append(out["kernel"])
    # The bounding set is emptied wherever the kernel lets the launcher (as root, or inside
    # the user namespace); an ordinary user without namespaces cannot drop it (it holds no
    # capability, and no_new_privs keeps an exec from granting one).
    bnd = 0 if root or private else host["bnd"]
    for view in views:
        assert view == {"nnp": 1, "bnd": bnd, "eff": 0, "prm": 0}, ctx
    if not private:  # the host's /dev (hidden), IPC and UTS namespaces
        assert out["dev"].startswith("ERR PermissionError"), ctx  # Landlock, or the hook
        assert (out["ipc"], out["uts"]) == (host["ipc"], host["uts"]), ctx
        if level == "landlock":  # the host's segment is there (found, or EACCES as another uid)
            assert out["shm"][0] >= 0 or out["shm"][1] == 13, ctx
        return
    # Own IPC and UTS namespaces: the host's segment does not exist there (ENOENT).
    for ns in ("ipc", "uts"):
        assert out[ns].startswith(f"{ns}:[") and out[ns] != host[ns], ctx
    assert out["shm"] == [-1, 2], ctx
    # A minimal /dev.
    devs = [n for n in _DEV_NAMES if os.path.exists("/dev/" + n)]
    assert out["dev"] == sorted(devs + ["fd", "stderr", "stdin", "stdout"]), ctx
    # Mounts: a read-only tmpfs root, the binds (and anything below them) read-only, nosuid,
    # nodev; the device binds nosuid, noexec; a new proc; the writable tmpfs working directory;
    # nothing else.
    mounts = []
    for line in out["mountinfo"].splitlines():
        fields = line.split()
        mounts.append((fields[4], set(fields[5].split(",")), fields[fields.index("-") + 1]))
    points = {point for point, _, _ in mounts}
    assert set(binds) | {"/", "/proc", out["cwd"]} | {"/dev/" + n for n in devs} <= points, ctx

    def under(path: str, top: str) -> bool:
        return path == top or path.startswith(top.rstrip("/") + "/")

    for point, opts, fstype in mounts:
        where = (level, root, point, opts, fstype)
        if point == "/":
            assert fstype == "tmpfs" and {"ro", "nosuid", "nodev"} <= opts, where
        elif any(under(point, b) for b in binds):
            assert {"ro", "nosuid", "nodev"} <= opts, where
        elif point in ("/dev/" + n for n in devs):
            assert {"nosuid", "noexec"} <= opts, where
        elif point == "/proc":
            assert fstype == "proc" and {"nosuid", "nodev", "noexec"} <= opts, where
        elif point == out["cwd"]:
            assert fstype == "tmpfs" and {"rw", "nosuid", "nodev"} <= opts, where
        else:
            raise AssertionError(f"unexpected mount in the sandbox: {where}")


@pytest.mark.parametrize("level,hook", _PRIVILEGE_LEVELS)
def test_privileges_mounts_dev_and_namespaces(guarded, level, hook):
    if not levels.probe(level):
        pytest.skip(f"level {level} unavailable here")
    binds = filesystem.root_layout(*filesystem.python_prefix())[0]
    with shm_segment() as key:
        r = guarded(f"SHM_KEY = {key}\n" + _PRIVILEGE_PROBE, level=level, hook_level=hook,
                    timeout_s=5.0, max_output_bytes=1 << 20)
    assert r.status == "ok", r
    _check_privileges(level, json.loads(r.stdout), host_view(), os.geteuid() == 0, binds)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs as an ordinary user already (see above)")
@pytest.mark.skipif(LEVEL != "namespaces", reason="root without mount namespaces cannot show a "
                    "throwaway uid the interpreter")
def test_privileges_mounts_dev_and_namespaces_as_unprivileged_user(tmp_path):
    uid = _throwaway_uid()
    base = tempfile.mkdtemp(prefix="jmarl-sbuser-", dir="/var/tmp")
    os.chmod(base, 0o755)
    home = os.path.join(base, "home")
    os.mkdir(home, 0o700)
    os.chown(home, uid, uid)
    try:
        out = _run_as_user(uid, home, _PRIVILEGE_DRIVER,
                           {"probe": _PRIVILEGE_PROBE, "levels": _PRIVILEGE_LEVELS[1:]},
                           tmp_path)
        assert out["uid"] == uid and out["level"] == "userns"
        assert sorted(out["runs"]) == sorted(["userns", "rlimits"] +
                                             (["landlock"] if LANDLOCK else []))
        for level, (status, stdout, stderr) in out["runs"].items():
            assert status == "ok", (level, stdout, stderr)
            _check_privileges(level, json.loads(stdout), out["host"], False, out["binds"])
        assert [row for row in _proc_table() if row[3] == uid] == []  # nothing left running
    finally:
        shutil.rmtree(base)


def test_strict_policy_refuses_weak_level(monkeypatch, capsys):
    monkeypatch.setattr(levels, "_LEVEL", "rlimits")
    monkeypatch.setattr(policy, "_POLICY", None)
    monkeypatch.delenv("JMARL_SANDBOX_ISOLATION", raising=False)
    assert sandbox.isolation_policy() == "strict"
    with pytest.raises(JmarlError, match="sandbox.isolation: allow_weak"):
        sandbox.run_python("print(1)")
    with pytest.raises(JmarlError, match="sandbox.isolation: allow_weak"):
        sandbox.run_many(["print(1)"])
    monkeypatch.setenv("JMARL_SANDBOX_ISOLATION", "allow_weak")
    monkeypatch.setattr(policy, "_LOGGED", False)
    assert sandbox.run_python("print(1)").stdout == "1\n"
    assert "isolation level 'rlimits'" in capsys.readouterr().err
    with pytest.raises(JmarlError, match="sandbox.isolation"):
        sandbox.set_isolation_policy("loose")


def test_the_run_setup_sets_the_isolation_policy(monkeypatch):
    from jmarl.config import load_config
    from jmarl.process import setup_sandbox

    monkeypatch.setattr(policy, "_POLICY", None)
    monkeypatch.delenv("JMARL_SANDBOX_ISOLATION", raising=False)
    config = load_config("configs/quickstart.yaml", ["sandbox.isolation=allow_weak"])
    assert config.sandbox.isolation == "allow_weak"
    assert sandbox.isolation_policy() == "strict"  # loading a config sets nothing
    setup_sandbox(config)
    assert sandbox.isolation_policy() == "allow_weak"
    monkeypatch.setattr(levels, "_LEVEL", "rlimits")
    with pytest.raises(JmarlError, match="sandbox.isolation: allow_weak"):
        setup_sandbox(load_config("configs/quickstart.yaml"))  # plan_path's tool agent runs programs
    with pytest.raises(JmarlError, match="isolation"):
        load_config("configs/quickstart.yaml", ["sandbox.isolation=loose"])


def test_root_layout_never_binds_a_home_directory(guarded, monkeypatch):
    exe, prefix = filesystem.python_prefix()
    binds, _ = filesystem.root_layout(exe, prefix)
    assert any(prefix == b or prefix.startswith(b.rstrip("/") + "/") for b in binds)
    assert not any(b in ("/", "/home", "/root", "/etc", "/tmp") for b in binds)
    # An interpreter installed over the home directory (--prefix=$HOME): only the interpreter,
    # its standard library and its shared library are bound, and programs still run.
    monkeypatch.setenv("HOME", os.path.join(prefix, "home"))
    binds, _ = filesystem.root_layout(exe, prefix)
    assert prefix not in binds and exe in binds
    if LEVEL in ("namespaces", "userns"):
        r = guarded("import decimal, json\nprint(json.dumps(str(decimal.Decimal(1) / 4)))")
        assert r.status == "ok" and r.stdout == '"0.25"\n', r
