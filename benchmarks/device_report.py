"""One report of a device session's runs of `benchmarks.device`: the figures docs/benchmarks.md renders.

    python -m benchmarks.device_report import FETCHED_DIR DIR/LABEL
    python -m benchmarks.device_report report --out DIR/report.json --run LABEL=DIR/LABEL [--run ...]
        [--setting LABEL=TEXT]

A run is what one `python -m benchmarks.device --out-dir` call wrote (device.json, gpu.json,
torch.json, tests.json, train.json, device.log, profile traces); `import` copies one into the repository,
its traces cut to the device's kernel events (`kernel_trace`: small enough to commit, and all
that `loop_breakdown` reads). For each run the report keeps:

- the device, JAX version, commit and XLA flags (device.json; `--setting` adds a note for a run
  whose device.json predates the flags field);
- the train-step rows (tokens/s, model TFLOP/s, MFU against the measured and the nominal bf16
  peak, remat, attention), from gpu.json, or, for a shape the suite finished but did not save
  before its stage was cut, from the line it printed in device.log (rounded as printed;
  `source` says which);
- the generation rows, PyTorch's train-step rows (torch.json), the tests' counts and each
  stage's status;
- for each profile trace: the kernels and their summed time by loop depth (`loop_breakdown`).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import shlex
import shutil
import sys
from collections import defaultdict
from typing import Any

from jmarl import provenance

NOMINAL_BF16_PEAK = 989e12  # H100 / H200 dense bf16, the datasheet's figure
TRAIN_LINE = re.compile(r"\[train step (?P<size>\S+), attention (?P<attention>\S+)\] (?P<tok>[\d,]+) tok/s, "
                        r"(?P<tflops>[\d.]+) TFLOP/s, MFU (?P<mfu>\d+)% \(compile (?P<compile>\d+)s\)")


def _load(path: str) -> Any:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _device_kernels(events: list[dict]) -> list[dict]:
    """The kernel events of the device's compute stream (the stream with the most events)."""
    processes = {e.get("pid"): str(e.get("args", {}).get("name", "")) for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in processes.items() if name.startswith("/device:") and not name.startswith("/device:CPU")}
    timed = [e for e in events if e.get("ph") == "X" and e.get("pid") in device and float(e.get("dur") or 0) > 0]
    per_line: dict[Any, int] = defaultdict(int)
    for e in timed:
        per_line[(e["pid"], e.get("tid"))] += 1
    if not per_line:
        return []
    busiest = max(per_line, key=per_line.get)
    return [e for e in timed if (e["pid"], e.get("tid")) == busiest]


def loop_breakdown(trace_path: str) -> dict[str, Any]:
    """Kernels of one profiled step by how deep in XLA while loops they ran: {"kernels",
    "busy_ms" (summed durations), "span_ms" (first start to last end), "by_depth": [{"depth",
    "kernels", "busy_ms", "leaf_ops": the most frequent innermost op names}], "loop_conditions":
    the kernels that evaluate a loop's condition}. The depth is the number of `while/body` in
    the kernel's JAX scope path (its `name` argument; a kernel without one takes the path another
    kernel of the same HLO op carries, else depth None)."""
    kernels = _device_kernels(_load(trace_path)["traceEvents"])
    path_of_op: dict[str, str] = {}
    for e in kernels:
        args = e.get("args", {})
        if args.get("name") and args.get("hlo_op"):
            path_of_op.setdefault(args["hlo_op"], args["name"])
    depth_rows: dict[Any, dict[str, Any]] = {}
    conditions = [0, 0.0]
    to_host = sum(1 for e in kernels if "memcpyd2h" in str(e.get("name", "")).lower())
    for e in kernels:
        args = e.get("args", {})
        path = args.get("name") or path_of_op.get(args.get("hlo_op", ""))
        depth = None if path is None else path.count("while/body")
        row = depth_rows.setdefault(depth, {"depth": depth, "kernels": 0, "busy_ms": 0.0, "_leaves": defaultdict(int)})
        row["kernels"] += 1
        row["busy_ms"] += float(e["dur"]) / 1e3
        if path:
            row["_leaves"][path.rsplit("/", 1)[-1]] += 1
            if "/cond/" in path:
                conditions[0] += 1
                conditions[1] += float(e["dur"]) / 1e3
    rows = []
    for depth in sorted(depth_rows, key=lambda d: (d is None, d or 0)):
        row = depth_rows[depth]
        leaves = sorted(row.pop("_leaves").items(), key=lambda kv: -kv[1])[:6]
        rows.append({**row, "leaf_ops": [name for name, _ in leaves]})
    busy = sum(r["busy_ms"] for r in rows)
    span = (max(float(e["ts"]) + float(e["dur"]) for e in kernels) - min(float(e["ts"]) for e in kernels)) / 1e3 \
        if kernels else 0.0
    for r in rows:
        r["fraction"] = r["busy_ms"] / busy if busy else 0.0
    deepest = max((r for r in rows if r["depth"] is not None), key=lambda r: r["depth"], default=None)
    return {"trace": os.path.basename(trace_path), "kernels": len(kernels), "busy_ms": busy, "span_ms": span,
            "by_depth": rows, "deepest": deepest,
            "loop_conditions": {"kernels": conditions[0], "busy_ms": conditions[1]}, "device_to_host_copies": to_host}


