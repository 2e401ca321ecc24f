"""Metrics: JSONL (non-finite safe), TensorBoard events read back, PNG plots, summary, progress."""

import io
import json
import math
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jmarl.train.metrics import MetricsLogger, metric_series, read_metrics, write_summary
from jmarl.train.progress import ProgressBar

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _strict_json(text: str):
    """json.loads that rejects the non-standard NaN/Infinity tokens."""

    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=reject)


def read_tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Parses TFRecord event files by hand: tag -> {step: value}."""
    out: dict[str, dict[int, float]] = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {logdir}"
    for path in files:
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]  # skip length + its crc
            pos += 12 + length + 4  # + data crc
            event = event_pb2.Event.FromString(record)
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

    pngs = {p.name for p in (tmp_path / "plots").glob("*.png")}
    assert pngs == {"reward.png", "loss.png", "kl.png", "time.png", "solved.png"}
    for name in pngs:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        width, height = struct.unpack(">II", data[16:24])
        assert (width, height) == (640, 400)


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
    assert (tmp_path / "plots" / "reward.png").exists()
    assert not (tmp_path / "tensorboard").exists()


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


def test_progress_bar_is_quiet_off_a_tty_or_disabled():
    pipe = io.StringIO()  # isatty() is False
    with ProgressBar(4, file=pipe) as bar:
        bar.update({"reward": 1.0})
        assert bar.running() == {"reward": 1.0}
    tty = _FakeTTY()
    with ProgressBar(4, enabled=False, file=tty) as bar:
        bar.update({"reward": 1.0})
    assert pipe.getvalue() == "" and tty.getvalue() == ""
