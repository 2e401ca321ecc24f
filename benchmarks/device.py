"""The one prepared accelerator command: tests, GPU suite and a real-model GRPO run, in one budget.

    python -m benchmarks.device --out-dir DIR --model-path .device_model/smollm2.gguf   # on a GPU / TPU
    python -m benchmarks.device --dry-run --out-dir /tmp/device-dry                    # the CPU: proves it starts

An accelerator is lent only at times, for about 15 minutes in all, so this runs what needs one in
at most `--budget-s` seconds (540 by default), as four stages, each a subprocess of its own:

1. `tests` (share 60 s): the GPU-relevant tests under pytest on the accelerator (`JAX_PLATFORMS`
   left to JAX): bf16 and float32 parity with PyTorch (tests/test_model.py), the attention kernels
   against transformers and each other (tests/test_attention.py, tests/test_packed_attention.py)
   and, where JAX sees >= 8 devices, the sharded update, sampling and checkpoints
   (tests/test_sharding.py; with fewer they are listed as not run, with the reason). Ordered by
   priority: a stage cut at its time limit keeps the results of the tests that ran.
2. `gpu_suite` (share 270 s): `python -m benchmarks.run --suite gpu --shapes gpu-0.5b,gpu-1.5b
   --attention pallas,auto --profile DIR`: parity gate, train-step MFU at 0.5B and 1.5B with the
   fused packed kernel and with the blockwise form, generation beside HF `generate`, one profiled
   train step per row (top ops in each row); it writes its own gpu.json.
3. `torch` (share 90 s): `benchmarks.gpu_torch`, the same train step in PyTorch on the same card
   (bf16 autocast, SDPA, fused AdamW; eager and `torch.compile`), JAX kept off the GPU; torch.json.
4. `train` (share 120 s): the real-model recipe, `python -m jmarl.run --config
   configs/real/grpo_add_full.yaml` on SmolLM2-135M-Instruct (`--model-path`), bf16 compute,
   `--steps` GRPO steps (40), 128 held-out problems before and after; summarised in train.json:
   held-out success before / after, the rollout success of every step (the learning curve),
   truncation and step times. A run cut at its time limit keeps the steps it logged.

A stage's time limit is its share of the budget (scaled with `--budget-s`) plus whatever the
stages before it left unused, never more than the budget has left; a stage for which less than
20 s is left is not run, and is recorded as such. Each stage's status (passed, failed, timeout,
not_run with the reason, error: this command's own failure), exit code, wall time, output tail
and the path of its JSON go into `<out-dir>/device.json` (rewritten after every stage, so that a
command killed from outside still leaves what finished), with the device's name, the JAX version
and a `jmarl.provenance` record (the commit). Every JSON written here carries that record under
`provenance` (in a copy of the tree without .git, `JMARL_COMMIT` and `JMARL_DIRTY=1` stand in for
git's answer). Files in `<out-dir>` (at most eight, what the device tool brings back): device.json,
tests.json, gpu.json, torch.json, train.json, device.log (every stage's output) and the profiled
steps' traces (profile-<shape>-<attention>.trace.json.gz, at most two, cut to their kernel
events, each under 16 MiB); checkpoints, the profiler's folders and pytest's files stay in
`--work-dir` (a new temporary folder by default), outside `<out-dir>`.

On a machine where JAX sees no accelerator it refuses (exit 2) unless `--dry-run`. `--dry-run`
runs the same four stages small: three quick tests, the GPU suite's tiny shape (`--allow-cpu
--shapes tiny`), PyTorch's eager step on it, and 2 GRPO steps of a one-layer random model (character tokenizer) with 8
held-out problems; with `--model-path` the dry run trains that model instead (still small).

The model file: the device machine reaches no network, so SmolLM2's GGUF travels with the
working tree. `--model-path P` takes a file, or, where there is none at P, the parts `P.part*`
(joined in name order into the work folder and checked against the pinned sha256 of
`jmarl.models.fetch`): the GGUF (94 MiB) is larger than one device call carries, so it is split in
two, carried in two calls, the first part kept outside the working tree in between
(docs/benchmarks.md, "The one-shot device command"). Without `--model-path` it looks for
`.device_model/smollm2.gguf` (or its parts), then the jmarl model cache; with none of them the
train stage is recorded as not run.

Exit status: 0 when every stage passed, 1 when one failed, timed out or did not run, 2 when it
refused to start.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.device_report import kernel_trace
from jmarl import provenance
from jmarl.models import fetch as fetch_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/real/grpo_add_full.yaml"
MODEL_NAME = "smollm2-135m-instruct"  # jmarl.models.fetch's name of SmolLM2-135M-Instruct
DEFAULT_MODEL_PATH = ".device_model/smollm2.gguf"  # where docs/benchmarks.md puts it (or its parts)
BUDGET_S = 540.0
STAGES = ("tests", "gpu_suite", "torch", "train")
SHARES = {"tests": 60.0, "gpu_suite": 270.0, "torch": 90.0, "train": 120.0}  # seconds of a BUDGET_S budget
MIN_STAGE_S = 20.0  # a stage with less left is not started
TAIL_CHARS = 4000
STEPS, DRY_STEPS = 40, 2
GPU_SHAPES = ("gpu-0.5b", "gpu-1.5b")
GPU_ATTENTION = "pallas,auto"  # the fused packed kernel beside the blockwise form it replaces
MAX_TRACES, MAX_TRACE_BYTES = 2, 16 * 2**20  # kernel events only (benchmarks.device_report.kernel_trace)
DEVICES_FOR_SHARDING = 8

# GPU-relevant tests, most wanted first (a stage cut at its limit keeps what ran)
ACCELERATOR_TESTS = (
    "tests/test_model.py::test_bfloat16_path_stays_close",
    "tests/test_model.py::test_token_logprobs_and_gradient_match_pytorch",
    "tests/test_attention.py::test_long_sequences_match_transformers_with_left_and_right_padding",
    "tests/test_attention.py::test_blockwise_equals_dense_values_and_gradients",
    "tests/test_attention.py::test_prefixed_attention_equals_attention_over_joined_keys",
    "tests/test_attention.py::test_blockwise_gradient_temporaries_stay_far_below_the_score_matrix",
    "tests/test_packed_attention.py",
    "tests/test_splash_kernel.py",  # on a TPU the compiled splash kernels, elsewhere the Pallas interpreter
    "tests/test_attention.py::test_remat_policies_give_equal_gradients",  # over 100 s on an H200: last
)
SHARDING_TESTS = (  # meshes of 8 devices
    "tests/test_sharding.py::test_sharded_update_equals_single_device",
    "tests/test_sharding.py::test_sharded_lora_update_with_frozen_base",
    "tests/test_sharding.py::test_sharded_greedy_sampling_matches_unsharded",
    "tests/test_sharding.py::test_checkpoint_restores_into_target_shardings",
    "tests/test_sharding.py::test_device_bytes_matches_real_shards_and_abstract_states",
)
DRY_TESTS = (
    "tests/test_attention.py::test_unknown_form_is_a_clear_error",
    "tests/test_packed_attention.py::test_segment_bounds",
    "tests/test_sharding.py::test_param_specs_every_family",
)
# the dry run's model: the one-layer preset of the run-level tests, with the character tokenizer
TINY_PRESET = "{model_type: qwen3, hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 1}"
DRY_RUN_OVERRIDES = ("eval.num_episodes=8", "workflow.num_tasks=2", "workflow.group_size=4",
                     "sampling.max_new_tokens=16")
CURVE_KEYS = {  # metrics.jsonl key -> train.json curve field
    "rollout/success_rate": "success_rate", "rollout/reward_mean": "reward_mean",
    "rollout/truncated_fraction": "truncated_fraction", "rollout/completion_length_mean": "completion_length_mean",
    "rollout/signal_group_fraction": "signal_group_fraction", "train/loss": "loss", "train/grad_norm": "grad_norm",
    "time/step": "step_s", "time/generate": "generate_s", "time/update": "update_s",
}
# modules each stage cannot start without (checked before spending device time on it)
NEEDS = {"tests": ("pytest", "torch", "transformers"), "gpu_suite": ("torch", "transformers"),
         "torch": ("torch", "transformers"), "train": ()}
JMARL_NEEDS = ("jax", "flax", "optax", "orbax.checkpoint", "chex", "numpy", "transformers", "safetensors",
               "yaml", "tqdm")

PROBE = r"""
import importlib.metadata as md, json
import jax
from benchmarks.device_report import kernel_trace
from jmarl import provenance
devices = jax.devices()
try:
    jaxlib = md.version("jaxlib")
