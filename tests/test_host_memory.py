"""The opt-in host memory policy of `jmarl.host_memory`: with JMARL_KEEP_HOST_MEMORY=1 a large
block freed and allocated again on a worker thread is the same memory (no page faults the second
time); by default the allocator is left alone."""

import ctypes
import os
import resource
import subprocess
import sys
import threading

import pytest

from jmarl import host_memory

BLOCK = 256 * 2**20  # far above glibc's largest mmap threshold (32 MiB)


def _faults_of_second_block() -> int:
    """Minor page faults while a worker thread fills a BLOCK-byte `posix_memalign` block (the
    call XLA's CPU runtime makes for a program's buffers), after it filled and freed a slightly
    larger one."""
    libc = host_memory._glibc()
    libc.free.argtypes = [ctypes.c_void_p]
    out = {}

    def block(size: int) -> ctypes.c_void_p:
        ptr = ctypes.c_void_p()
        assert libc.posix_memalign(ctypes.byref(ptr), ctypes.c_size_t(64), ctypes.c_size_t(size)) == 0
        ctypes.memset(ptr, 1, size)
        return ptr

    def work():
        # the first block is 1 MiB larger, so that the second fits in it wherever it lies
        libc.free(block(BLOCK + 2**20))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        second = block(BLOCK)
        out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        libc.free(second)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return out["faults"]


def _in_fresh_interpreter(keep: str | None) -> tuple[str, int]:
    """(policy, faults of the second block) in a new Python that imports jmarl first, as
    `python -m jmarl.run` does (in this pytest process other threads made their arenas earlier),
    with JMARL_KEEP_HOST_MEMORY set to `keep` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != host_memory.ENV_VAR}
    if keep is not None:
        env[host_memory.ENV_VAR] = keep
    code = ("import jmarl, tests.test_host_memory as t; from jmarl import host_memory as h; "
            "print(h.host_memory_policy(), t._faults_of_second_block())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, check=True)
    policy, faults = out.stdout.split()
    return policy, int(faults)


glibc_only = pytest.mark.skipif(host_memory._glibc() is None, reason="the policy is glibc's mallopt; this C library has none")


@glibc_only
def test_opted_in_freed_block_is_reused_without_page_faults():
    policy, faults = _in_fresh_interpreter("1")
    # a fresh mapping of BLOCK bytes faults in BLOCK / 4096 = 65536 pages
    assert policy == "kept" and faults < 1000


@glibc_only
def test_by_default_the_allocator_is_left_alone():
    """Without the variable the second block is a fresh mapping that faults in again."""
    policy, faults = _in_fresh_interpreter(None)
    assert policy == "default" and faults > BLOCK // 4096 // 2


def test_unknown_setting_warns_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv(host_memory.ENV_VAR, "maybe")
    with pytest.warns(RuntimeWarning, match="JMARL_KEEP_HOST_MEMORY='maybe' is not understood; set it to 1"):
        assert host_memory.requested() is False
    for value, expected in (("1", True), ("on", True), ("0", False), ("", False)):
        monkeypatch.setenv(host_memory.ENV_VAR, value)
        assert host_memory.requested() is expected
