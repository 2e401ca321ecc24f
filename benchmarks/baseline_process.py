"""The PyTorch side of a paired benchmark, in a process of its own, as its users run it.

jmarl's host memory policy (`jmarl.host_memory`: glibc keeps freed memory in the heap) is
process-wide. With both sides of a comparison in one process, PyTorch ran under it too, which is
not how transformers, TRL or CoMLRL users run (docs/benchmarks.md: out-of-the-box baselines), and two
runtimes' thread pools and heaps shared one process. `BaselineProcess` starts
`python -m benchmarks.baseline_process` with `JMARL_KEEP_HOST_MEMORY=0` (glibc's defaults;
`host_memory="jmarl"` gives it jmarl's policy instead, to see what the policy does for PyTorch),
builds the baseline there with a setup function named `"module:function"` whose keyword arguments
are JSON values (paths, numbers), and runs it one repeat at a time when asked. The pairing stays
A B A B in time: while one side runs, the other process waits on a pipe.

A setup function returns `run(i) -> seconds`, or a `SelfDriven` for a baseline whose library
runs its own loop (TRL's `Trainer.train`): its `serve(channel)` answers each run request from
inside that loop (`channel.next_run()` before a step, `channel.reply(seconds)` after it).

Protocol, one JSON object per line over the child's stdin/stdout (the child moves its own stdout
to stderr first, so library prints cannot corrupt it): parent -> child `{"setup": ..., "kwargs":
...}`, then `{"run": i}` per repeat and `{"close": true}`; child -> parent `{"ready": {...}}`,
`{"seconds": s}` per run, or `{"error": "..."}` (after which it exits).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from typing import IO, Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_MEMORY_SETTINGS = {"default": "0", "jmarl": "1"}  # -> JMARL_KEEP_HOST_MEMORY of the child


class BaselineError(RuntimeError):
    """The baseline process failed: its setup or a run raised, or the process died."""


class Channel:
    """The child's end of the pipe: run requests in, seconds out."""

    def __init__(self, requests: IO[str], replies: IO[str]):
        self._requests, self._replies = requests, replies

    def send(self, **message: Any) -> None:
        self._replies.write(json.dumps(message) + "\n")
        self._replies.flush()

    def next_run(self) -> int | None:
        """The index of the next requested run, or None when the parent closes."""
        line = self._requests.readline()
        if not line:
            return None
        return json.loads(line).get("run")

    def reply(self, seconds: float) -> None:
        self.send(seconds=seconds)


@dataclass(frozen=True)
class SelfDriven:
    """A baseline that runs its own loop; `serve(channel)` answers run requests from inside it
    and returns when the loop ends."""

    serve: Callable[[Channel], None]


def resolve(name: str) -> Callable[..., Any]:
    """The function `"module:function"` names."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"setup {name!r} is not 'module:function'")
    return getattr(importlib.import_module(module), attr)


def serve_requests(run: Callable[[int], float], channel: Channel) -> None:
    """Answers run requests with `run(i)` until the parent closes."""
    while (i := channel.next_run()) is not None:
        channel.reply(run(i))


def child_main() -> int:
    """The baseline process: setup, ready, then runs on request (module docstring)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what libraries print goes to stderr, not into the protocol
    channel = Channel(sys.stdin, replies)
    try:
        from jmarl.host_memory import apply_on_cpu, host_memory_policy

        apply_on_cpu()  # jmarl's policy on CPU unless the parent set JMARL_KEEP_HOST_MEMORY=0 (out of the box)
        spec = json.loads(sys.stdin.readline())
        baseline = resolve(spec["setup"])(**spec["kwargs"])
        channel.send(ready={"host_memory_policy": host_memory_policy(), "pid": os.getpid()})
        if isinstance(baseline, SelfDriven):
            baseline.serve(channel)
            if channel.next_run() is not None:  # asked for more runs than its loop had
                raise BaselineError(f"{spec['setup']} ran out of steps")
        else:
            serve_requests(baseline, channel)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent as a message
        traceback.print_exc()
        channel.send(error=f"{type(e).__name__}: {e}"[:2000])
        return 1
    return 0


class BaselineProcess:
    """Parent's handle on a baseline process; use as a context manager.

    `BaselineProcess("benchmarks.generation:hf_generate_runner", checkpoint=d, ...)` starts the
    child, waits until its setup is done (`info`: the child's host memory policy and pid), and
    `run(i)` returns the seconds of one run there. Raises `BaselineError` with the child's message
    if the setup or a run fails or the child dies."""

    def __init__(self, setup: str, *, host_memory: str = "default", **kwargs: Any):
        if host_memory not in HOST_MEMORY_SETTINGS:
            raise ValueError(f"host_memory={host_memory!r}; choose from {sorted(HOST_MEMORY_SETTINGS)}")
        self.setup = setup
        env = dict(os.environ, JMARL_KEEP_HOST_MEMORY=HOST_MEMORY_SETTINGS[host_memory])
        self._proc = subprocess.Popen([sys.executable, "-m", "benchmarks.baseline_process"], cwd=REPO_ROOT, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._send(setup=setup, kwargs=kwargs)
        self.info: dict[str, Any] = self._receive("ready")

    def _send(self, **message: Any) -> None:
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # the child is gone; _receive reports how it ended

    def _receive(self, key: str) -> Any:
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            raise BaselineError(f"baseline process of {self.setup} exited with code {code} (its log is above)")
        message = json.loads(line)
        if "error" in message:
            self._proc.wait()
            raise BaselineError(f"baseline process of {self.setup}: {message['error']}")
        return message[key]

    def run(self, i: int) -> float:
        """Seconds of run `i` in the child."""
        self._send(run=i)
        return float(self._receive("seconds"))

    def close(self) -> None:
        """Asks the child to finish and waits for it (kills it after 60 s)."""
        if self._proc.poll() is None:
            self._send(close=True)
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> "BaselineProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__":
    # run the package's module, not this `__main__` copy, so that setups' `SelfDriven` is the same class
    from benchmarks.baseline_process import child_main as _child_main

    sys.exit(_child_main())
