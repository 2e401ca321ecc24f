"""benchmarks.device_report: loop depths of a profiled step, rows from a cut run's log, imports."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import device_report

ROOT = "jit(update)/while/body/eval_jaxpr"
INNER = ROOT + "/while/body/eval_jaxpr/while/body"


def _trace(path, kernels):
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 9, "tid": 1, "ts": 0, "dur": 999.0, "name": "host work"}]
    ts = 0.0
    for tid, name, hlo_op, scope, dur in kernels:
        args = {"hlo_op": hlo_op, **({"name": scope} if scope else {})}
        events.append({"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args})
        ts += dur + 10.0
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_loop_breakdown_counts_kernels_by_while_depth(tmp_path):
    path = tmp_path / "profile-x.trace.json.gz"
    _trace(path, [
        (14, "gemm", "custom-call.1", ROOT + "/dot_general", 40.0),                     # depth 1
        (14, "tile", "gemm_fusion_dot.5", INNER + "/bqkgd", 5.0),                      # depth 3
        (14, "tile", "gemm_fusion_dot.5", None, 5.0),                                  # depth 3, via its op
        (14, "compare", "wrapped_compare", ROOT + "/while/body/eval_jaxpr/while/cond/lt", 1.0),
        (14, "MemcpyD2H", "while.7", None, 2.0),                                       # no scope anywhere
        (20, "copy", "copy.1", None, 50.0),                                            # another stream: ignored
    ])
    got = device_report.loop_breakdown(str(path))
    assert got["kernels"] == 5 and got["busy_ms"] == pytest.approx(0.053)
    assert got["span_ms"] == pytest.approx((40 + 5 + 5 + 1 + 2 + 4 * 10) / 1e3)
    by_depth = {r["depth"]: (r["kernels"], r["busy_ms"]) for r in got["by_depth"]}
    assert by_depth == {1: (1, pytest.approx(0.04)), 2: (1, pytest.approx(0.001)), 3: (2, pytest.approx(0.01)),
                        None: (1, pytest.approx(0.002))}
    assert got["deepest"]["depth"] == 3 and got["deepest"]["leaf_ops"] == ["bqkgd"]
    assert got["loop_conditions"]["kernels"] == 1 and got["device_to_host_copies"] == 1


def test_a_cut_run_takes_the_shapes_it_did_not_save_from_its_log(tmp_path):
    (tmp_path / "device.log").write_text(
        "[gpu_suite] [train step gpu-0.5b, attention auto] 28,894 tok/s, 93.3 TFLOP/s, MFU 15% (compile 11s)\n"
        "[gpu_suite] [train step gpu-1.5b, attention auto] 15,241 tok/s, 149.2 TFLOP/s, MFU 23% (compile 11s)\n")
    row = {"name": "train_step_mfu", "size": "gpu-0.5b", "attention": "auto", "remat": "none", "jmarl": 28893.6,
           "jmarl_flops": 93.27e12, "mfu": 0.1465, "flops_per_token": 3.228e9, "batch": 16, "seq_len": 1024,
           "matmul_peak_flops": 636.6e12}
    (tmp_path / "gpu.json").write_text(json.dumps({"rows": [row]}))
    rows = device_report.train_rows(str(tmp_path))
    assert [(r["size"], r["source"].split()[0]) for r in rows] == [("gpu-0.5b", "gpu.json"), ("gpu-1.5b", "device.log")]
    assert rows[0]["tokens_per_s"] == 28893.6 and rows[0]["model_tflop_per_step"] == pytest.approx(52.9, abs=0.05)
    assert rows[1]["tokens_per_s"] == 15241.0 and rows[1]["mfu_nominal"] == pytest.approx(149.2 / 989)


def test_import_cuts_traces_to_the_kernels_that_the_breakdown_reads(tmp_path):
    src, dst = tmp_path / "fetched", tmp_path / "runs" / "a"
    src.mkdir()
    (src / "device.json").write_text("{}")
    (src / "stray.txt").write_text("not a run file")
    _trace(src / "profile-s-auto.trace.json.gz", [(14, "tile", "gemm_fusion_dot.5", INNER + "/bqkgd", 5.0),
                                                  (14, "gemm", "custom-call.1", ROOT + "/dot_general", 40.0)])
    assert device_report.import_run(str(src), str(dst)) == ["device.json", "profile-s-auto.trace.json.gz"]
    assert not (dst / "stray.txt").exists()
    with gzip.open(dst / "profile-s-auto.trace.json.gz", "rt") as f:
        kept = json.load(f)["traceEvents"]
    assert not any(e.get("name") == "host work" for e in kept)
    assert device_report.loop_breakdown(str(dst / "profile-s-auto.trace.json.gz")) == \
        device_report.loop_breakdown(str(src / "profile-s-auto.trace.json.gz"))