except md.PackageNotFoundError:
    jaxlib = None
out = {"backend": jax.default_backend(), "platform": devices[0].platform, "name": devices[0].device_kind,
       "count": len(devices), "jax": jax.__version__, "jaxlib": jaxlib, "machine": provenance.machine()}
try:
    from jmarl.models import fetch
    pin, cached = fetch.MODELS[%r], fetch.cached_path(%r)
    out["model_pin"] = {"filename": pin.filename, "sha256": pin.sha256, "size": pin.size}
    out["cached_model"] = str(cached) if cached.exists() else None
except Exception as e:
    out["model_pin_error"] = f"{type(e).__name__}: {e}"
print("JMARL_PROBE " + json.dumps(out))
""" % (MODEL_NAME, MODEL_NAME)


# ------------------------------------------------------------------------------------------ helpers
def _now() -> str:
    return provenance.utc_now()


def _write_json(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _tail(path: str, chars: int = TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """Those of `names` this interpreter cannot import (found without importing them)."""
    out = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def stage_timeouts(budget_s: float) -> dict[str, float]:
    """Each stage's share of a `budget_s` budget (SHARES, scaled from BUDGET_S)."""
    return {name: SHARES[name] * budget_s / BUDGET_S for name in STAGES}


def stage_limit(name: str, remaining_s: float, runnable: list[str], budget_s: float) -> float:
    """The time limit of stage `name` with `remaining_s` of the budget left: its share, plus what
    is left beyond the shares of the stages after it that will run (`runnable`, in order), at
    most `remaining_s`."""
    shares = stage_timeouts(budget_s)
    later = runnable[runnable.index(name) + 1:] if name in runnable else []
    return max(0.0, min(remaining_s, max(shares[name], remaining_s - sum(shares[s] for s in later))))


