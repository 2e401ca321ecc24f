"""Stepping many env branches at once: the plans' host loop for `env.step`.

Every plan applies the candidates of one turn (K completions of a node, G joint actions, the
answers of every policy) to their own copies of immutable states. `step_all(env, items)` steps
such a list of `(state, agent, text)` items and returns `(new state, StepResult)` per item, in
the order of the items, equal to stepping them one by one:

- an env with a `step_many(items)` method (e.g. `Code`, which batches its candidates' programs
  through the sandbox's `run_many`) gets the whole list in one call;
- otherwise the items are stepped on a thread pool of `workers` threads (1: serially in the
  calling thread). Envs are values with immutable states, so their steps share no mutable
  state; an env class may set `thread_safe = False` to be stepped serially. Threads help envs
  whose step waits outside the interpreter (subprocesses, I/O); a pure-Python step holds the
  GIL, and threads only add switching (measured: Sokoban steps 1.9 s serial, 2.9 s on threads
  in `benchmarks.host_loop`). So the first `PROBE_ITEMS` items are stepped in the calling thread and
  timed: when their thread CPU time is at least `WAITING_SHARE` of their wall time the rest are stepped
  serially too, else on the threads. Either way the results are the same.
- a failing step re-raises its own exception with a note naming the env, the agent and the item.

Multi-host runs. With `jax.process_count() > 1` every host steps only its share of the items
(`process_share`: a contiguous, balanced slice by `jax.process_index()`; the items of a call
are ordered by episode, so the share is a share of the episodes), then the hosts exchange their
results (`gather_objects`: pickled, through `multihost_utils.process_allgather`) so that every
host sees the whole batch; a step that fails on one host is raised on every host (none is left
waiting in the collective). Every host of a run plays the same plan over the same sampled
completions, so every host makes the same `step_all` calls in the same order.

Settings and timing come from the surrounding `host_loop(workers=..., clock=...)` context (the
trainer wraps `plan.run` in one): `workers` defaults to `default_workers()`; a `StepClock`
accumulates the seconds spent stepping envs (`time/env`).

`numeric_info(info)` keeps the numeric entries of a step's info (e.g. reward components), which
every plan stores on its records as `env_info`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np

from jmarl.errors import JmarlError

# (state, agent name, completion text)
StepItem = tuple[Any, str, str]
# a step whose thread CPU time is at least this share of its wall time is taken as computing
# (GIL-bound): such an env is stepped serially whatever `workers` says
WAITING_SHARE = 0.5
PROBE_ITEMS = 4  # items stepped (and timed) in the calling thread before choosing


def default_workers() -> int:
    """The default thread count of `step_all`: min(8, CPU count)."""
    return max(1, min(8, os.cpu_count() or 1))


@dataclass
class StepClock:
    """Seconds spent in `step_all` (and how many calls and items), accumulated thread-safely."""

    seconds: float = 0.0
    calls: int = 0
    items: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float, items: int) -> None:
        with self._lock:
            self.seconds += seconds
            self.calls += 1
            self.items += items


_WORKERS: contextvars.ContextVar[int | None] = contextvars.ContextVar("jmarl_env_workers", default=None)
_CLOCK: contextvars.ContextVar[StepClock | None] = contextvars.ContextVar("jmarl_step_clock", default=None)


@contextlib.contextmanager
def host_loop(workers: int | None = None, clock: StepClock | None = None) -> Iterator[StepClock]:
    """Within the block, `step_all` uses `workers` threads (None: `default_workers()`) and adds
    its time to `clock` (a new `StepClock` when None), which the block receives."""
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise JmarlError(f"workflow.env_workers must be an int >= 1, got {workers!r}")
    clock = StepClock() if clock is None else clock
    tokens = (_WORKERS.set(workers), _CLOCK.set(clock))
    try:
        yield clock
    finally:
        _CLOCK.reset(tokens[1])
        _WORKERS.reset(tokens[0])


def process_share(n: int, index: int | None = None, count: int | None = None) -> slice:
    """The contiguous slice of `n` items that host `index` of `count` steps (default: this
    process of `jax.process_count()`); the slices of hosts 0..count-1 partition range(n) in
    order, their sizes differing by at most one."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    if not 0 <= index < count:
        raise JmarlError(f"process index {index} is outside 0..{count - 1}")
    base, extra = divmod(n, count)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))


