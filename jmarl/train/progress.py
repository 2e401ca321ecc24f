"""A training progress bar (tqdm) with ETA and a running reward; silent when not on a terminal.

    bar = ProgressBar(total=config.train.steps, initial=start_step, enabled=config.logging.progress)
    for step in ...:
        bar.update({"reward": mean_reward, "success": rate})
    bar.close()
"""

from __future__ import annotations

import sys
from collections import deque
from typing import IO, Any, Mapping

import numpy as np
from tqdm import tqdm


class ProgressBar:
    """Steps done / total with ETA; the postfix shows running means of the chosen metrics.

    Quiet (draws nothing) when disabled, when `file` (default stdout) is not a TTY, or on any
    process but process 0 of a multi-host run.
    """

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
    ):
        import jax

        stream = sys.stdout if file is None else file
        isatty = getattr(stream, "isatty", lambda: False)
        self.active = bool(enabled and isatty() and jax.process_index() == 0)
        self.keys = keys
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
        """Advances by `n` steps and folds the tracked `metrics` into the running means."""
        for key in self.keys:
            if metrics and key in metrics:
                self._recent[key].append(float(metrics[key]))
        if self.active:
            self._bar.set_postfix({k: f"{v:.3f}" for k, v in self.running().items()}, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
