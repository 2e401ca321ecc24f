"""Smoke tests of the benchmarks that had none: each runs the benchmark's `main` end to end at the
smallest size it takes, writes its results under the test's tmp_path (never benchmarks/results/),
and checks what a reader of the result relies on: its fields, finite figures in their ranges,
figures consistent with the input, and the provenance record. No speed is asserted.

The trainer-driven benchmarks (row utilization, packing) run the quickstart config shrunk to one
task of two candidates, one RL step, no warm start and one evaluation episode (`SMALL_RUN`); both
use the same settings, so the second reuses the first's compiled programs (the tests' persistent
XLA cache). All but the memory test are marked slow: each compiles programs whose compile time does
not shrink with the workload (see each test's comment for its measured time)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common import REPO_ROOT
from jmarl import provenance

# The quickstart shrunk for a smoke run (the benchmarks' `--overrides`): what the run measures is
# unchanged, only the workload is smaller. One device, as the benchmarks run outside the tests: the
# config shards over every device (fsdp -1), and over the tests' 8 simulated devices that only
# multiplies compile time.
SMALL_RUN = ["workflow.num_tasks=1", "workflow.group_size=2", "eval.num_episodes=1", "mesh.fsdp=1"]


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Runs the test from the repository root: the benchmarks name their configs relative to it,
    and `benchmarks.moe` starts `python -m benchmarks.moe` children there."""
    monkeypatch.chdir(REPO_ROOT)
    return Path(REPO_ROOT)


def read_json(path: Path) -> dict[str, Any]:
    """The results file a benchmark wrote (it must exist)."""
    assert path.is_file(), f"the benchmark wrote no {path}"
    return json.loads(path.read_text())


def assert_header(result: dict[str, Any], module: str, argv: list[str]) -> None:
    """The fields `benchmarks.common.results_header` / `results_end` give every results file: the
    command that made it, the start and end dates, the machine, the library versions, the git
    commit and a complete provenance record."""
    assert result["command"] == f"python -m {module} " + " ".join(argv)
    assert result["date"].endswith(" UTC") and result["ended"].endswith(" UTC")
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["jax_devices"]
    assert result["versions"]["jax"] and result["git"]["commit"]
    assert_provenance(result, module)


def assert_provenance(result: dict[str, Any], module: str) -> None:
    """A complete `jmarl.provenance` record naming `module`'s command and this checkout's commit."""
    assert provenance.missing(result) == []
    record = result[provenance.KEY]
    assert module in record["command"]
    assert record["commit"] == provenance.code_state()["commit"]


def assert_positive_finite(value: float, what: str) -> None:
    assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, f"{what}: {value!r}"


