"""Training progress: a tqdm bar on a terminal, plain lines when stdout is a log file or a pipe.

    bar = ProgressBar(total=config.train.steps, initial=start_step, enabled=config.logging.progress)
    for step in ...:
        bar.update({"reward": mean_reward, "success": rate, "time/generate": 1.2, ...})
    bar.close()

Off a terminal (nohup, batch jobs, `> run.log`), one line is written when `every_s` seconds have
passed since the last (and at the last step):

    grpo on math: step 12/40 (30%) | 0:01:31 elapsed, ETA 0:03:32 | reward 0.412 success 0.375 | generate 4.1 s, env 0.2 s, update 2.9 s
"""

from __future__ import annotations

import datetime
import sys
import time
from collections import deque
from typing import IO, Any, Mapping

import numpy as np
from tqdm import tqdm

# the per-step time split a line shows (the step's own seconds, not running means)
TIME_SPLIT: tuple[str, ...] = ("time/generate", "time/env", "time/score", "time/update")
LINE_EVERY_S = 30.0


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(round(seconds))))


def say(text: str, *, enabled: bool = True, file: IO[str] | None = None) -> None:
    """One line of its own (an evaluation starting or ending) on stdout, above a running bar;
    nothing when disabled or on any process but process 0."""
    import jax

    if enabled and jax.process_index() == 0:
        tqdm.write(text, file=sys.stdout if file is None else file)
        (sys.stdout if file is None else file).flush()


class ProgressBar:
    """Steps done / total with ETA; running means of the chosen metrics and the last step's time
    split. A tqdm bar on a TTY, a line every `every_s` seconds elsewhere (`lines=False`: silent
    there). Draws nothing when disabled or on any process but process 0 of a multi-host run."""

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        enabled: bool = True,
        desc: str = "train",
        window: int = 10,
        keys: tuple[str, ...] = ("reward", "success"),
        file: IO[str] | None = None,
        lines: bool = True,
        every_s: float = LINE_EVERY_S,
    ):
        import jax

        stream = sys.stdout if file is None else file
        isatty = getattr(stream, "isatty", lambda: False)
        shown = bool(enabled and jax.process_index() == 0)
        self.active = shown and isatty()
        self.lines = shown and lines and not self.active
        self.keys, self.desc, self.total, self.every_s = keys, desc, total, every_s
        self.stream = stream
        self.n, self._initial = initial, initial
        self._start = self._last_line = time.monotonic()
        self._split: dict[str, float] = {}
        self._recent: dict[str, deque[float]] = {k: deque(maxlen=window) for k in keys}
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            file=stream,
            disable=not self.active,
            dynamic_ncols=True,
        )

    def running(self) -> dict[str, float]:
        """The running mean of each tracked metric over the last `window` updates."""
        return {k: float(np.mean(v)) for k, v in self._recent.items() if v}

    def update(self, metrics: Mapping[str, Any] | None = None, n: int = 1) -> None:
        """Advances by `n` steps and folds the tracked `metrics` into the running means; the
        `TIME_SPLIT` entries of `metrics` are the step's time split."""
        metrics = metrics or {}
        for key in self.keys:
            if key in metrics:
                self._recent[key].append(float(metrics[key]))
        self._split = {k: float(metrics[k]) for k in TIME_SPLIT if k in metrics}
        self.n += n
        if self.active:
            self._bar.set_postfix({k: f"{v:.3f}" for k, v in self.running().items()}, refresh=False)
        self._bar.update(n)
        now = time.monotonic()
        if self.lines and (now - self._last_line >= self.every_s or self.n >= self.total):
            self._last_line = now
            self.stream.write(self.line(now - self._start) + "\n")
            self.stream.flush()

    def line(self, elapsed: float) -> str:
        """The one-line report: step, percent, elapsed and ETA, running means, time split."""
        done = self.n - self._initial
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = _clock((self.total - self.n) / rate) if rate > 0 else "?"
        parts = [f"{self.desc}: step {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%)",
                 f"{_clock(elapsed)} elapsed, ETA {eta}"]
        if self.running():
            parts.append(" ".join(f"{k} {v:.3f}" for k, v in self.running().items()))
        if self._split:
            parts.append(", ".join(f"{k.removeprefix('time/')} {v:.1f} s" for k, v in self._split.items()))
        return " | ".join(parts)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
