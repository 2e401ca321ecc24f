"""Run metrics: one JSON line per step, TensorBoard scalars, PNG figures, summary.json.

Metric names use `/` to form families: `rollout/team_reward`, `train/loss`, `time/generate`...
The plots group families into a few figures (`FIGURES`): plots/evaluation.png (held-out
evaluation, the step-0 point being the model RL starts from), plots/rollout.png,
plots/components.png (the env's step-info values, `rollout/info/*` and `rollout/info_nonzero/*`),
plots/loss.png and plots/time.png (plots/other.png for any other family), one panel per metric
with its own axis. Only process 0 of a multi-host run writes anything.

    with MetricsLogger(run_dir, tensorboard=True, plots=True) as metrics:
        metrics.log(step, {"rollout/team_reward": 0.4, "train/loss": 1.2, "time/generate": 3.1})
    write_summary(run_dir, {"eval/success": 0.9})

Files under `output_dir`: metrics.jsonl, tensorboard/events.out.tfevents.*, plots/*.png,
summary.json. Non-finite numbers are written as the strings "nan", "inf", "-inf" (valid JSON);
`read_metrics` turns them back into floats.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import resource
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from jmarl.workflows.base import SampleRecord

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


def rollout_length_metrics(
    records: Sequence["SampleRecord"],
    policy_names: Sequence[str],
    max_new_tokens: int,
    eos_ids: Sequence[int | None] | None = None,
) -> dict[str, float]:
    """Completion lengths and truncation of one step's generations, all policies and per policy.

    records: a step's samples, of which only the generated ones count: those whose learner is
    their generator (`policy == source_policy`; a `shared`/HACPO cross sample is a re-tokenised
    copy of another policy's completion, counted once as its source's self sample). A sample's
    completion is its `completion.completion_tokens` (the sampled tokens, stop token included).

    A completion is truncated when it was cut at the generation budget: length >=
    `max_new_tokens` and its last token is not its policy's stop token `eos_ids[policy]` (the
    sampler stops a row on the tokenizer's eos_id or at max_new_tokens, and keeps the stop token
    in the completion; neither the static sampler nor the engine records a per-row "stopped"
    flag, so the last token is the evidence). A completion that emits eos as its
    `max_new_tokens`-th token is therefore not truncated. eos_ids None (or a None entry): the
    proxy length >= max_new_tokens alone, which also counts those.

    Returns (float values; lengths in tokens), for all generated samples:
    rollout/completion_length_mean, rollout/completion_length_p90 (numpy's default linear
    interpolation, `np.percentile(lengths, 90)`), rollout/completion_length_max,
    rollout/truncated_fraction; and with more than one policy the same four per policy p that
    generated samples this step, as rollout/<policy_names[p]>/<metric> (the
    `<family>/<policy name>/<metric>` convention of the trainer's train/<group>/ and
    evaluation's eval/<policy>/ keys). {} when there is no generated sample.
    """
    generated = [r for r in records if r.policy == r.source_policy]
    if not generated:
        return {}
    completions = [np.asarray(r.completion.completion_tokens).reshape(-1) for r in generated]
    policy = np.array([r.policy for r in generated], np.int64)
    lengths = np.array([c.size for c in completions], np.int64)
    truncated = lengths >= int(max_new_tokens)
    if eos_ids is not None:  # a completion that ends in its policy's stop token stopped, at any length
        last = np.array([int(c[-1]) if c.size else -1 for c in completions], np.int64)
        eos_of = np.full(max(len(eos_ids), int(policy.max(initial=0)) + 1), -2, np.int64)  # -2: no stop token
        eos_of[: len(eos_ids)] = [-2 if e is None else int(e) for e in eos_ids]
        truncated &= ~((lengths > 0) & (last == eos_of[policy]))
    keep = np.ones(len(generated), bool)

    def four(rows: np.ndarray) -> dict[str, float]:
        got = lengths[rows].astype(np.float64)
        return {
            "completion_length_mean": float(np.mean(got)),
            "completion_length_p90": float(np.percentile(got, 90)),
            "completion_length_max": float(np.max(got)),
            "truncated_fraction": float(np.mean(truncated[rows])),
        }

    out = {f"rollout/{k}": v for k, v in four(keep).items()}
    if len(policy_names) > 1:
        for pid, name in enumerate(policy_names):
            rows = keep & (policy == pid)
            if rows.any():
                out.update({f"rollout/{name}/{k}": v for k, v in four(rows).items()})
    return out


def memory_metrics(devices: Sequence[Any] = ()) -> dict[str, float]:
    """This process's peak memory so far, in GiB: "perf/host_peak_rss_gib", its largest resident
    set (on a CPU backend the arrays live there too), and where the backend reports it (GPU, TPU;
    a CPU device reports nothing) "perf/device_peak_gib", the largest `peak_bytes_in_use` over
    `devices`."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out = {"perf/host_peak_rss_gib": rss * (1 if sys.platform == "darwin" else 1024) / 2**30}
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    peaks = [p for p in peaks if p is not None]
    if peaks:
        out["perf/device_peak_gib"] = max(peaks) / 2**30
    return out


def signal_metrics(groups: Sequence[int], policies: Sequence[int], rewards: Sequence[float],
                   policy_names: Sequence[str]) -> dict[str, float]:
    """How much learning signal a step's samples carry, from its records' (group, policy, reward).

    A group whose rewards are all equal (all right, all wrong) has zero group-relative advantage
    under GRPO, Dr.GRPO, DAPO, GSPO and MAGRPO, so its samples move nothing. Returns
    rollout/groups (distinct group ids >= 0), rollout/signal_group_fraction (the share whose
    finite rewards are not all equal), rollout/signal_samples (the samples in those groups) and,
    per policy p, rollout/<policy_names[p]>/samples and .../signal_group_fraction (a group is
    counted for the policy of its first sample: plans keep a group within one policy).
    Args: groups, policies, rewards: one entry per sample, [N] each.
    """
    g = np.asarray(groups, np.int64)
    pol = np.asarray(policies, np.int64)
    r = np.asarray(rewards, np.float64)
    keep = g >= 0
    if not keep.any():
        return {}
    out: dict[str, float] = {}
    ids, first = np.unique(g[keep], return_index=True)
    finite = keep & np.isfinite(r)
    lo = np.full(ids.size, np.inf)
    hi = np.full(ids.size, -np.inf)
    at = np.searchsorted(ids, g[finite])
    np.minimum.at(lo, at, r[finite])
    np.maximum.at(hi, at, r[finite])
    varied = hi > lo
    group_policy = pol[keep][first]
    out["rollout/groups"] = float(ids.size)
    out["rollout/signal_group_fraction"] = float(np.mean(varied))
    out["rollout/signal_samples"] = float(np.isin(g, ids[varied]).sum())
    for p, name in enumerate(policy_names):
        out[f"rollout/{name}/samples"] = float(np.sum(keep & (pol == p)))
        mine = group_policy == p
        if mine.any():
            out[f"rollout/{name}/signal_group_fraction"] = float(np.mean(varied[mine]))
    return out


def family(name: str) -> str:
    """The plot family of a metric: the part before the first '/' (or the whole name)."""
    return name.split("/", 1)[0]


def _complete_lines(text: str) -> list[str]:
    """The non-empty lines of metrics.jsonl text that were written whole (a process killed
    mid-write leaves a last line without its newline)."""
    lines = text.split("\n")[:-1]  # the part after the last newline is partial or empty
    return [line for line in lines if line.strip()]


def rewind_metrics(output_dir: str | Path, records: int | None, step: int) -> int:
    """Rewrites <output_dir>/metrics.jsonl as it was when the checkpoint of `step` was saved, so
    that a resumed run logs the later steps once: its first `records` records (the count the
    checkpoint holds), or, when None (a checkpoint that does not hold it), the records of steps
    <= `step`. A partly written last line is dropped. Process 0 only; returns how many records
    were dropped (0 when the file is absent)."""
    path = Path(output_dir) / METRICS_FILE
    if not is_main_process() or not path.exists():
        return 0
    text = path.read_text(encoding="utf-8")
    lines = _complete_lines(text)
    if records is not None:
        kept = lines[: max(int(records), 0)]
    else:
        kept = [line for line in lines if int(json.loads(line)["step"]) <= step]
    dropped = len(lines) - len(kept)
    rewritten = "".join(line + "\n" for line in kept)
    if rewritten != text:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text(rewritten, encoding="utf-8")
        os.replace(tmp, path)
    return dropped


class MetricsLogger:
    """Writes per-step metrics to JSONL and TensorBoard, and the curves as PNGs on `close()`.

    Appends to an existing metrics.jsonl (a resumed run, after `rewind_metrics`); `records`
    counts the records in the file (those there at open, then each `log`), what a checkpoint
    stores so that a resume can rewind the file to it. `purge_step` (a resumed run: the first
    step it logs) hides the TensorBoard events of that step and later that the interrupted run
    wrote. The plots cover the whole file, the last record of a step winning.
    """

    def __init__(self, output_dir: str | Path, tensorboard: bool = True, plots: bool = True,
                 purge_step: int | None = None):
        self.output_dir = Path(output_dir)
        self.enabled = is_main_process()
        self.plots = plots
        self.records = 0
        self._writer = None
        self._file = None
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / METRICS_FILE
        if path.exists():
            self.records = len(_complete_lines(path.read_text(encoding="utf-8")))
        self._file = open(path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=str(self.output_dir / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records a flat dict of scalar metrics for `step`."""
        if not self.enabled:
            return
        values = {str(k): _scalar(str(k), v) for k, v in metrics.items()}
        record = {"step": int(step), **values}
        self._file.write(json.dumps(_encode(record), allow_nan=False) + "\n")
        self._file.flush()
        self.records += 1
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, int(step))

    def close(self) -> None:
        """Flushes everything and, if enabled, draws the figures under plots/ (`plot_metrics`)."""
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


# The figures under plots/: (file stem, title, metric families). A metric goes to the figure
# naming its family (the part before the first '/'); a name ending in "_per_s" is a throughput
# and goes to the time figure; a metric of any other family goes to other.png.
FIGURES = (
    ("evaluation", "held-out evaluation", ("eval",)),
    ("rollout", "rollouts and rewards", ("rollout", "reward", "plan")),
    ("components", "env step-info values per step (e.g. reward components) and the share non-zero", ()),
    ("loss", "loss, ratios and gradients", ("train", "loss", "kl")),
    ("time", "time, throughput, utilization and memory", ("time", "perf", "learner")),
)
OTHER_FIGURE = ("other", "other metrics")
_COLUMNS = 4  # panels per row at most
_PANEL = (3.4, 2.5)  # inches per panel (width, height)
_DPI = 100


def figure_of(name: str) -> str:
    """The file stem of the figure that draws metric `name` (see FIGURES)."""
    if name.endswith("_per_s"):
        return "time"
    if name.startswith(("rollout/info/", "rollout/info_nonzero/")):
        return "components"
    fam = family(name)
    for stem, _, families in FIGURES:
        if fam in families:
            return stem
    return OTHER_FIGURE[0]


def _unit(name: str) -> str:
    if name.endswith("_per_s"):
        return "tokens / s (log)"
    if family(name) == "time":
        return "seconds (log)"
    if name.endswith("success_rate"):
        return "% of episodes"
    if name.endswith("_fraction"):
        return "%"
    if "completion_length" in name:
        return "tokens"
    if name.endswith("_gib"):
        return "GiB"
    return ""


def _is_percent(name: str) -> bool:
    return name.endswith(("success_rate", "_fraction"))


def _format_value(name: str, value: float) -> str:
    return f"{100 * value:.1f}%" if _is_percent(name) else f"{value:.3g}"


_FIRST = ("time/step", "time/rollout", "time/generate", "time/score", "time/update")


def _rank(name: str) -> tuple[int, int, str]:
    """Panel order: success first, then rewards and losses, the step's time and its phases,
    the rest by name."""
    if name.endswith("success_rate"):
        return 0, 0, name
    if "team_reward" in name or "reward_mean" in name:
        return 1, 0, name
    if "reward" in name or name.endswith("loss"):
        return 2, 0, name
    if name in _FIRST:
        return 2, _FIRST.index(name), name
    return 3, 0, name


def _running(values: np.ndarray, window: int, robust: bool) -> np.ndarray:
    """Centred running mean (median when `robust`: times, whose first steps include compiling)
    over `window` steps, NaNs skipped; centred, so it does not lag behind a trend."""
    half = window // 2
    reduce = np.median if robust else np.mean
    out = np.full(len(values), np.nan)
    for i in range(len(values)):
        chunk = values[max(0, i - half) : i + half + 1]
        chunk = chunk[np.isfinite(chunk)]
        if len(chunk):
            out[i] = reduce(chunk)
    return out


def _constant(values: np.ndarray) -> bool:
    return len(values) > 1 and bool(np.all(np.isfinite(values))) and bool(np.all(values == values[0]))


def _draw_panel(ax: Any, name: str, steps: np.ndarray, values: np.ndarray, legend: bool) -> None:
    """One metric on its own axis. A per-step series: its values (thin) and, when long, their
    running median (thick). An evaluation series: markers, the step-0 point (the model RL starts
    from) hollow, and a dashed horizontal line at that baseline."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, PercentFormatter

    values = np.where(np.isfinite(values), values, np.nan)  # an inf would break the autoscale
    title, unit = name, _unit(name)
    if family(name) == "eval":
        ax.plot(steps, values, marker="o", markersize=4, color="C0", label="held-out")
        if len(steps) and steps[0] == 0 and np.isfinite(values[0]):
            base = values[0]
            ax.axhline(base, color="C1", linestyle="--", linewidth=1.2,
                       label=f"before RL (step 0): {_format_value(name, base)}")
            ax.plot([0], [base], marker="o", markersize=7, markerfacecolor="white", color="C1", linestyle="none")
            if len(steps) > 1 and np.isfinite(values[-1]):
                title += f": {_format_value(name, base)} -> {_format_value(name, values[-1])}"
        if legend:
            ax.legend(fontsize="x-small", loc="best")
    elif len(steps) >= 20:
        ax.plot(steps, values, color="C0", alpha=0.3, linewidth=0.8)
        smooth = _running(values, max(5, len(steps) // 10) | 1, robust=unit.endswith("(log)"))
        ax.plot(steps, smooth, color="C0", linewidth=1.8)
    else:
        ax.plot(steps, values, color="C0", marker=".")
    if unit.endswith("(log)") and np.nanmin(values, initial=np.inf) > 0:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
        if _is_percent(name):
            ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        if name.endswith("success_rate"):  # on a scale from 0: the size of a change reads true
            ax.set_ylim(0.0, min(1.02, max(ax.get_ylim()[1], 0.1)))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("RL step", fontsize="small")
    ax.set_ylabel(unit, fontsize="small")
    ax.tick_params(labelsize="small")
    ax.grid(alpha=0.3)


def metric_figures(records: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The figures of `records` (metrics.jsonl's), by file stem (FIGURES): one panel per metric
    with its own axis (titled with the metric's name). A per-step metric that never changed gets
    no panel: the figure's footer names it and its value. matplotlib Figures on an Agg canvas
    (no pyplot state: safe in notebooks and threads)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = metric_series(records)
    by_figure: dict[str, list[str]] = defaultdict(list)
    for name in sorted(series):
        by_figure[figure_of(name)].append(name)
    figures = {}
    for stem, title, *_ in (*FIGURES, OTHER_FIGURE):
        names = by_figure.get(stem, [])
        if not names:
            continue
        drawn = sorted((n for n in names if stem == "evaluation" or not _constant(series[n][1])), key=_rank)
        flat = [n for n in names if n not in drawn]
        cols = min(_COLUMNS, max(len(drawn), 1))
        rows = max(-(-len(drawn) // cols), 1)
        width = _PANEL[0] * cols
        footer_lines = []
        if flat:
            text = "constant over the run: " + "; ".join(f"{n} = {_format_value(n, series[n][1][0])}" for n in flat)
            footer_lines = textwrap.wrap(text, width=int(width * 15))
        footer = 0.2 * len(footer_lines) + (0.15 if footer_lines else 0.0)
        fig = Figure(figsize=(width, _PANEL[1] * rows + 0.5 + footer), layout="constrained")
        FigureCanvasAgg(fig)
        for i, name in enumerate(drawn):
            steps, values = series[name]
            _draw_panel(fig.add_subplot(rows, cols, i + 1), name, steps, values, legend=i == 0)
        if stem == "evaluation":
            title += "  (dashed: before RL, step 0)"
        elif any(len(series[n][0]) >= 20 for n in drawn):
            title += f"  (thin: each step; thick: running {'median' if stem == 'time' else 'mean'})"
        fig.suptitle(title, fontsize="large", fontweight="bold")
        if footer_lines:
            height = fig.get_figheight()
            fig.get_layout_engine().set(rect=(0, footer / height, 1, 1 - footer / height))
            fig.text(0.01, 0.05 / height, "\n".join(footer_lines), fontsize="small", color="0.35")
        figures[stem] = fig
    return figures


def plot_metrics(output_dir: str | Path) -> list[Path]:
    """Draws <output_dir>/metrics.jsonl as a few PNGs under <output_dir>/plots (`metric_figures`):
    evaluation.png, rollout.png, loss.png, time.png (other.png for any other family). Returns the
    paths written."""
    plot_dir = Path(output_dir) / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, fig in metric_figures(read_metrics(output_dir)).items():
        path = plot_dir / f"{stem}.png"
        fig.savefig(path, dpi=_DPI)
        written.append(path)
    return written


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
    if getattr(config.logging, "plots", False) and is_main_process():
        lines.append(f"  curves: open {Path(out) / 'plots' / 'evaluation.png'} (held-out success from step 0); "
                     "rollout.png, loss.png, time.png beside it")
    return "\n".join(lines)
