"""The one-shot accelerator command (`python -m benchmarks.device`): its dry run on the CPU records
every stage with provenance, the training stage's before/after success and per-step curve, and a
profiled train step; the budget split, the trace summary and the model-part check by hand."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from benchmarks import device
from benchmarks.gpu import top_ops
from jmarl import provenance


def test_stage_limits_share_the_budget_and_pass_on_what_is_left():
    assert device.stage_timeouts(540) == {"tests": 60, "gpu_suite": 270, "torch": 90, "train": 120}
    assert device.stage_timeouts(270)["gpu_suite"] == 135
    every = list(device.STAGES)
    # at the start each stage gets its share; what an early stage leaves goes to the next one
    assert device.stage_limit("tests", 540, every, 540) == 60
    assert device.stage_limit("gpu_suite", 530, every, 540) == 530 - 90 - 120
    assert device.stage_limit("train", 200, every, 540) == 200
    # a stage that will not run leaves its share to the others; never more than what is left
    assert device.stage_limit("gpu_suite", 470, ["tests", "gpu_suite"], 540) == 470
    assert device.stage_limit("train", 12, every, 540) == 12 < device.MIN_STAGE_S


def test_top_ops_counts_the_device_ops_line_once(tmp_path):
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 500.0, "name": "PjitFunction(update)"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 0, "dur": 30.0, "name": "sm90_gemm", "args": {"hlo_op": "dot.1"}},
        {"ph": "X", "pid": 2, "tid": 8, "ts": 0, "dur": 30.0, "name": "dot.1", "args": {"hlo_op": "dot.1"}},
        {"ph": "X", "pid": 2, "tid": 8, "ts": 40, "dur": 10.0, "name": "fusion.2", "args": {"hlo_op": "fusion.2"}},
        {"ph": "X", "pid": 2, "tid": 8, "ts": 60, "dur": 30.0, "name": "dot.1", "args": {"hlo_op": "dot.1"}},
    ]
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = top_ops(str(path))
    assert got["selection"] == "device XLA Ops line" and got["total_us"] == 70.0
    assert [(o["op"], o["count"]) for o in got["top_ops"]] == [("dot.1", 2), ("fusion.2", 1)]
    assert got["top_ops"][0]["fraction"] == pytest.approx(60 / 70)


def test_top_ops_names_the_kernels_inside_a_cuda_graph(tmp_path):
    """With XLA's command buffers (CUDA graphs) every kernel's hlo_op is the graph's name: the
    kernels are counted by their own names, and the span covers the gaps between them."""
    events = [
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 100, "dur": 20.0, "name": "gemm_fusion_dot_3",
         "args": {"hlo_op": "command_buffer_41"}},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 130, "dur": 5.0, "name": "loop_add_fusion",
         "args": {"hlo_op": "command_buffer_41"}},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 150, "dur": 20.0, "name": "gemm_fusion_dot_3",
         "args": {"hlo_op": "command_buffer_41"}},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 200, "dur": 10.0, "name": "input_reduce_fusion",
         "args": {"hlo_op": "input_reduce_fusion"}},
    ]
    path = tmp_path / "graph.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = top_ops(str(path))
    assert got["selection"] == "device stream lines (kernels)"
    assert [(o["op"], o["count"]) for o in got["top_ops"]] == [
        ("gemm_fusion_dot_3", 2), ("input_reduce_fusion", 1), ("loop_add_fusion", 1)]
    assert (got["total_us"], got["events"], got["span_us"]) == (55.0, 4, 110.0)


def test_model_parts_that_do_not_join_to_the_pinned_file_are_refused(tmp_path):
    (tmp_path / "m.gguf.part00").write_bytes(b"first half")
    probe = {"model_pin": {"filename": "m.gguf", "sha256": "0" * 64, "size": 20}}
    got = device.resolve_model(str(tmp_path / "m.gguf"), False, probe, str(tmp_path))
    assert "a part is missing or damaged" in got["why"]
    assert "no model file at" in device.resolve_model(str(tmp_path / "other.gguf"), False, probe, str(tmp_path))["why"]
    assert device.resolve_model(None, True, probe, str(tmp_path))["tokenizer"] == "char"  # dry: the tiny preset


def test_train_commands_load_as_configs(tmp_path):
    from jmarl.config.load import load_config

    config = os.path.join(device.REPO_ROOT, device.CONFIG)
    real = load_config(config, device.train_overrides(str(tmp_path), {"path": "model.gguf"}, 40, dry_run=False))
    assert (real.model.path, real.model.compute_dtype, real.train.steps, real.eval.num_episodes) == (
        "model.gguf", "bfloat16", 40, 128)
    model = device.resolve_model(None, True, {}, str(tmp_path))
    dry = load_config(config, device.train_overrides(str(tmp_path), model, 2, dry_run=True))
    assert dry.model.path is None and dry.tokenizer == "char" and dry.train.steps == 2


@pytest.mark.slow
def test_dry_run_records_every_stage_with_provenance(tmp_path):
    env = dict(os.environ)  # tests/conftest.py's 8 simulated devices: only its own pytest stage adds them back
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "benchmarks.device", "--dry-run", "--out-dir", str(out),
                           "--work-dir", str(tmp_path / "work")], cwd=device.REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]

    result = json.loads((out / "device.json").read_text())
    assert [s["name"] for s in result["stages"]] == list(device.STAGES)
    assert {s["name"]: s["status"] for s in result["stages"]} == dict.fromkeys(device.STAGES, "passed")
    assert all(s["exit_code"] == 0 and s["wall_s"] > 0 and s["json"] for s in result["stages"])
    assert provenance.missing(result) == [] and result["dry_run"] is True
    assert result["device_name"] and result["jax_version"] and result["not_run"] == []
    for stage in result["stages"]:
        data = json.loads((out / stage["json"]).read_text())
        assert provenance.missing(data) == [], stage["name"]
        assert data["jax_version"] == result["jax_version"] and data["device"] == result["device"], stage["name"]

    train = json.loads((out / "train.json").read_text())
    assert isinstance(train["success_before"], float) and isinstance(train["success_after"], float)
    assert [c["step"] for c in train["curve"]] == [1, 2]
    assert all(0 <= c["success_rate"] <= 1 and 0 <= c["truncated_fraction"] <= 1 for c in train["curve"])
    assert [e["step"] for e in train["eval"]] == [0, 2]

    tests = json.loads((out / "tests.json").read_text())
    assert tests["counts"].get("passed", 0) >= len(device.DRY_TESTS) and tests["failed"] == []
    torch_rows = json.loads((out / "torch.json").read_text())["rows"]
    assert [(r["name"], r["size"]) for r in torch_rows] == [("train_step_torch_eager", "tiny")]
    assert torch_rows[0]["baseline"] > 0
    gpu = json.loads((out / "gpu.json").read_text())
    assert any(row.get("profile", {}).get("top_ops") for row in gpu["rows"])
    assert all((out / name).exists() for name in result["stages"][1]["summary"]["traces"])