def run_logged(cmd: list[str], timeout_s: float, log_path: str, env: dict[str, str], label: str,
               combined_log: Any = None) -> dict[str, Any]:
    """Runs `cmd` (in the repository root, a process session of its own) for at most `timeout_s`,
    its output to `log_path`, to `combined_log` and to this terminal (each line prefixed with
    `[label]`). Returns {"exit_code", "timed_out", "wall_s", "output_tail"}; at the limit the
    process group is sent SIGTERM, then SIGKILL 10 s later."""
    start = time.monotonic()
    with open(log_path, "w", errors="replace") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1, start_new_session=True)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if combined_log is not None:
                    combined_log.write(f"[{label}] {line}")
                sys.stdout.write(f"[{label}] {line}")
                sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            code = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)  # the stage's own process group (start_new_session)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            code = proc.returncode
        reader.join(timeout=10.0)
    return {"exit_code": code, "timed_out": timed_out, "wall_s": round(time.monotonic() - start, 1),
            "output_tail": _tail(log_path)}


def probe_device(timeout_s: float = 180.0) -> dict[str, Any]:
    """JAX's device, seen from a child process (so that this one never holds the accelerator):
    backend, platform, name, count, jax / jaxlib versions, `provenance.machine()`, the pinned
    model file's name / sha256 / size and the cached model's path; {"error"} if JAX cannot start."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"JAX did not start within {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("JMARL_PROBE "):
            return json.loads(line[len("JMARL_PROBE "):])
    return {"error": f"JAX could not start (exit {done.returncode}): {(done.stderr or done.stdout)[-2000:]}"}


def is_accelerator(probe: dict[str, Any]) -> bool:
    return "error" not in probe and probe.get("platform") not in (None, "cpu")


def resolve_model(path: str | None, dry_run: bool, probe: dict[str, Any], work_dir: str) -> dict[str, Any]:
    """What the train stage trains: {"preset": ...} (the dry run without a model path), or
    {"path", "size", "sha256", "pinned"} of a model file (a file at `path`, or its parts
    `path.part*` joined into `work_dir`), or {"why"} when there is none to train."""
    if path is None and dry_run:
        return {"preset": TINY_PRESET, "tokenizer": "char"}
    pin = probe.get("model_pin") or {}
    candidates = [path] if path else [os.path.join(REPO_ROOT, DEFAULT_MODEL_PATH), probe.get("cached_model")]
    for candidate in (c for c in candidates if c):
        candidate = os.path.abspath(os.path.expanduser(candidate))
        info: dict[str, Any] = {}
        if os.path.isdir(candidate):
            return {"path": candidate}  # a Hugging Face checkpoint folder
        if not os.path.isfile(candidate):
            parts = sorted(glob.glob(glob.escape(candidate) + ".part*"))
            if not parts:
                continue
            joined = os.path.join(work_dir, os.path.basename(candidate))
            with open(joined, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 20)
            info["parts"] = parts
            candidate = joined
        info.update(path=candidate, size=os.path.getsize(candidate), sha256=fetch_lib.sha256_of(candidate))
        info["pinned"] = info["sha256"] == pin.get("sha256")
        if "parts" in info and not info["pinned"]:
            return {"why": f"the parts {info['parts']} join to {info['size']:,} bytes with sha256 "
                           f"{info['sha256'][:16]}..., not the pinned {MODEL_NAME} file ({pin.get('size', 0):,} bytes, "
                           f"{str(pin.get('sha256'))[:16]}...): a part is missing or damaged (each call must carry "
                           "one part while the machine stays warm, docs/benchmarks.md)"}
        return info
    where = path or f"{DEFAULT_MODEL_PATH} (or its .part* files) or the jmarl model cache"
    return {"why": f"no model file at {where}; copy SmolLM2's GGUF into the tree and pass --model-path "
                   "(docs/benchmarks.md, 'The one-shot device command')"}


# ------------------------------------------------------------------------------------------ stages
TEST_LINE = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def tests_stage(ctx: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """pytest on the GPU-relevant tests (`ACCELERATOR_TESTS`, `SHARDING_TESTS` with >= 8 devices;
    `DRY_TESTS` in a dry run); tests.json lists each test's outcome."""
    probe, dry = ctx["probe"], ctx["dry_run"]
    deselected = {}
    if dry:
        selected = list(DRY_TESTS)
    else:
        selected = list(ACCELERATOR_TESTS)
        if (probe.get("count") or 0) >= DEVICES_FOR_SHARDING:
            selected += SHARDING_TESTS
        else:
            deselected = {t: f"needs {DEVICES_FOR_SHARDING} devices; JAX sees {probe.get('count')}" for t in SHARDING_TESTS}
    env = dict(ctx["env"])
    if is_accelerator(probe):
        env["JAX_PLATFORMS"] = ""  # tests/conftest.py would default it to cpu; "" lets JAX take the accelerator
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-o", "addopts=", "-ra", "--durations=15",
           f"--basetemp={os.path.join(ctx['work_dir'], 'pytest')}", *selected]
    got = run_logged(cmd, limit_s, os.path.join(ctx["work_dir"], "tests.log"), env, "tests", ctx["log"])
    outcomes = []
    with open(os.path.join(ctx["work_dir"], "tests.log"), errors="replace") as f:
        for line in f:
            m = TEST_LINE.match(line.strip())
            if m:
                outcomes.append({"test": m.group(1), "outcome": m.group(2).lower()})
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
    failed = [o["test"] for o in outcomes if o["outcome"] in ("failed", "error")]
    summary = {"counts": counts, "failed": failed}
    data = {**ctx["header"]("tests", cmd), **got, "selected": selected, "not_run": deselected, "tests": outcomes, **summary}
    return {**got, "command": cmd, "json": "tests.json", "data": data, "summary": summary,
            "status": _status(got, ok=got["exit_code"] == 0)}


