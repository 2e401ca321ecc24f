"""The README's first command, shortened: `python -m jmarl.run --config configs/quickstart.yaml`
runs end to end and leaves every promised output (summary, metrics, plots, checkpoint, export,
the printed before/after table). Speed and learning are not asserted here: the learning
evidence comes from `scripts/evidence.py quickstart` (results/evidence_quickstart.json)."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jmarl.config import load_config
from jmarl.run import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"

SHORT = [
    "train.steps=2",
    "train.warm_start.steps=3",
    "train.warm_start.demos=2",
    "workflow.num_tasks=2",
    "eval.num_episodes=2",
    "eval.every=1",
    "checkpoint.every=1",
    "logging.tensorboard=false",
]


@pytest.mark.slow
def test_shortened_quickstart_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 99, "rollout/success_rate": 1.0}\n')  # an older run's
    assert main(["--config", str(QUICKSTART), f"output_dir={out}", *SHORT]) == 0
    config = load_config(QUICKSTART, [f"output_dir={out}", *SHORT])

    summary = json.loads((out / "summary.json").read_text())
    for key in ("success_before", "success_after", "steps", "wall_seconds", "eval_success_rate"):
        assert key in summary, key
    assert summary["steps"] == 2
    assert 0.0 <= summary["success_before"] <= 1.0 and 0.0 <= summary["success_after"] <= 1.0
    assert summary["success_after"] == summary["eval_success_rate"]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "rollout/success_rate" in r] == [1, 2]  # a fresh run starts a fresh file
    assert [r["step"] for r in records if "eval/success_rate" in r] == [0, 1, 2]  # step 0: before RL
    assert records[0]["eval/success_rate"] == summary["success_before"]
    # the env's step-info values per step: Plan-Path's moves, and the share of samples that moved
    step1 = next(r for r in records if r.get("step") == 1 and "rollout/success_rate" in r)
    assert step1["rollout/info/moves"] >= 0 and 0 <= step1["rollout/info_nonzero/moves"] <= 1

    plots = {p.name for p in (out / "plots").glob("*.png")}
    assert {"evaluation.png", "rollout.png", "components.png", "loss.png", "time.png"} <= plots
    assert all((out / "plots" / name).stat().st_size > 1000 for name in plots)

    assert (out / "checkpoints").is_dir() and "2" in {p.name for p in (out / "checkpoints").iterdir()}

    # one exported Hugging Face directory per policy, with the configured architecture
    for policy in ("tool", "planner"):
        path = out / "export" / policy
        hf = json.loads((path / "config.json").read_text())
        assert hf["hidden_size"] == config.model.preset.hidden_size
        assert hf["num_hidden_layers"] == config.model.preset.num_layers
        weights = load_file(str(path / "model.safetensors"))
        assert weights and all(np.isfinite(w).all() for w in weights.values())
        assert (path / "tokenizer.json").exists()
    tool = load_file(str(out / "export" / "tool" / "model.safetensors"))
    planner = load_file(str(out / "export" / "planner" / "model.safetensors"))
    assert any(not np.array_equal(tool[k], planner[k]) for k in tool)  # per-agent policies diverged

    printed = capsys.readouterr().out
    assert "held-out success on plan_path (2 episodes, greedy)" in printed
    assert f"{100 * summary['success_before']:5.1f}%" in printed
    assert f"{100 * summary['success_after']:5.1f}%" in printed
    assert f"curves: open {out / 'plots' / 'evaluation.png'}" in printed