def _allgather_bytes(payload: bytes) -> list[bytes]:
    """Every host's `payload`, in process order (a collective: all hosts must call it)."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(payload, np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [rows[i, : int(sizes[i])].tobytes() for i in range(len(sizes))]


def gather_objects(local: Any) -> list[Any]:
    """Every host's `local` value (picklable), in process order, exchanged over the hosts'
    collective (every host must call it); `[local]` with one process."""
    if jax.process_count() == 1:
        return [local]
    return [pickle.loads(p) for p in _allgather_bytes(pickle.dumps(local, protocol=pickle.HIGHEST_PROTOCOL))]


def _picklable(err: Exception) -> Exception:
    """`err` if it survives pickling, else a JmarlError carrying its type, message and notes."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any pickling failure
        notes = " ".join(getattr(err, "__notes__", []))
        return JmarlError(f"{type(err).__name__}: {err} {notes}".strip())


def _env_name(env: Any) -> str:
    return str(getattr(env, "name", type(env).__name__))


def _step_one(env: Any, index: int, item: StepItem) -> tuple[Any, Any]:
    state, agent, text = item
    try:
        return env.step(state, agent, text)
    except Exception as err:
        err.add_note(f"while stepping env {_env_name(env)!r} (agent {agent!r}, item {index})")
        raise


def _step_local(env: Any, items: Sequence[StepItem], offset: int, workers: int) -> list[tuple[Any, Any]]:
    """Steps `items` on this host (their global indices start at `offset`)."""
    if not items:
        return []
    step_many = getattr(env, "step_many", None)
    if step_many is not None:
        try:
            out = list(step_many(list(items)))
        except Exception as err:
            err.add_note(f"while stepping env {_env_name(env)!r} ({len(items)} items via step_many)")
            raise
        if len(out) != len(items):
            raise JmarlError(f"env {_env_name(env)!r}: step_many returned {len(out)} results for {len(items)} items")
        return out
    if workers <= 1 or len(items) == 1 or not getattr(env, "thread_safe", True):
        return [_step_one(env, offset + i, item) for i, item in enumerate(items)]
    # the first items, stepped here, tell whether threads can help: a step that spends its time
    # computing in Python holds the GIL (threads would only add switching), one that waits
    # (a subprocess, I/O) does not
    probe = min(PROBE_ITEMS, len(items))
    wall, cpu = time.perf_counter(), time.thread_time()
    first = [_step_one(env, offset + i, items[i]) for i in range(probe)]
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    if probe == len(items):
        return first
    if cpu >= WAITING_SHARE * wall:
        return first + [_step_one(env, offset + i, items[i]) for i in range(probe, len(items))]
    return first + _step_threads(env, items, offset, workers, start=probe)


def _step_threads(env: Any, items: Sequence[StepItem], offset: int, workers: int, start: int) -> list[tuple[Any, Any]]:
    """Steps items[start:] on `workers` threads."""
    items = items[start:]
    offset += start
    # contiguous chunks (a few per thread, for balance), each stepped serially by one thread:
    # one future per chunk rather than per item keeps the pool's overhead off cheap steps
    num_chunks = min(len(items), 4 * workers)
    bounds = np.linspace(0, len(items), num_chunks + 1).astype(int)

    def run_chunk(lo: int, hi: int) -> list[tuple[Any, Any]]:
        return [_step_one(env, offset + i, items[i]) for i in range(lo, hi)]

    with ThreadPoolExecutor(max_workers=min(workers, num_chunks)) as pool:
        futures = [pool.submit(run_chunk, int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
        return [result for f in futures for result in f.result()]


def step_all(env: Any, items: Sequence[StepItem], *, workers: int | None = None) -> list[tuple[Any, Any]]:
    """`[env.step(state, agent, text) for state, agent, text in items]`, stepped concurrently
    (module docstring): `workers` threads (None: the `host_loop` setting, else
    `default_workers()`), each host of a multi-host run stepping its share."""
    t0 = time.perf_counter()
    if workers is None:
        workers = _WORKERS.get()
    if workers is None:
        workers = default_workers()
    items = list(items)
    count = jax.process_count()
    if count > 1:
        share = process_share(len(items), jax.process_index(), count)
        try:
            local: tuple[str, Any] = ("ok", _step_local(env, items[share], share.start, workers))
        except Exception as err:  # sent to every host, so that none waits in the collective
            local = ("error", _picklable(err))
        parts = gather_objects(local)
        for host, (kind, value) in enumerate(parts):
            if kind == "error":
                value.add_note(f"(raised on host {host} of {count})")
                raise value
        out = [result for _, results in parts for result in results]
        if len(out) != len(items):
            raise JmarlError(f"gathered {len(out)} env steps from {count} hosts for {len(items)} items")
    else:
        out = _step_local(env, items, 0, workers)
    clock = _CLOCK.get()
    if clock is not None:
        clock.add(time.perf_counter() - t0, len(items))
    return out


def numeric_info(info: Any) -> dict[str, float]:
    """The numeric entries of an env step's `info` (e.g. Writing's reward components), as floats;
    strings, flags and nested values are left out."""
    if not isinstance(info, Mapping):
        return {}
    return {
        str(k): float(v)
        for k, v in info.items()
        if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    }