def kernel_trace(trace_path: str, out_path: str) -> None:
    """Write the trace's device kernel events alone (name, times, hlo_op and scope path): what
    `loop_breakdown` and `benchmarks.gpu.top_ops` read, at a fraction of the size."""
    events = _load(trace_path)["traceEvents"]
    kernels = _device_kernels(events)
    pids = {e["pid"] for e in kernels}
    keep = [e for e in events if e.get("ph") == "M" and e.get("pid") in pids]
    for e in kernels:
        args = e.get("args", {})
        keep.append({"ph": "X", "pid": e["pid"], "tid": e.get("tid"), "ts": e["ts"], "dur": e["dur"], "name": e["name"],
                     "args": {k: args[k] for k in ("hlo_op", "name") if k in args}})
    with gzip.open(out_path, "wt", compresslevel=9) as f:
        json.dump({"traceEvents": keep}, f, separators=(",", ":"))


def train_rows(run_dir: str) -> list[dict[str, Any]]:
    """The run's train-step rows: gpu.json's, then device.log's printed lines for shapes it lacks."""
    rows = []
    gpu_json = os.path.join(run_dir, "gpu.json")
    for r in (_load(gpu_json).get("rows", []) if os.path.exists(gpu_json) else []):
        if r.get("name") == "train_step_mfu":
            rows.append({"size": r["size"], "attention": r.get("attention"), "remat": r.get("remat"),
                         "tokens_per_s": r["jmarl"], "tflops": r["jmarl_flops"] / 1e12, "mfu_measured": r["mfu"],
                         "mfu_nominal": r["jmarl_flops"] / NOMINAL_BF16_PEAK, "compile_s": r.get("jmarl_compile_s"),
                         "model_tflop_per_step": r["flops_per_token"] * r["batch"] * r["seq_len"] / 1e12,
                         "ms_at_measured_peak": 1e3 * r["flops_per_token"] * r["batch"] * r["seq_len"] / r["matmul_peak_flops"],
                         "source": "gpu.json"})
    log = os.path.join(run_dir, "device.log")
    if os.path.exists(log):
        with open(log) as f:
            for m in TRAIN_LINE.finditer(f.read()):
                if any(r["size"] == m["size"] and r["attention"] == m["attention"] for r in rows):
                    continue
                tflops = float(m["tflops"])
                rows.append({"size": m["size"], "attention": m["attention"], "remat": None,
                             "tokens_per_s": float(m["tok"].replace(",", "")), "tflops": tflops,
                             "mfu_measured": int(m["mfu"]) / 100, "mfu_nominal": tflops * 1e12 / NOMINAL_BF16_PEAK,
                             "compile_s": float(m["compile"]), "source": "device.log (as printed: the stage was cut "
                                                                         "before gpu.json was rewritten)"})
    return rows


