"""Run metrics: one JSON line per step, TensorBoard scalars, PNG curves, summary.json.

Metric names use `/` to form families: `reward/tool`, `reward/planner`, `loss/policy`,
`time/generate`... Each family becomes one figure with one curve per member; a name without
`/` is a family of its own. Only process 0 of a multi-host run writes anything.

    with MetricsLogger(run_dir, tensorboard=True, plots=True) as metrics:
        metrics.log(step, {"reward/tool": 0.4, "loss/policy": 1.2, "time/generate": 3.1})
    write_summary(run_dir, {"eval/success": 0.9})

Files under `output_dir`: metrics.jsonl, tensorboard/events.out.tfevents.*, plots/<family>.png,
summary.json. Non-finite numbers are written as the strings "nan", "inf", "-inf" (valid JSON);
`read_metrics` turns them back into floats.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping

import numpy as np

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def is_main_process() -> bool:
    """True on the process that writes files (process 0; the only one without multi-host)."""
    import jax

    return jax.process_index() == 0


def _scalar(key: str, value: Any) -> int | float:
    """A metric value as a Python int/float (accepts numpy and 0-d JAX arrays)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    arr = np.asarray(value)
    if arr.shape != () or arr.dtype.kind not in "biuf":
        raise TypeError(f"metric {key!r} must be a scalar number, got {type(value).__name__} {arr.shape}")
    return arr.item() if arr.dtype.kind in "biu" else float(arr)


def _encode(value: Any) -> Any:
    """JSON-safe: non-finite floats become strings, containers are walked."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, np.generic):
        return _encode(value.item())
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    return value


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of <output_dir>/metrics.jsonl, non-finite values decoded ([] if absent)."""
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            records.append({k: _decode(v) for k, v in json.loads(line).items()})
    return records


def write_summary(output_dir: str | Path, summary: Mapping[str, Any]) -> Path | None:
    """Writes <output_dir>/summary.json atomically (process 0 only); returns its path."""
    if not is_main_process():
        return None
    path = Path(output_dir) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_encode(dict(summary)), indent=2, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def family(name: str) -> str:
    """The plot family of a metric: the part before the first '/' (or the whole name)."""
    return name.split("/", 1)[0]


class MetricsLogger:
    """Writes per-step metrics to JSONL and TensorBoard, and the curves as PNGs on `close()`.

    Appends to an existing metrics.jsonl (a resumed run); the plots cover the whole file, the
    last record of a step winning when a resumed run logged it again.
    """

    def __init__(self, output_dir: str | Path, tensorboard: bool = True, plots: bool = True):
        self.output_dir = Path(output_dir)
        self.enabled = is_main_process()
        self.plots = plots
        self._writer = None
        self._file = None
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.output_dir / METRICS_FILE, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=str(self.output_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records a flat dict of scalar metrics for `step`."""
        if not self.enabled:
            return
        values = {str(k): _scalar(str(k), v) for k, v in metrics.items()}
        record = {"step": int(step), **values}
        self._file.write(json.dumps(_encode(record), allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, int(step))

    def close(self) -> None:
        """Flushes everything and, if enabled, draws plots/<family>.png for every family."""
        if not self.enabled or self._file is None:
            return
        self._file.close()
        self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.plots:
            plot_metrics(self.output_dir)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def metric_series(records: list[Mapping[str, Any]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Metric name -> (steps int[S], values f64[S]) sorted by step, last record per step wins."""
    by_name: dict[str, dict[int, float]] = defaultdict(dict)
    for record in records:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                by_name[key][step] = float(value)
    out = {}
    for key, points in by_name.items():
        steps = np.array(sorted(points), dtype=np.int64)
        out[key] = (steps, np.array([points[s] for s in steps], dtype=np.float64))
    return out


def plot_metrics(output_dir: str | Path) -> list[Path]:
    """Draws one PNG per metric family from <output_dir>/metrics.jsonl into <output_dir>/plots."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = metric_series(read_metrics(output_dir))
    families: dict[str, list[str]] = defaultdict(list)
    for name in sorted(series):
        families[family(name)].append(name)
    plot_dir = Path(output_dir) / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fam, names in families.items():
        fig = Figure(figsize=(6.4, 4.0))  # Agg canvas, no pyplot state: safe in notebooks too
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for name in names:
            steps, values = series[name]
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=name)
        ax.set_xlabel("step")
        ax.set_title(fam)
        ax.grid(alpha=0.3)
        if len(names) > 1 or names[0] != fam:
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = plot_dir / f"{_safe_name(fam)}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "metric"


def before_summary(metrics: dict[str, float]) -> dict[str, float]:
    """The held-out evaluation before RL (after any warm start) as summary.json fields:
    eval/<metric> -> before_eval_<metric> (eval/info/<key> -> before_eval_info/<key>)."""
    return {k.replace("eval/", "before_eval_", 1): float(v) for k, v in metrics.items() if k.startswith("eval/")}


def results_table(summary: dict[str, Any], config: Any, out: Path) -> str:
    """The before/after table printed at the end of a run (held-out greedy success)."""
    before, after = float(summary["success_before"]), float(summary["success_after"])
    start = "after warm start" if config.train.warm_start.steps > 0 else "initial model"
    rows = [
        (start, f"{100 * before:5.1f}%"),
        (f"after {summary['steps']} {config.algo.name} steps", f"{100 * after:5.1f}%"),
        ("change", f"{100 * (after - before):+5.1f} points"),
    ]
    width = max(len(r[0]) for r in rows)
    title = f"held-out success on {config.env.name} ({config.eval.num_episodes} episodes, "
    title += "greedy)" if config.eval.greedy else "sampled)"
    lines = [title] + [f"  {name:<{width}}  {value}" for name, value in rows]
    lines.append(f"  wall time {summary.get('wall_seconds', 0.0):.0f} s; outputs in {out}: summary.json, "
                 "metrics.jsonl, plots/, checkpoints/, export/")
    return "\n".join(lines)