def test_memory_benchmark_compiles_one_small_row(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`benchmarks.memory` on one Qwen3-0.6B row of 1 x 128 tokens (`--row`): the row says what
    was compiled, the argument bytes are exactly the float32 parameters plus the batch, the
    gradient holds at least the float32 parameters, and the table prints the row."""
    from benchmarks import memory
    from jmarl.models import presets
    from jmarl.models.config import REMAT_POLICIES, resolve_remat

    preset, batch, tokens = "qwen3-0.6b", 1, 128
    out = tmp_path / "memory.json"
    argv = ["--json", str(out), "--row", preset, str(batch), str(tokens), "auto", "auto"]
    assert memory.main(argv) == 0
    result = read_json(out)
    assert_header(result, "benchmarks.memory", argv)
    assert result["backend"] == "cpu"

    [row] = result["rows"]
    assert (row["preset"], row["batch"], row["tokens"], row["attention"]) == (preset, batch, tokens, "auto")
    num_params = presets.preset_config(preset).num_params()
    # the remat the library resolves for "auto" at this size is recorded, not the setting
    assert row["remat"] in REMAT_POLICIES and row["remat"] == resolve_remat("auto", num_params)
    for field in ("arguments", "outputs", "temporaries"):
        assert isinstance(row[field], int) and row[field] > 0, field
    # arguments: float32 parameters, int32 tokens and a bool mask; outputs: the float32 gradient
    # (plus XLA's small tuple table)
    assert row["arguments"] == 4 * num_params + batch * tokens * (4 + 1)
    assert 4 * num_params <= row["outputs"] < 4 * num_params + (1 << 20)
    table_rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {preset} |")]
    assert len(table_rows) == 1 and f"{batch} x {tokens}" in table_rows[0]


# Slow: the memory check it runs compiles the trainer's programs (what the benchmark measures), in
# a child process: 77-87 s with a cold XLA cache on 2 cores, 18-25 s warm.
@pytest.mark.slow
def test_plan_configs_benchmark_plans_one_row(in_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`benchmarks.plan_configs --only qwen3-1.7b@1` (one device, the cheapest row of its table):
    the record has the memory check's figures plus the exit code, command, date, code and
    provenance the benchmark adds, its `fits` agrees with the exit code and the peak, and the
    printed table row says the same."""
    from benchmarks import plan_configs

    name = "qwen3-1.7b@1"
    assert plan_configs.main(["--out", str(tmp_path), "--only", name]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.json"]  # --only ran that row alone
    record = read_json(tmp_path / f"{name}.json")
    assert_provenance(record, "jmarl.memory_check")
    assert record["command"].startswith("python -m jmarl.memory_check --config configs/at_grpo/plan_path.yaml ")
    assert "model.preset=qwen3-1.7b" in record["command"] and record["command"].endswith("--device-memory 80GiB")
    assert record["date"].endswith(" UTC") and record["git"]["commit"] == record[provenance.KEY]["commit"]

    assert record["devices"] == 1 and set(record["mesh"].values()) == {1}
    assert record["programs"] and all(p["peak"] > 0 for p in record["programs"])
    assert record["peak"] == max(p["peak"] for p in record["programs"])
    assert record["limit"] == pytest.approx(80 * 2**30 * (1 - record["headroom"]))
    # it fits when the largest peak is within the limit, and the memory check exits 0 exactly then
    assert record["fits"] == (record["peak"] <= record["limit"]) == (record["exit_code"] == 0)

    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {name} |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "1" and cells[2] == "1 device"
    assert cells[5] == ("yes" if record["fits"] else "no")


# Slow: a whole (shrunk) training run, bound by compiling the sampler and the update (31-37 s with
# a cold XLA cache on 2 cores, ~12 s warm); a smaller run compiles the same programs.
@pytest.mark.slow
def test_row_utilization_benchmark_on_one_short_run(in_repo: Path, tmp_path: Path) -> None:
    """`benchmarks.row_utilization` on one quickstart run of one RL step (`SMALL_RUN`): one value a
    step, each a fraction of the decoded rows, and the mean and minimum are theirs."""
    from benchmarks import row_utilization

    out = tmp_path / "row_utilization.json"
    argv = ["--variants", "quickstart", "--steps", "1", "--out", str(out),
            "--overrides", "train.warm_start.steps=0", *SMALL_RUN]
    returned = row_utilization.main(argv)
    result = read_json(out)
    assert result == json.loads(json.dumps(returned))  # the file holds what main returned
    assert_header(result, "benchmarks.row_utilization", argv)
    assert result["config"] == "configs/quickstart.yaml"
    assert result["overrides"] == ["train.warm_start.steps=0", *SMALL_RUN]

    [run] = result["runs"]
    assert (run["variant"], run["seed"], run["steps"]) == ("quickstart", 0, 1)
    assert len(run["per_step"]) == run["steps"]
    assert all(0 < u <= 1 for u in run["per_step"])
    assert run["mean"] == pytest.approx(sum(run["per_step"]) / len(run["per_step"]))
    assert run["min"] == min(run["per_step"]) and run["min"] <= run["mean"] <= 1
    assert_positive_finite(run["seconds"], "seconds")


# Slow: a whole (shrunk) training run, then both layouts' updates compiled and timed (~54 s with a
# cold XLA cache on 2 cores, 24-28 s after the row-utilization test's run, ~11 s warm).
@pytest.mark.slow
def test_packing_benchmark_on_one_short_run(in_repo: Path, tmp_path: Path) -> None:
    """`benchmarks.packing` on the quickstart (`SMALL_RUN`, one RL step, one timed repeat): both
    layouts' utilizations are fractions of their slots from the same real tokens, and the timed
    update covers the same batches' tokens at finite, positive throughputs."""
    from benchmarks import packing

    out = tmp_path / "packing.json"
    argv = ["--configs", "quickstart", "--time", "quickstart", "--steps", "1", "--warm-start", "0",
            "--repeats", "1", "--out", str(out), "--overrides", *SMALL_RUN]
    returned = packing.main(argv)
    result = read_json(out)
    assert result == json.loads(json.dumps(returned))
    assert_header(result, "benchmarks.packing", argv)

    [row] = result["rows"]
    assert (row["config"], row["steps"], row["overrides"]) == (packing.CONFIGS["quickstart"], 1, SMALL_RUN)
    assert row["batches"] >= row["steps"]  # at least one learner batch a step
    assert 0 < row["real"] <= min(row["packed_slots"], row["shared_slots"])
    assert row["packed_utilization"] == pytest.approx(row["real"] / row["packed_slots"])
    assert row["shared_utilization"] == pytest.approx(row["real"] / row["shared_slots"])
    assert 0 < row["packed_utilization"] <= 1 and 0 < row["shared_utilization"] <= 1

    update = row["update"]
    assert 1 <= update["batches"] <= row["batches"]
    assert update["real_tokens"] == row["real"]  # the timed updates cover every batch counted above
    for field in ("packed_s", "shared_s", "packed_real_tokens_per_s", "shared_real_tokens_per_s", "speedup"):
        assert_positive_finite(update[field], field)
    assert update["packed_real_tokens_per_s"] == pytest.approx(update["real_tokens"] / update["packed_s"])
    assert update["speedup"] == pytest.approx(update["shared_s"] / update["packed_s"])


# Slow: six compiles at any size, the three forward forms and the three layouts of a 30B-A3B expert
# layer in a child process (~41 s with a cold XLA cache on 2 cores, 17-18 s warm).
@pytest.mark.slow
def test_moe_benchmark_at_its_smallest_size(in_repo: Path, tmp_path: Path) -> None:
    """`benchmarks.moe` with one repeat of a 1 x 16 forward and the layer memory on 2 simulated
    devices: all three forward forms at finite throughputs relative to the dense one, the MoE and
    the dense model running the same attention and feed-forward weights a token, and each layout's
    memory row with at least its share of the expert weights as arguments."""
    from benchmarks import moe

    out = tmp_path / "moe.json"
    batch, seq, repeats, devices = 1, 16, 1, 2
    argv = ["--json", str(out), "--repeats", str(repeats), "--batch", str(batch), "--seq", str(seq),
            "--memory-devices", str(devices)]
    assert moe.main(argv) == 0
    result = read_json(out)
    assert_header(result, "benchmarks.moe", argv)

    forward = result["cpu_forward"]
    assert (forward["batch"], forward["seq"], forward["tokens"], forward["repeats"]) == (batch, seq, batch * seq, repeats)
    forms = forward["forms"]
    assert set(forms) == {"moe (tiled)", "moe (ragged_dot)", "dense"}
    for name, form in forms.items():
        assert len(form["seconds"]) == repeats and all(s > 0 for s in form["seconds"]), name
        assert_positive_finite(form["tokens_per_s"], name)
        assert form["ratio_to_dense"] == pytest.approx(form["tokens_per_s"] / forms["dense"]["tokens_per_s"])
    assert forms["dense"]["ratio_to_dense"] == 1.0
    # the comparison's premise: a token runs the same weights in both models, the MoE's router aside
    active = forward["active_params_per_layer"]
    assert active["moe"]["attention"] == active["dense"]["attention"]
    assert active["moe"]["feed_forward"] == active["dense"]["feed_forward"]
    assert active["moe"]["router"] > 0 and active["dense"]["router"] == 0

    memory = result["layer_memory"]
    assert [(r["devices"], r["layout"]) for r in memory] == [
        (devices, layout) for layout in ("expert parallel", "weights gathered", "fsdp on D")]
    weights_share = 3 * moe.E30 * moe.D30 * moe.F30 * 4 // devices  # float32 gate, up and down
    for r in memory:
        assert r["tokens_per_device"] == moe.TOKENS_PER_DEVICE
        assert r["arguments"] >= weights_share and r["temporaries"] > 0 and r["outputs"] > 0, r["layout"]
        assert set(r["collectives"]) == {"all-gather", "reduce-scatter", "all-reduce", "all-to-all"}
    # the three layouts take the same arguments, split over the same devices
    assert len({r["arguments"] for r in memory}) == 1


def test_ab_summary_is_the_rounds_ratios():
    """benchmarks.ab: per-round head / base ratios of the step seconds, median, range, slower rounds."""
    from benchmarks import ab

    got = ab.summarize([1.0, 2.0, 1.0], [1.1, 1.8, 1.05])
    assert got["ratios"] == pytest.approx([1.1, 0.9, 1.05])
    assert got["ratio_median"] == pytest.approx(1.05)
    assert (got["ratio_min"], got["ratio_max"]) == (pytest.approx(0.9), pytest.approx(1.1))
    assert (got["rounds_head_slower"], got["rounds"]) == (2, 3)


@pytest.mark.slow
def test_ab_times_both_checkouts_and_removes_them(tmp_path: Path, in_repo: Path):
    """One round on the tiny shape, HEAD against itself (a clean clone may hold no other commit):
    both sides timed in a checkout of their own (the child asserts it imported that checkout's
    jmarl), a finite ratio, the worktrees gone afterwards."""
    import subprocess

    from benchmarks import ab

    out = tmp_path / "ab.json"
    before = subprocess.run(["git", "worktree", "list"], cwd=in_repo, capture_output=True, text=True).stdout
    argv = ["--base", "HEAD", "--head", "HEAD", "--shape", "tiny", "--rounds", "1", "--steps", "1", "--out", str(out)]
    assert ab.main(argv) == 0
    result = read_json(out)
    assert result["base"] == result["head"] == ab.resolve("HEAD")
    assert len(result["base_seconds"]) == len(result["head_seconds"]) == result["rounds"] == 1
    assert all(math.isfinite(s) and s > 0 for s in result["base_seconds"] + result["head_seconds"])
    assert math.isfinite(result["ratio_median"]) and result["ratio_median"] > 0
    assert result["tokens_per_step"] > 0
    assert_provenance(result, "benchmarks.ab")
    after = subprocess.run(["git", "worktree", "list"], cwd=in_repo, capture_output=True, text=True).stdout
    assert after == before


def test_ab_refuses_an_unknown_commit(in_repo: Path):
    from benchmarks import ab
    from jmarl.errors import JmarlError

    with pytest.raises(JmarlError, match="no commit 'not-a-commit'"):
        ab.main(["--base", "not-a-commit"])