def run_report(run_dir: str, setting: str | None) -> dict[str, Any]:
    """One run's figures (see the module docstring)."""
    device = _load(os.path.join(run_dir, "device.json"))
    out: dict[str, Any] = {
        "device": device.get("device_name"), "jax": device.get("jax_version"),
        "commit": (device.get(provenance.KEY) or {}).get("commit"), "dirty": (device.get(provenance.KEY) or {}).get("dirty"),
        "command": device.get("command"), "xla_flags": device.get("xla_flags"), "setting": setting,
        "stages": {s["name"]: {"status": s["status"], "wall_s": s.get("wall_s"), "limit_s": s.get("limit_s")}
                   for s in device.get("stages", [])},
        "train_step": train_rows(run_dir),
    }
    gpu_json = os.path.join(run_dir, "gpu.json")
    if os.path.exists(gpu_json):
        gpu = _load(gpu_json)
        out["matmul_peak_tflops"] = gpu["matmul_peak"]["matmul_peak_flops"] / 1e12
        out["generation"] = [{"size": r["size"], "jmarl_new_tokens_per_s": r["jmarl"], "hf_generate": r.get("baseline"),
                              "ratio": r.get("ratio")} for r in gpu["rows"] if r["name"] == "generation_vs_hf_generate"]
    torch_json = os.path.join(run_dir, "torch.json")
    if os.path.exists(torch_json):  # PyTorch's train step on the same card (benchmarks.gpu_torch)
        out["torch_train_step"] = [{k: r.get(k) for k in ("name", "size", "mode", "baseline", "mfu_vs_nominal",
                                                          "baseline_compile_s", "peak_memory_bytes")}
                                   for r in _load(torch_json).get("rows", [])]
    tests_json = os.path.join(run_dir, "tests.json")
    if os.path.exists(tests_json):
        tests = _load(tests_json)
        ran = [t["test"] for t in tests.get("tests", [])]
        out["tests"] = {"counts": tests.get("counts"), "failed": tests.get("failed"),
                        "selected": len(tests.get("selected", [])), "not_reached": [t for t in tests.get("selected", [])
                                                                                  if t not in ran and not any(r.startswith(t) for r in ran)],
                        "not_run": tests.get("not_run")}
    train_json = os.path.join(run_dir, "train.json")
    if os.path.exists(train_json):
        train = _load(train_json)
        out["train"] = {k: train.get(k) for k in ("steps_requested", "steps_done", "success_before", "success_after")}
        tail = next((s.get("output_tail", "") for s in device.get("stages", []) if s["name"] == "train"), "")
        errors = [line for line in tail.splitlines() if "Error:" in line]
        out["train"]["error_line"] = errors[-1].split("] ", 1)[-1] if errors else None
    out["profiles"] = [loop_breakdown(p) for p in sorted(glob.glob(os.path.join(run_dir, "profile-*.trace.json.gz")))]
    return out


RUN_FILES = ("device.json", "gpu.json", "torch.json", "tests.json", "train.json", "device.log")


def import_run(src: str, dst: str) -> list[str]:
    """Copy one device run's files (`RUN_FILES`) from `src` (what the device tool fetched) into
    `dst` in the repository, its profile traces cut to their kernel events (`kernel_trace`)."""
    os.makedirs(dst, exist_ok=True)
    written = []
    for name in RUN_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
            written.append(name)
    for path in sorted(glob.glob(os.path.join(src, "profile-*.trace.json.gz"))):
        kernel_trace(path, os.path.join(dst, os.path.basename(path)))
        written.append(os.path.basename(path))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_report", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    imp = sub.add_parser("import", help="copy a fetched run into the repository (traces cut to kernel events)")
    imp.add_argument("src")
    imp.add_argument("dst")
    rep = sub.add_parser("report", help="write the report of one or more imported runs")
    rep.add_argument("--out", required=True, help="the report's path (JSON)")
    rep.add_argument("--run", action="append", required=True, metavar="LABEL=DIR")
    rep.add_argument("--setting", action="append", default=[], metavar="LABEL=TEXT")
    args = parser.parse_args(argv)
    if args.verb == "import":
        print(f"{args.dst}: " + ", ".join(import_run(args.src, args.dst)))
        return 0
    settings = dict(s.split("=", 1) for s in args.setting)
    report: dict[str, Any] = {"runs": {}, "nominal_bf16_peak_tflops": NOMINAL_BF16_PEAK / 1e12}
    for item in args.run:
        label, run_dir = item.split("=", 1)
        report["runs"][label] = run_report(run_dir, settings.get(label))
    words = sys.argv[1:] if argv is None else argv
    report[provenance.KEY] = provenance.record(command="python -m benchmarks.device_report " + shlex.join(words))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