def gpu_stage(ctx: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """`benchmarks.run --suite gpu` (profiled), its gpu.json written straight to the out-dir."""
    dry, out_dir = ctx["dry_run"], ctx["out_dir"]
    cmd = [sys.executable, "-m", "benchmarks.run", "--suite", "gpu", "--repeats", "5", "--no-readme",
           "--out-dir", out_dir]
    cmd += ["--allow-cpu", "--shapes", "tiny"] if dry else ["--shapes", ",".join(GPU_SHAPES), "--attention", GPU_ATTENTION]
    if ctx["profile_dir"]:
        cmd += ["--profile", ctx["profile_dir"]]
    gpu_json = os.path.join(out_dir, "gpu.json")
    if os.path.exists(gpu_json):
        os.remove(gpu_json)  # an older run's file must not pass for this one's
    got = run_logged(cmd, limit_s, os.path.join(ctx["work_dir"], "gpu_suite.log"), ctx["env"], "gpu_suite", ctx["log"])
    summary: dict[str, Any] = {"rows": [], "errors": [], "skipped": [], "traces": []}
    if os.path.exists(gpu_json):
        with open(gpu_json) as f:
            results = json.load(f)
        # the uniform fields of this command's JSONs, and the commit where the tree has no .git
        results.setdefault("device", ctx["device"])
        results.setdefault("jax_version", ctx["probe"].get("jax"))
        prov = results.get(provenance.KEY) or {}
        if not prov.get("commit") and ctx["base"].get("commit"):
            results[provenance.KEY] = {**prov, **{k: ctx["base"][k] for k in ("commit", "dirty", "diff", "commit_from")
                                                  if k in ctx["base"]}}
        _write_json(gpu_json, results)
        for row in results.get("rows", []):
            short = {k: row.get(k) for k in ("name", "size", "attention", "metric", "jmarl", "baseline", "ratio", "mfu",
                                             "mfu_vs_nominal", "jmarl_compile_s") if row.get(k) is not None}
            profile = row.get("profile") or {}
            if profile.get("top_ops"):
                short["top_ops"] = [{"op": o["op"], "fraction": round(o["fraction"], 4)} for o in profile["top_ops"][:5]]
            elif profile.get("error"):
                short["profile_error"] = profile["error"]
            trace = profile.get("trace")
            if trace and len(summary["traces"]) < MAX_TRACES:
                name = f"profile-{row.get('size')}-{row.get('attention')}.trace.json.gz"
                kernel_trace(trace, os.path.join(out_dir, name))
                if os.path.getsize(os.path.join(out_dir, name)) <= MAX_TRACE_BYTES:
                    summary["traces"].append(name)
                else:
                    os.remove(os.path.join(out_dir, name))
            summary["rows"].append(short)
        summary["errors"] = results.get("errors", [])
        summary["skipped"] = results.get("skipped", [])
        summary["matmul_peak_flops"] = (results.get("matmul_peak") or {}).get("matmul_peak_flops")
    ok = got["exit_code"] == 0 and bool(summary["rows"])
    return {**got, "command": cmd, "json": "gpu.json" if os.path.exists(gpu_json) else None, "summary": summary,
            "status": _status(got, ok=ok)}


def _read_metrics(path: str) -> list[dict[str, Any]]:
    records = []
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by the time limit
    except OSError:
        pass
    return records


def summarise_run(run_dir: str, steps: int) -> dict[str, Any]:
    """train.json's figures from a run's summary.json and metrics.jsonl: held-out success before /
    after (None when the run did not get there), the per-step curve, truncation."""
    summary: dict[str, Any] = {}
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, json.JSONDecodeError):
        pass
    records = _read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    curve = [{"step": r["step"], **{short: r[key] for key, short in CURVE_KEYS.items() if key in r}}
             for r in records if "rollout/success_rate" in r]
    evals = [{"step": r["step"], "success_rate": r["eval/success_rate"]} for r in records if "eval/success_rate" in r]
    before, after = summary.get("success_before"), summary.get("success_after")
    truncation = [c["truncated_fraction"] for c in curve if isinstance(c.get("truncated_fraction"), (int, float))]
    return {
        "steps_requested": steps, "steps_done": max((c["step"] for c in curve), default=0),
        "success_before": before, "success_after": after,
        "success_change": after - before if isinstance(before, (int, float)) and isinstance(after, (int, float)) else None,
        "eval": evals, "curve": curve,
        "truncated_fraction_first": truncation[0] if truncation else None,
        "truncated_fraction_last": truncation[-1] if truncation else None,
        "run_summary": summary,
    }


