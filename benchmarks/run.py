"""One command for a benchmark suite: JSON results and the table in docs/benchmarks.md.

    python -m benchmarks.run --suite cpu              # full CPU suite (cpu-small, cpu-medium)
    python -m benchmarks.run --suite cpu --quick      # smoke run: cpu-small, 2 repeats, 16 new tokens
    python -m benchmarks.run --suite cpu --shapes cpu-small --only train_step,generation
    python -m benchmarks.run --suite gpu              # 0.5B-8B shapes, bf16, MFU (needs an accelerator)
    python -m benchmarks.run --suite gpu --profile DIR  # ... and one profiled train step per row (top ops in the JSON)

Writes `benchmarks/results/<suite>.json` (`<suite>_quick.json` with --quick): machine, versions,
the measured matmul peak, the command, and one row per comparison (docs/benchmarks.md row names;
`name`, `metric`, `jmarl`, `baseline`, `ratio`, min/median/max over >= 5 paired A B A B repeats
after warm-up, compile time separately). A full run then rewrites the table in docs/benchmarks.md between
`<!-- bench:<suite>:start -->` and `<!-- bench:<suite>:end -->` (`--readme PATH`, `--no-readme`).

Each shape is gated on parity first (`benchmarks.parity`): if jmarl and PyTorch disagree, that
shape reports no figures (its failure is recorded under `errors`). Each part (train step,
generation, GRPO, MAGRPO) of each shape then runs in a fresh Python process of its own, so one
benchmark's leftovers cannot slow the next; inside it, the PyTorch side runs in a process of its
own again (`benchmarks.baseline_process`), out of the box, while jmarl's side runs under jmarl's
host memory policy; the two still alternate A B A B. `--baseline-host-memory jmarl` gives the
PyTorch side that policy too (results to `<suite>_baseline_jmarl_memory.json`, tables untouched).
A benchmark that raises (or whose process dies) is recorded under `errors` too and the suite goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import traceback
from typing import Any, Callable

from jmarl import provenance
from benchmarks.common import git_state, machine_info, measure_matmul_peak, results_end, utc_now, versions, write_json

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
README = os.path.join(REPO_ROOT, "docs", "benchmarks.md")  # the file whose tables a full run rewrites
CPU_SHAPES = ("cpu-small", "cpu-medium")
CPU_PARTS = ("train_step", "generation", "grpo", "magrpo")


def _attempt(errors: list[dict], name: str, size: str, fn: Callable[[], Any]) -> Any:
    """fn(), or None with the failure appended to `errors`."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a failing benchmark must not hide the others
        traceback.print_exc()
        errors.append({"name": name, "size": size, "error": f"{type(e).__name__}: {e}"[:500]})
        return None


def shape_parity(shape: str) -> dict[str, float]:
    """The parity gate of `shape` (raises `ParityError` when the two sides disagree)."""
    from benchmarks.common import write_checkpoint
    from benchmarks.parity import check_parity
    from jmarl.models import load_hf

    with tempfile.TemporaryDirectory() as d:
        torch_model = write_checkpoint(shape, d, tokenizer=False)
        config, params = load_hf(d)
    return check_parity(torch_model, config, params)


PART_ERROR_NAMES = {"train_step": "train_step", "generation": "generation",
                    "grpo": "grpo_iteration_vs_trl", "magrpo": "magrpo_iteration_vs_comlrl"}


def run_part(part: str, shape: str, repeats: int, quick: bool, peak: float,
             baseline_host_memory: str = "default") -> list[dict]:
    """The rows of one part of the CPU suite on one (parity-gated) shape, jmarl's side in this
    process (its PyTorch side in a `benchmarks.baseline_process` of its own)."""
    new_tokens = 16 if quick else 64
    memory = {"baseline_host_memory": baseline_host_memory}
    if part == "train_step":
        from benchmarks.train_step import bench_train_step

        return bench_train_step(shape, repeats, peak_flops=peak, **memory, **(dict(rows=16) if quick else {}))
    if part == "generation":
        from benchmarks import generation

        return generation.bench_shape(shape, repeats, new_tokens, batches=(64, 8), **memory)
    if part == "grpo":
        from benchmarks.iteration import bench_grpo_vs_trl

        return [bench_grpo_vs_trl(shape, repeats, new_tokens=new_tokens, **memory)]
    if part == "magrpo":
        from benchmarks.iteration import bench_magrpo_vs_comlrl

        return [bench_magrpo_vs_comlrl(shape, repeats, new_tokens=new_tokens, **memory)]
    raise ValueError(f"unknown part {part!r}; choose from {CPU_PARTS}")


