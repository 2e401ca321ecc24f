"""Metrics: JSONL (non-finite safe), TensorBoard events read back, PNG figures (one panel per
metric, the step-0 evaluation baseline), summary, progress."""

import io
import json
import math
import struct
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tensorboard import tensorboard_events, tensorboard_points
from jmarl.train.metrics import (MetricsLogger, figure_of, memory_metrics, metric_figures, metric_series,
                                 read_metrics, rewind_metrics, write_summary)
from jmarl.train.progress import ProgressBar

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _strict_json(text: str):
    """json.loads that rejects the non-standard NaN/Infinity tokens."""

    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=reject)


def read_tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of the event files under `logdir`."""
    out: dict[str, dict[int, float]] = {}
    for event in tensorboard_events(logdir):
        for value in event.summary.value:
            out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


STEPS = [
    {"reward/tool": 0.25, "reward/planner": 1, "loss/policy": np.float32(1.5), "kl": jnp.asarray(0.01),
     "time/generate": 2.0, "time/update": 1.0, "solved": True},
    {"reward/tool": 0.5, "reward/planner": 0.75, "loss/policy": float("nan"), "kl": float("inf"),
     "time/generate": 2.5, "time/update": 1.5, "solved": False},
    {"reward/tool": 1.0, "reward/planner": 0.5, "loss/policy": 0.5, "kl": -math.inf,
     "time/generate": 2.25, "time/update": 1.25, "solved": True},
]


def test_logger_writes_jsonl_tensorboard_and_plots(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=True, plots=True) as logger:
        for step, values in enumerate(STEPS):
            logger.log(step, values)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    records = [_strict_json(line) for line in lines]  # valid standard JSON despite nan/inf
    assert records[1]["loss/policy"] == "nan" and records[1]["kl"] == "inf" and records[2]["kl"] == "-inf"
    assert records[0] == {"step": 0, "reward/tool": 0.25, "reward/planner": 1, "loss/policy": 1.5,
                          "kl": pytest.approx(0.01), "time/generate": 2.0, "time/update": 1.0, "solved": 1}
    decoded = read_metrics(tmp_path)
    assert math.isnan(decoded[1]["loss/policy"])
    assert decoded[1]["kl"] == math.inf and decoded[2]["kl"] == -math.inf

    scalars = read_tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["reward/tool"] == {0: 0.25, 1: 0.5, 2: 1.0}
    assert scalars["time/update"] == {0: 1.0, 1: 1.5, 2: 1.25}
    assert math.isnan(scalars["loss/policy"][1])

    # families grouped into figures: reward -> rollout, loss and kl -> loss, time, the rest -> other
    pngs = {p.name for p in (tmp_path / "plots").glob("*.png")}
    assert pngs == {"rollout.png", "loss.png", "time.png", "other.png"}
    for name in pngs:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        width, height = struct.unpack(">II", data[16:24])
        assert 300 <= width <= 1400 and 250 <= height <= 1200, (name, width, height)
    # two panels side by side (reward/planner, reward/tool): twice one panel's width
    rollout = struct.unpack(">II", (tmp_path / "plots" / "rollout.png").read_bytes()[16:24])
    other = struct.unpack(">II", (tmp_path / "plots" / "other.png").read_bytes()[16:24])
    assert rollout[0] == 2 * other[0] and rollout[1] == other[1]


def _panels(fig) -> dict[str, object]:
    """The axes of a figure by title (the metric's name, before any ': before -> after')."""
    return {ax.get_title().split(":")[0]: ax for ax in fig.axes}


def test_one_panel_per_metric_grouped_into_figures():
    records = []
    for step in range(1, 31):
        records.append({"step": step, "rollout/success_rate": (step % 4) / 4, "rollout/team_reward": step / 30,
                        "rollout/generated": 300.0 + step, "rollout/nonfinite_rewards": 0.0,
                        "train/loss": 1.0 / step, "train/grad_norm": 0.5 + step / 100, "train/clip_fraction": 0.0,
                        "time/step": 10.0 if step == 1 else 0.5, "perf/train_tokens_per_s": 4e4 + step,
                        "hacpo/success_0": step / 60})
    assert figure_of("rollout/new_tokens_per_s") == "time" and figure_of("eval/info/moves") == "evaluation"
    assert figure_of("rollout/info/moves") == figure_of("rollout/info_nonzero/moves") == "components"
    figures = metric_figures(records)
    assert set(figures) == {"rollout", "loss", "time", "other"}
    rollout, loss, time, other = (_panels(figures[k]) for k in ("rollout", "loss", "time", "other"))
    # one axis per metric that moved; success first; a constant metric is named in the footer instead
    assert list(rollout) == ["rollout/success_rate", "rollout/team_reward", "rollout/generated"]
    assert len(figures["rollout"].axes) == 3
    assert set(loss) == {"train/loss", "train/grad_norm"}
    footer = " ".join(t.get_text() for t in figures["loss"].texts)
    assert "train/clip_fraction = 0.0%" in footer
    assert "rollout/nonfinite_rewards = 0" in " ".join(t.get_text() for t in figures["rollout"].texts)
    assert set(time) == {"time/step", "perf/train_tokens_per_s"} and set(other) == {"hacpo/success_0"}
    # its own axis: the success rate in percent, times on a log scale with the compile step kept
    assert rollout["rollout/success_rate"].yaxis.get_major_formatter()(0.5, 0) == "50%"
    assert time["time/step"].get_yscale() == "log" and time["time/step"].get_ylim()[1] >= 10.0
    assert rollout["rollout/generated"].get_ylim()[0] > 250  # not shared with the 0..1 rates
    # each per-step panel: the raw values and a smoothed line over every step
    for ax in rollout.values():
        raw, smooth = ax.get_lines()
        assert len(raw.get_xdata()) == len(smooth.get_xdata()) == 30
        assert ax.get_xlabel() == "RL step"
    # no overlapping labels: panels sit on a grid, none overlapping another
    boxes = [ax.get_position() for ax in figures["rollout"].axes]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0


def test_evaluation_figure_starts_at_the_step_0_baseline(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, plots=True) as logger:
        logger.log(0, {"eval/success_rate": 0.25, "eval/team_reward": 0.5})  # before RL (the trainer's step 0)
        for step in range(1, 5):
            logger.log(step, {"rollout/team_reward": step / 4})
        logger.log(2, {"rollout/team_reward": 0.5, "eval/success_rate": 0.5, "eval/team_reward": 0.75})
        logger.log(4, {"eval/success_rate": 0.75, "eval/team_reward": 1.0})
    assert (tmp_path / "plots" / "evaluation.png").read_bytes()[:8] == PNG_MAGIC
    figures = metric_figures(read_metrics(tmp_path))
    evaluation = figures["evaluation"]
    assert [ax.get_title() for ax in evaluation.axes] == [
        "eval/success_rate: 25.0% -> 75.0%", "eval/team_reward: 0.5 -> 1"]
    success = evaluation.axes[0]
    curve, baseline, start = success.get_lines()
    assert list(curve.get_xdata()) == [0, 2, 4] and list(curve.get_ydata()) == [0.25, 0.5, 0.75]
    assert baseline.get_linestyle() == "--" and list(baseline.get_ydata()) == [0.25, 0.25]
    assert list(start.get_xdata()) == [0] and list(start.get_ydata()) == [0.25]
    assert success.get_ylim()[0] == 0.0  # success on a scale from 0
    labels = [t.get_text() for t in success.get_legend().get_texts()]
    assert labels == ["held-out", "before RL (step 0): 25.0%"]
    # an evaluation without a step-0 record (an older run's file) has no baseline
    later = metric_figures([{"step": 5, "eval/success_rate": 0.5}, {"step": 10, "eval/success_rate": 0.6}])
    assert len(later["evaluation"].axes[0].get_lines()) == 1


def test_resumed_run_appends_and_last_record_per_step_wins(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, plots=False) as logger:
        for step in range(4):
            logger.log(step, {"reward/mean": float(step)})
    # Resumed from the checkpoint at step 2: steps 2 and 3 are logged again with new values.
    with MetricsLogger(tmp_path, tensorboard=False, plots=True) as logger:
        for step in range(2, 5):
            logger.log(step, {"reward/mean": 10.0 + step})
    assert len(read_metrics(tmp_path)) == 7
    steps, values = metric_series(read_metrics(tmp_path))["reward/mean"]
    assert steps.tolist() == [0, 1, 2, 3, 4]
    assert values.tolist() == [0.0, 1.0, 12.0, 13.0, 14.0]
    assert (tmp_path / "plots" / "rollout.png").exists()
    assert not (tmp_path / "tensorboard").exists()


def test_rewound_then_resumed_log_holds_each_step_once_in_jsonl_and_tensorboard(tmp_path):
    """A run checkpointed after step 2 (3 records: steps 0..2) logs step 3 and dies mid-line; the
    resumed run rewinds metrics.jsonl to the checkpoint's 3 records and hides the dead run's
    TensorBoard points from step 3 on (purge_step), so both hold steps 0..4 once."""
    with MetricsLogger(tmp_path, tensorboard=True, plots=False) as logger:
        for step in range(4):
            logger.log(step, {"reward/mean": float(step)})
        assert logger.records == 4
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # killed mid-write
    assert rewind_metrics(tmp_path, 3, 2) == 1
    time.sleep(1.05)  # tensorboardX names event files by the second: the resumed run's comes later
    with MetricsLogger(tmp_path, tensorboard=True, plots=False, purge_step=3) as logger:
        assert logger.records == 3
        for step in (3, 4):
            logger.log(step, {"reward/mean": 10.0 + step})
        assert logger.records == 5
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    assert tensorboard_points(tmp_path / "tensorboard")["reward/mean"] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


def test_rewind_without_a_record_count_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    """A checkpoint that holds no record count: the records of steps <= its step are kept (a
    partial last line dropped); a file already rewound, or absent, is left as it is."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "x": s}) for s in (0, 1, 2, 2, 3)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 4, "x"')
    assert rewind_metrics(tmp_path, None, 2) == 1  # the step-3 record (a partial line is no record)
    assert path.read_text() == "\n".join(lines[:4]) + "\n"
    assert rewind_metrics(tmp_path, None, 2) == 0 and path.read_text() == "\n".join(lines[:4]) + "\n"
    assert rewind_metrics(tmp_path, 10, 7) == 0  # a count beyond the file keeps it whole
    assert rewind_metrics(tmp_path / "absent", 1, 0) == 0 and not (tmp_path / "absent").exists()


def test_metric_must_be_a_scalar(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, plots=False) as logger:
        with pytest.raises(TypeError, match="'reward' must be a scalar"):
            logger.log(0, {"reward": np.ones(3)})
        with pytest.raises(TypeError, match="'name' must be a scalar"):
            logger.log(0, {"name": "tool"})


def test_summary_is_standard_json(tmp_path):
    summary = {"eval/success": 0.75, "loss": float("nan"), "per_agent": {"tool": 1}}
    path = write_summary(tmp_path / "run", summary)
    assert path == tmp_path / "run" / "summary.json"
    assert _strict_json(path.read_text()) == {"eval/success": 0.75, "loss": "nan", "per_agent": {"tool": 1}}


def test_only_process_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with MetricsLogger(tmp_path / "run") as logger:
        logger.log(0, {"reward": 1.0})
    assert write_summary(tmp_path / "run", {"a": 1}) is None
    assert not (tmp_path / "run").exists()
    tty = _FakeTTY()
    with ProgressBar(3, file=tty) as bar:
        bar.update({"reward": 1.0})
    assert tty.getvalue() == ""


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_shows_eta_and_running_reward_on_a_tty():
    tty = _FakeTTY()
    with ProgressBar(10, initial=2, window=2, file=tty) as bar:
        for reward in (0.0, 1.0, 0.5):
            bar.update({"reward": reward, "success": 1.0})
        assert bar.running() == {"reward": 0.75, "success": 1.0}  # mean of the last 2 rewards
    text = tty.getvalue()
    assert "5/10" in text
    assert "reward=0.750" in text and "success=1.000" in text
    assert "<" in text  # tqdm's elapsed<remaining (ETA)


def test_progress_bar_is_quiet_when_disabled_or_told_not_to_write_lines():
    pipe = io.StringIO()  # isatty() is False
    with ProgressBar(4, file=pipe, lines=False) as bar:
        bar.update({"reward": 1.0})
        assert bar.running() == {"reward": 1.0}
    tty = _FakeTTY()
    with ProgressBar(4, enabled=False, file=tty) as bar:
        bar.update({"reward": 1.0})
    assert pipe.getvalue() == "" and tty.getvalue() == ""


def test_off_a_terminal_the_progress_bar_writes_a_line_per_interval_and_at_the_end(monkeypatch):
    """A log file gets plain lines (no carriage returns): step, percent, elapsed and ETA, running
    means and the step's time split, one per `every_s` seconds and one at the last step."""
    from jmarl.train import progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    pipe = io.StringIO()
    with ProgressBar(6, initial=2, desc="grpo on math", every_s=10.0, file=pipe) as bar:
        for reward in (0.0, 1.0, 0.5, 0.5):
            now[0] += 4.0
            bar.update({"reward": reward, "success": 0.25, "time/generate": 3.0, "time/update": 1.0, "loss": 9.0})
    lines = pipe.getvalue().splitlines()
    assert "\r" not in pipe.getvalue()
    # 12 s after the start (3 steps done) and at the last step (16 s, 4 done: 4 s/step, no steps left)
    assert lines == [
        "grpo on math: step 5/6 (83%) | 0:00:12 elapsed, ETA 0:00:04 | reward 0.500 success 0.250 | generate 3.0 s, update 1.0 s",
        "grpo on math: step 6/6 (100%) | 0:00:16 elapsed, ETA 0:00:00 | reward 0.500 success 0.250 | generate 3.0 s, update 1.0 s",
    ]


def test_say_writes_a_line_unless_disabled():
    from jmarl.train.progress import say

    pipe = io.StringIO()
    say("evaluating 8 held-out episodes ...", file=pipe)
    say("hidden", enabled=False, file=pipe)
    assert pipe.getvalue() == "evaluating 8 held-out episodes ...\n"


def test_signal_metrics_count_groups_whose_rewards_differ():
    from jmarl.train.metrics import signal_metrics

    # groups 0 (rewards differ, policy a), 1 (all equal, a), 2 (one finite reward, b); a padding row (-1)
    got = signal_metrics([0, 0, 1, 1, 2, 2, -1], [0, 0, 0, 0, 1, 1, 0], [1, 0, 1, 1, 0, float("nan"), 1], ["a", "b"])
    assert got["rollout/groups"] == 3 and got["rollout/signal_group_fraction"] == pytest.approx(1 / 3)
    assert got["rollout/signal_samples"] == 2
    assert got["rollout/a/samples"] == 4 and got["rollout/b/samples"] == 2
    assert got["rollout/a/signal_group_fraction"] == 0.5 and got["rollout/b/signal_group_fraction"] == 0.0
    assert signal_metrics([-1], [0], [1.0], ["a"]) == {}


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_memory_metrics_report_the_host_peak_and_the_largest_device_peak():
    """The host's peak resident set grows with a live allocation of ~64 MiB; the device figure
    is the largest peak over the devices that report one, and absent when none does (CPU)."""
    before = memory_metrics()["perf/host_peak_rss_gib"]
    block = np.ones(64 * 2**20 // 8)  # touched pages count towards the resident set
    after = memory_metrics()["perf/host_peak_rss_gib"]
    assert block.sum() > 0 and 0 < before and after >= before
    assert after > 64 / 1024 * 0.9  # at least the block itself
    got = memory_metrics([_Device({"peak_bytes_in_use": 2**30}), _Device(None), _Device({"peak_bytes_in_use": 3 * 2**29})])
    assert got["perf/device_peak_gib"] == 1.5
    assert set(memory_metrics([_Device(None)])) == {"perf/host_peak_rss_gib"}
    assert figure_of("perf/host_peak_rss_gib") == "time"