def train_overrides(run_dir: str, model: dict[str, Any], steps: int, dry_run: bool) -> list[str]:
    """The `key=value` overrides of `CONFIG` the train stage runs with (`resolve_model`'s `model`)."""
    out = [f"output_dir={run_dir}", f"train.steps={steps}", "logging.progress=false", "logging.plots=false",
           "logging.tensorboard=false", "checkpoint.every=0"]
    if "preset" in model:
        out += ["model.path=null", f"model.preset={model['preset']}", f"tokenizer={model['tokenizer']}"]
    else:
        out += [f"model.path={model['path']}"]
    if dry_run:
        return out + list(DRY_RUN_OVERRIDES)
    return out + ["model.compute_dtype=bfloat16", "eval.num_episodes=128"]


def torch_stage(ctx: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """`benchmarks.gpu_torch`: the GPU suite's train step in PyTorch on the same card (eager and
    compiled), JAX kept off the GPU so that PyTorch has all of it; torch.json."""
    dry = ctx["dry_run"]
    out = os.path.join(ctx["work_dir"], "torch.json")
    cmd = [sys.executable, "-m", "benchmarks.gpu_torch", "--out", out]
    cmd += ["--allow-cpu", "--modes", "eager", "--repeats", "2"] if dry else ["--shapes", ",".join(GPU_SHAPES)]
    env = dict(ctx["env"], JAX_PLATFORMS="cpu")
    got = run_logged(cmd, limit_s, os.path.join(ctx["work_dir"], "torch.log"), env, "torch", ctx["log"])
    data = None
    if os.path.exists(out):
        with open(out) as f:
            data = json.load(f)
        data = {**ctx["header"]("torch", cmd), **data, provenance.KEY: {**data.get(provenance.KEY, {}),
                                                                       **{k: ctx["base"][k] for k in ("commit", "dirty")
                                                                          if ctx["base"].get(k) is not None}}}
    rows = (data or {}).get("rows", [])
    summary = {"rows": [{k: r.get(k) for k in ("name", "size", "baseline", "mfu_vs_nominal", "baseline_compile_s")}
                        for r in rows], "errors": (data or {}).get("errors", [])}
    return {**got, "command": cmd, "json": "torch.json" if data else None, "data": data, "summary": summary,
            "status": _status(got, ok=got["exit_code"] == 0 and bool(rows))}


def train_stage(ctx: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """The real-model GRPO recipe (`CONFIG`), small in a dry run; train.json summarises it."""
    model, steps = ctx["model"], ctx["steps"]
    run_dir = os.path.join(ctx["work_dir"], "train")
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier run's summary.json must not pass for this one's
    cmd = [sys.executable, "-m", "jmarl.run", "--config", CONFIG, *train_overrides(run_dir, model, steps, ctx["dry_run"])]
    got = run_logged(cmd, limit_s, os.path.join(ctx["work_dir"], "train.log"), ctx["env"], "train", ctx["log"])
    summary = summarise_run(run_dir, steps)
    data = {**ctx["header"]("train", cmd), **got, "model": model, "config": CONFIG, **summary}
    short = {k: summary[k] for k in ("steps_requested", "steps_done", "success_before", "success_after",
                                     "success_change", "truncated_fraction_first", "truncated_fraction_last")}
    short["rollout_success_per_step"] = [c.get("success_rate") for c in summary["curve"]]
    ok = got["exit_code"] == 0 and summary["success_after"] is not None
    return {**got, "command": cmd, "json": "train.json", "data": data, "summary": short, "status": _status(got, ok=ok)}


def _status(got: dict[str, Any], ok: bool) -> str:
    return "timeout" if got["timed_out"] else "passed" if ok else "failed"


RUNNERS = {"tests": tests_stage, "gpu_suite": gpu_stage, "torch": torch_stage, "train": train_stage}


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="everything small (tiny shapes, 2 RL steps, three quick tests): proves the command "
                             "starts; runs on a CPU")
    parser.add_argument("--out-dir", default=None,
                        help="where device.json and the stage JSONs go (default benchmarks/results/device; "
                             "a temporary folder with --dry-run)")
    parser.add_argument("--work-dir", default=None,
                        help="checkpoints, profiler folders, logs, pytest's files (default: a new temporary folder)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for all stages together (540)")
    parser.add_argument("--model-path", default=None,
                        help="SmolLM2-135M-Instruct's GGUF (or P.part* files, joined); default "
                             f"{DEFAULT_MODEL_PATH}, then the jmarl model cache")
    parser.add_argument("--steps", type=int, default=None, help=f"GRPO steps of the train stage ({STEPS}; {DRY_STEPS} dry)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="where the GPU suite's profiler traces go (default <work-dir>/profile)")
    parser.add_argument("--no-profile", action="store_true", help="no profiled train step")
    parser.add_argument("--only", default=",".join(STAGES), help=f"comma-separated stages of {STAGES}")
    args = parser.parse_args(argv)
    args.only = tuple(s for s in args.only.split(",") if s)
    unknown = set(args.only) - set(STAGES)
    if unknown:
        parser.error(f"--only: unknown stages {sorted(unknown)}; choose from {STAGES}")
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")
    if args.steps is None:
        args.steps = DRY_STEPS if args.dry_run else STEPS
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    command = "python -m benchmarks.device " + " ".join(sys.argv[1:] if argv is None else argv)
    probe = probe_device()
    if not is_accelerator(probe) and not args.dry_run:
        why = probe.get("error") or f"JAX's devices are {probe.get('platform')!r} ({probe.get('name')})"
        print(f"benchmarks.device: no GPU/TPU: {why}. This command spends accelerator minutes; run it on an "
              "accelerator machine, or pass --dry-run to check on the CPU that it starts (tiny shapes).",
              file=sys.stderr)
        return 2
    if "error" in probe:  # a dry run goes on without JAX's figures; its stages will say what failed
        print(f"benchmarks.device: {probe['error']}", file=sys.stderr)
    out_dir = os.path.abspath(args.out_dir or (tempfile.mkdtemp(prefix="jmarl-device-dry-") if args.dry_run
                                               else os.path.join(REPO_ROOT, "benchmarks", "results", "device")))
    work_dir = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="jmarl-device-work-"))
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(work_dir, exist_ok=True)

    # one record for every JSON written here, taken now (this process never starts JAX: the
    # accelerator is the stages'); its machine is the probe's, the accelerator's name
    base = provenance.record(command)
    if probe.get("machine"):
        base["machine"] = probe["machine"]
    if not base.get("commit") and os.environ.get("JMARL_COMMIT"):  # a copy of the tree without .git
        base.update(commit=os.environ["JMARL_COMMIT"], dirty=os.environ.get("JMARL_DIRTY", "0") not in ("", "0"),
                    commit_from="JMARL_COMMIT")
    device = {k: probe.get(k) for k in ("name", "platform", "backend", "count")}

    def header(stage: str, cmd: list[str]) -> dict[str, Any]:
        line = " ".join(cmd[1:] if cmd and cmd[0] == sys.executable else cmd)
        return {"stage": stage, "device": device, "jax_version": probe.get("jax"), "dry_run": args.dry_run,
                "xla_flags": os.environ.get("XLA_FLAGS"), provenance.KEY: {**base, "command": f"python {line}", "date": _now()}}

    missing = missing_modules(JMARL_NEEDS + tuple(m for s in args.only for m in NEEDS[s]))
    result: dict[str, Any] = {
        "command": command, "dry_run": args.dry_run, "budget_s": args.budget_s, "started": _now(),
        "device": device, "device_name": probe.get("name"), "jax_version": probe.get("jax"),
        "jaxlib_version": probe.get("jaxlib"), "xla_flags": os.environ.get("XLA_FLAGS"), provenance.KEY: base,
        "probe_error": probe.get("error"), "missing_modules": missing, "out_dir": out_dir, "work_dir": work_dir, "stages": [],
    }
    device_json = os.path.join(out_dir, "device.json")
    _write_json(device_json, result)
    print(f"[device] {probe.get('machine') or probe.get('error')}; JAX {probe.get('jax')}; commit {base.get('commit')}"
          f"{' (dirty)' if base.get('dirty') else ''}; budget {args.budget_s:.0f} s; out {out_dir}; work {work_dir}",
          flush=True)

    model = resolve_model(args.model_path, args.dry_run, probe, work_dir) if "train" in args.only else {}
    blocked: dict[str, str] = {}
    for stage in STAGES:
        if stage not in args.only:
            blocked[stage] = "not selected (--only)"
        elif [m for m in NEEDS[stage] if m in missing]:
            blocked[stage] = f"missing Python packages: {', '.join(m for m in NEEDS[stage] if m in missing)}"
    if "train" in args.only and "why" in model:
        blocked["train"] = model["why"]
    elif "train" in args.only and str(model.get("path", "")).endswith(".gguf") and missing_modules(("gguf",)):
        blocked["train"] = "missing Python package: gguf (to read the GGUF model; carry its wheel, docs/benchmarks.md)"
    runnable = [s for s in STAGES if s not in blocked]
    profile_dir = None if args.no_profile else os.path.abspath(args.profile or os.path.join(work_dir, "profile"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(os.path.join(out_dir, "device.log"), "w", errors="replace") as log:
        ctx = {"probe": probe, "dry_run": args.dry_run, "out_dir": out_dir, "work_dir": work_dir, "env": env,
               "log": log, "header": header, "base": base, "device": device, "model": model, "steps": args.steps,
               "profile_dir": profile_dir}
        for stage in STAGES:
            entry: dict[str, Any] = {"name": stage}
            remaining = deadline - time.monotonic()
            limit = stage_limit(stage, remaining, runnable, args.budget_s)
            if stage in blocked:
                entry.update(status="not_run", why=blocked[stage])
            elif limit < MIN_STAGE_S:
                entry.update(status="not_run", why=f"budget spent: {limit:.0f} s for it (under {MIN_STAGE_S:.0f} s), "
                                                   f"{max(remaining, 0):.0f} s of {args.budget_s:.0f} left")
            else:
                print(f"[device] stage {stage}: limit {limit:.0f} s", flush=True)
                began = time.monotonic()
                try:
                    got = RUNNERS[stage](ctx, limit)
                    data = got.pop("data", None)
                    if data is not None:
                        _write_json(os.path.join(out_dir, got["json"]), data)
                except Exception as e:  # noqa: BLE001 - this command's own failure must not cost the later stages
                    got = {"status": "error", "error": f"{type(e).__name__}: {e}"[:1000], "exit_code": None,
                           "wall_s": round(time.monotonic() - began, 1)}
                entry.update(status=got.pop("status"), limit_s=round(limit, 1), **got)
                print(f"[device] stage {stage}: {entry['status']} (exit {entry['exit_code']}) in {entry['wall_s']:.0f} s",
                      flush=True)
            result["stages"].append(entry)
            if stage == "train":
                result["model"] = model
            result["wall_s"] = round(time.monotonic() - start, 1)
            _write_json(device_json, result)
    result["not_run"] = [s["name"] for s in result["stages"] if s["status"] == "not_run"]
    result["passed"] = all(s["status"] == "passed" for s in result["stages"] if s["name"] in args.only)
    result["ended"] = _now()
    result["wall_s"] = round(time.monotonic() - start, 1)
    _write_json(device_json, result)
    print(f"[device] {'all stages passed' if result['passed'] else 'not all stages passed'}: "
          + ", ".join(f"{s['name']} {s['status']}" for s in result["stages"]) + f"; wrote {device_json}", flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