def run_part_isolated(part: str, shape: str, repeats: int, quick: bool, peak: float,
                      baseline_host_memory: str = "default") -> tuple[list[dict], list[dict]]:
    """(rows, errors) of `run_part` run in a fresh Python process.

    Each part gets its own process so that what one benchmark leaves behind (a baseline's
    allocator state and threads, gigabytes of freed buffers, JAX's compiled programs) cannot slow
    the next one: in one shared process the last part (MAGRPO at cpu-medium, after the TRL
    benchmark) ran measurably slower than the same part on its own. The child prints its
    progress to this terminal and hands its rows back through a JSON file; a child that dies
    (killed, out of memory) is recorded as an error of that part."""
    name = PART_ERROR_NAMES.get(part, part)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "part.json")
        cmd = [sys.executable, "-m", "benchmarks.run", "--suite", "cpu", "--part", part, "--shapes", shape,
               "--repeats", str(repeats), "--peak-flops", repr(peak), "--part-out", out,
               "--baseline-host-memory", baseline_host_memory] + (["--quick"] if quick else [])
        code = subprocess.run(cmd, cwd=REPO_ROOT).returncode
        if not os.path.exists(out):
            return [], [{"name": name, "size": shape, "error": f"benchmark process exited with code {code} and no results"}]
        with open(out) as f:
            got = json.load(f)
    return got["rows"], got["errors"]


def run_cpu(args, results: dict[str, Any]) -> None:
    """The CPU suite: for each shape, the parity gate (here), then each selected part in a
    process of its own (`run_part_isolated`)."""
    rows, errors = results["rows"], results["errors"]
    peak = results["matmul_peak"]["matmul_peak_flops"]
    for shape in args.shapes:
        parity = _attempt(errors, "parity_gate", shape, lambda: shape_parity(shape))
        if parity is None:
            continue
        results.setdefault("parity", {})[shape] = parity
        print(f"[parity {shape}] {parity}", flush=True)
        for part in CPU_PARTS:
            if part in args.only:
                part_rows, part_errors = run_part_isolated(part, shape, args.repeats, args.quick, peak,
                                                           args.baseline_host_memory)
                rows.extend(part_rows)
                errors.extend(part_errors)
                _write(args, results)  # partial results survive a later crash


def part_main(args) -> int:
    """Child side of `run_part_isolated`: one part on one shape, rows and errors to --part-out."""
    errors: list[dict] = []
    shape = args.shapes[0]
    rows = _attempt(errors, PART_ERROR_NAMES[args.part], shape,
                    lambda: run_part(args.part, shape, args.repeats, args.quick, args.peak_flops,
                                     args.baseline_host_memory)) or []
    with open(args.part_out, "w") as f:
        json.dump({"rows": rows, "errors": errors}, f)
    return 0


def run_gpu(args, results: dict[str, Any]) -> None:
    """The accelerator suite (see `benchmarks.gpu`)."""
    from benchmarks import gpu

    rows, errors = results["rows"], results["errors"]
    on_cpu = gpu.accelerator() is None
    settings = gpu.tiny_cpu_settings() if on_cpu else {"batch": gpu.GPU_BATCH, "seq": gpu.GPU_SEQ, "dtype": "bfloat16"}
    parity = _attempt(errors, "parity_gate", "tiny", gpu.gpu_parity)
    if parity is None:
        return
    results["parity"] = {"tiny": parity}
    peak = results["matmul_peak"]["matmul_peak_flops"]
    # every shape's train step first (the figure an accelerator minute is spent on), then the
    # generation rows; the file is rewritten after each row, so a run cut short keeps what finished
    for shape in args.shapes:
        skip = None if on_cpu else gpu.train_state_fits(shape)
        if skip:
            results.setdefault("skipped", []).append({"name": "train_step_mfu", "size": shape, "why": skip})
            print(f"[train step {shape}] skipped: {skip}", flush=True)
        for form in () if skip or "train_step" not in args.only else args.attention:
            row = _attempt(errors, "train_step_mfu", shape, lambda: gpu.bench_train_mfu(
                shape, args.repeats, peak, batch=settings["batch"], seq=settings["seq"], dtype=settings["dtype"],
                attention=form, profile_dir=os.path.join(args.profile, f"{shape}-{form}") if args.profile else None))
            rows.extend([row] if row else [])
            gc.collect()  # a failed attempt's traceback may still hold its device buffers
            _write(args, results)
    for shape in args.shapes if "generation" in args.only else ():
        row = _attempt(errors, "generation", shape, lambda: gpu.bench_generation(
            shape, args.repeats, batch=8 if on_cpu else 64, dtype=settings["dtype"]))
        rows.extend([row] if row else [])
        _write(args, results)


def _path(args) -> str:
    memory = "" if args.baseline_host_memory == "default" else f"_baseline_{args.baseline_host_memory}_memory"
    return os.path.join(args.out_dir, f"{args.suite}{'_quick' if args.quick else ''}{memory}.json")


def _write(args, results: dict[str, Any]) -> str:
    path = _path(args)
    write_json(path, results)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="smoke run: one small shape, 2 repeats, 16 new tokens")
    parser.add_argument("--shapes", default=None, help="comma-separated shapes (default: the suite's)")
    parser.add_argument("--only", default=",".join(CPU_PARTS), help=f"comma-separated parts of {CPU_PARTS}")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per side (>= 5 unless --quick)")
    parser.add_argument("--out-dir", default=RESULTS_DIR)
    parser.add_argument("--readme", default=README, help="markdown file whose table is rewritten after a full run (default docs/benchmarks.md)")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--allow-cpu", action="store_true", help="gpu suite: run the tiny shape on the CPU")
    parser.add_argument("--attention", default="auto",
                        help="gpu suite: comma-separated attention forms of the train-step rows "
                             "(ModelConfig.attention: auto = packed blockwise, xla = dense masked, pallas = the fused packed kernel on CUDA)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="gpu suite: one more train step per row under jax.profiler.trace(DIR/<shape>-<attention>), "
                             "after the timed ones; its top ops by time go into the row (benchmarks.gpu.profile_step)")
    parser.add_argument("--baseline-host-memory", choices=["default", "jmarl"], default="default",
                        help="cpu suite: the PyTorch side's allocator: glibc's defaults, as its users run it "
                             "(default), or jmarl's host memory policy (jmarl.host_memory)")
    # internal: the child process of `run_part_isolated` (one part, one shape, rows to a file)
    parser.add_argument("--part", choices=CPU_PARTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peak-flops", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.only = tuple(p for p in args.only.split(",") if p)
    args.attention = tuple(a for a in args.attention.split(",") if a)
    unknown = set(args.only) - set(CPU_PARTS)
    if unknown:
        parser.error(f"--only: unknown parts {sorted(unknown)}; choose from {CPU_PARTS}")
    if args.shapes:
        args.shapes = tuple(args.shapes.split(","))
    elif args.suite == "cpu":
        args.shapes = ("cpu-small",) if args.quick else CPU_SHAPES
    else:
        from benchmarks.gpu import GPU_SHAPES

        args.shapes = GPU_SHAPES
    if args.part is not None and (args.part_out is None or args.peak_flops is None or len(args.shapes) != 1):
        parser.error("--part needs --part-out, --peak-flops and exactly one shape")
    if args.quick:
        args.repeats = min(args.repeats, 2)
    elif args.repeats < 5:
        parser.error("--repeats must be >= 5 for a reported run (use --quick for a smoke run)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.part is not None:
        return part_main(args)
    created, machine = utc_now(), machine_info()  # the date and load average at the start
    if args.suite == "gpu":
        from benchmarks import gpu

        if gpu.accelerator() is None:
            if not args.allow_cpu:
                print("benchmarks.run --suite gpu: no GPU/TPU backend in JAX (jax.default_backend() is "
                      f"{__import__('jax').default_backend()!r}); run it on an accelerator machine, or pass "
                      "--allow-cpu to smoke-test the code path on the tiny shape", file=sys.stderr)
                return 2
            args.shapes = gpu.tiny_cpu_settings()["shapes"]
        if gpu.accelerator() is None:  # the --allow-cpu smoke run computes in float32
            peak = measure_matmul_peak(n=1024) | {"dtype": "float32"}
        else:
            peak = gpu.measure_bf16_peak()
    else:
        peak = measure_matmul_peak() | {"dtype": "float32"}
    results: dict[str, Any] = {
        "suite": args.suite,
        "quick": args.quick,
        "created": created,
        "command": "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine,
        "versions": versions(),
        "git": git_state(),
        provenance.KEY: provenance.record("python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv)),
        "matmul_peak": peak,
        "rows": [],
        "errors": [],
    }
    print(f"[peak] {peak['matmul_peak_flops'] / 1e9:,.0f} GFLOP/s ({peak.get('dtype')})", flush=True)
    (run_gpu if args.suite == "gpu" else run_cpu)(args, results)
    results.update(results_end())
    path = _write(args, results)
    print(f"wrote {path}")
    if not args.quick and not args.no_readme and args.baseline_host_memory == "default":
        from benchmarks.table import update_readme

        try:
            update_readme(args.readme, results)
            print(f"updated the {args.suite} table in {args.readme}")
        except (OSError, ValueError) as e:
            print(f"README not updated: {e}", file=sys.stderr)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    from jmarl.host_memory import apply_on_cpu

    apply_on_cpu()  # jmarl's CPU host memory policy, before JAX starts (JMARL_KEEP_HOST_MEMORY=0: off)
    sys.exit(main())
