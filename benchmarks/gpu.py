"""The accelerator suite: 0.5B-8B shapes (random weights, bf16), train-step MFU and generation.

Run by `python -m benchmarks.run --suite gpu`. It needs a JAX GPU/TPU backend and refuses on a
CPU-only machine (`--allow-cpu` runs the `tiny` shape on the CPU instead, to check the code
path). Rows:

- `train_step_mfu` (per shape): jmarl's GRPO train step (`make_update` + AdamW, float32 masters and bf16
  matmuls, layer remat from 1.5B up) on `GPU_BATCH` x `GPU_SEQ` tokens; model FLOP/s =
  tokens/s x `train_flops_per_token`, MFU against the measured bf16 matmul peak (a large XLA
  matmul in the same run) and, where the device is known, against its nominal dense peak.
  `--attention auto,xla` adds a row per attention form; a shape whose full-parameter state does
  not fit device 0 is skipped with the reason (`train_state_fits`). `--profile DIR` runs one more
  step after the timed ones under `jax.profiler.trace(DIR/<shape>-<attention>)` (the timed
  figures are not profiled) and puts the trace's path and its top ops by time under the row's
  `profile` (`top_ops`: device ops where the trace has a device, else XLA:CPU's ops).
- `generation_vs_hf_generate`-style jmarl-only figure `generation_new_tokens_per_s` (batch 64,
  prompt 64, 64 new tokens) and, with CUDA PyTorch, HF `generate` beside it.

Parity is gated first on the `tiny` shape in fp32 on the same device (`benchmarks.parity`).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import statistics
import tempfile
from collections import defaultdict
from typing import Any, Callable

from benchmarks.common import (LR, NEW_TOKENS, PROMPT_LEN, SHAPES, Paired, hf_config, make_row, timed,
                               train_flops_per_token)

GPU_SHAPES = ("gpu-0.5b", "gpu-1.5b", "gpu-8b")
GPU_BATCH, GPU_SEQ = 16, 1024
# Nominal dense bf16 peaks (FLOP/s) by device kind substring.
NOMINAL_BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "v5p": 459e12, "v5e": 197e12,
                     "v6e": 918e12, "v4": 275e12}


def accelerator() -> str | None:
    """'gpu' / 'tpu' when JAX's default backend is an accelerator, else None."""
    import jax

    backend = jax.default_backend()
    return backend if backend in ("gpu", "tpu", "cuda", "rocm") else None


def nominal_peak() -> float | None:
    """The nominal dense bf16 peak of device 0, where its kind is known."""
    import jax

    kind = jax.devices()[0].device_kind
    for name, flops in NOMINAL_BF16_PEAK.items():
        if name.lower() in kind.lower():
            return flops
    return None


def measure_bf16_peak(n: int = 8192, repeats: int = 5) -> dict[str, Any]:
    """Best-of-`repeats` [n, n] x [n, n] bf16 matmul FLOP/s through XLA (f32 accumulation)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(mm(a, b))
    times = [timed(lambda: jax.block_until_ready(mm(a, b))) for _ in range(repeats)]
    return {"matmul_peak_flops": 2.0 * n**3 / min(times), "matmul_n": n, "dtype": "bfloat16"}


def jmarl_config(shape: str, dtype: str):
    """jmarl `ModelConfig` of a reference shape in `dtype` (remat from 1.5B parameters up)."""
    from jmarl.models.hf_config import config_from_hf

    config = config_from_hf(hf_config(shape).to_dict(), param_dtype=dtype, compute_dtype=dtype)
    return config.replace(remat=config.num_params() > 1.2e9)


TRAIN_BYTES_PER_PARAM = 16  # float32 master + gradient + AdamW's two moments


def train_state_fits(shape: str, dtype: str = "bfloat16") -> str | None:
    """None when a full-parameter update's state (TRAIN_BYTES_PER_PARAM bytes a parameter, before
    activations) fits device 0's memory, else why not (the row is then skipped, not run into an
    out-of-memory error that would hold the device's memory for the rows after it)."""
    import jax

    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    need = jmarl_config(shape, dtype).num_params() * TRAIN_BYTES_PER_PARAM
    if limit is None or need <= limit:
        return None
    return (f"a full-parameter update holds {need / 2**30:.0f} GiB of float32 masters, gradients and AdamW "
            f"moments; device 0 has {limit / 2**30:.0f} GiB (shard it over devices, or train LoRA adapters)")


def bench_train_mfu(shape: str, repeats: int, peak: float, *, batch: int = GPU_BATCH, seq: int = GPU_SEQ,
                    dtype: str = "bfloat16", attention: str = "auto", profile_dir: str | None = None) -> dict[str, Any]:
    """The `train_step_mfu` row: jmarl's jitted GRPO update on random weights, attention in the
    given form (`ModelConfig.attention`: auto = the packed blockwise kernel at these sizes, xla =
    dense masked scores). `profile_dir`: one more step, after the timed ones, under the JAX
    profiler (`profile_step`), summarised under the row's `profile`."""
    import jax
    import jax.numpy as jnp

    from benchmarks.parity import jmarl_loss_fn, make_batch
    from jmarl import models
    from jmarl.train.optim import make_optimizer
    from jmarl.train.step import init_train_state, jit_update, make_update

    config = jmarl_config(shape, dtype).replace(param_dtype="float32", attention=attention)  # fp32 masters, bf16 compute
    optimizer = make_optimizer(LR, total_steps=10**6, weight_decay=0.01, grad_clip=1.0)
    state = jax.jit(lambda k: init_train_state(models.init(config, k), optimizer))(jax.random.key(0))
    update = jit_update(make_update(jmarl_loss_fn(config), optimizer))
    # distinct prompts (group size 1): the packed layout then runs every token, so the
    # executed FLOPs are tokens x train_flops_per_token and MFU is not inflated by prompt sharing
    host = make_batch(config.vocab_size, batch, seq // 2, seq - seq // 2, group_size=1)
    device_batch = jax.device_put({k: jnp.asarray(v) for k, v in host.packed().items()})
    holder = {"state": state}

    def once() -> None:
        holder["state"], metrics = update(holder["state"], None, device_batch)
        jax.block_until_ready((holder["state"].params, metrics))

    first, warm = timed(once), timed(once)
    times = [timed(once) for _ in range(repeats)]
    tokens = float(batch * seq)
    fpt = train_flops_per_token(shape, seq)
    tps = [tokens / t for t in times]
    med = statistics.median(tps)
    row = {
        "name": "train_step_mfu", "metric": "train_tokens_per_s", "size": shape, "jmarl": med, "baseline": None,
        "ratio": None, "jmarl_min": min(tps), "jmarl_max": max(tps), "repeats": repeats,
        "jmarl_compile_s": max(first - warm, 0.0), "jmarl_seconds": times, "batch": batch, "seq_len": seq,
        "dtype": dtype, "attention": attention, "remat": config.remat, "params": config.num_params(), "flops_per_token": fpt,
        "jmarl_flops": med * fpt, "matmul_peak_flops": peak, "mfu": med * fpt / peak,
    }
    nominal = nominal_peak()
    if nominal:
        row["nominal_peak_flops"] = nominal
        row["mfu_vs_nominal"] = med * fpt / nominal
    print(f"[train step {shape}, attention {attention}] {med:,.0f} tok/s, {med * fpt / 1e12:.1f} TFLOP/s, MFU {100 * row['mfu']:.0f}% "
          f"(compile {row['jmarl_compile_s']:.0f}s)", flush=True)
    if profile_dir:
        row["profile"] = profile_step(once, profile_dir)
    return row


def profile_step(fn: Callable[[], None], directory: str, top: int = 15) -> dict[str, Any]:
    """Runs `fn()` (which blocks until its result is ready) once under `jax.profiler.trace(directory)`;
    returns {"dir", "trace": the trace.json.gz written, "top_ops": `top_ops` of it}, or {"dir",
    "error"} when the profiler fails (the row's figures stand either way)."""
    import jax

    try:
        with jax.profiler.trace(directory):
            fn()
        traces = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "*.trace.json.gz")),
                        key=os.path.getmtime)
        if not traces:
            return {"dir": directory, "error": "the profiler wrote no *.trace.json.gz"}
        out = {"dir": directory, "trace": traces[-1], **top_ops(traces[-1], top)}
    except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the measured row
        return {"dir": directory, "error": f"{type(e).__name__}: {e}"[:500]}
    for op in out["top_ops"][:5]:
        print(f"  [profile] {100 * op['fraction']:5.1f}% {op['total_us'] / 1e3:9.2f} ms x{op['count']:<5d} {op['op']}", flush=True)
    return out


def top_ops(trace_path: str, top: int = 15) -> dict[str, Any]:
    """The ops that took the most time in a JAX profiler trace (Chrome trace JSON, gzipped):
    {"selection": which events were counted, "total_us" (their summed durations), "events" (how
    many), "span_us" (first start to last end), "top_ops": [{"op", "total_us", "count",
    "fraction", "example"}]}, by summed duration. Counted: with a device process (`/device:GPU:0`,
    `/device:TPU:0`) its "XLA Ops" line where it has one, else its stream lines (kernels), else all
    of its events; on the CPU the events that name an `hlo_op` (XLA:CPU's thunks). An op is its
    `hlo_op` argument where the event has one, else the event's name (also inside a CUDA graph,
    whose kernels all name the graph's `command_buffer_N` as their op). A heuristic over the trace
    format, not the profiler's own op statistics (open the trace in Perfetto for those)."""
    with gzip.open(trace_path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    timed_events = [e for e in events if e.get("ph") == "X" and float(e.get("dur") or 0) > 0]
    device_pids = {pid for pid, name in processes.items()
                   if name.startswith("/device:") and not name.startswith("/device:CPU")}
    if device_pids:
        on_device = [e for e in timed_events if e.get("pid") in device_pids]

        def line(e: dict) -> str:
            return threads.get((e.get("pid"), e.get("tid")), "")

        chosen = [e for e in on_device if "xla ops" in line(e).lower()]
        selection = "device XLA Ops line"
        if not chosen:
            chosen = [e for e in on_device if "stream" in line(e).lower()]
            selection = "device stream lines (kernels)"
        if not chosen:
            chosen, selection = on_device, "all device events"
    else:
        chosen = [e for e in timed_events if isinstance(e.get("args"), dict) and "hlo_op" in e["args"]]
        selection = "host events naming an hlo_op (XLA:CPU)"
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0, ""])
    for e in chosen:
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        key = str(args.get("hlo_op") or e.get("name", "?"))
        if key.startswith("command_buffer"):  # a CUDA graph's kernels all carry its name: use the kernel's
            key = str(e.get("name", key))
        entry = totals[key]
        entry[0] += float(e["dur"])
        entry[1] += 1
        entry[2] = entry[2] or str(e.get("name", ""))
    total = sum(v[0] for v in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    span = (max(float(e["ts"]) + float(e["dur"]) for e in chosen) - min(float(e["ts"]) for e in chosen)) if chosen else 0.0
    return {"selection": selection, "total_us": total, "events": len(chosen), "span_us": span,
            "top_ops": [{"op": k, "total_us": v[0], "count": v[1], "fraction": v[0] / total if total else 0.0,
                         "example": v[2][:200]} for k, v in ranked]}


def bench_generation(shape: str, repeats: int, *, batch: int = 64, dtype: str = "bfloat16") -> dict[str, Any]:
    """jmarl new tokens/s at `batch` x (64 prompt + 64 new) tokens, EOS off; HF `generate`
    beside it when CUDA PyTorch is present."""
    import jax
    import numpy as np

    from jmarl import models

    config = jmarl_config(shape, dtype).replace(remat=False)
    params = jax.jit(lambda k: models.init(config, k))(jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(3, config.vocab_size, (batch // 8, PROMPT_LEN)), 8, axis=0).astype(np.int32)
    mask = np.ones_like(prompts, bool)

    def run_jmarl(i: int) -> float:
        def go():
            out = models.generate(config, params, prompts, mask, jax.random.key(i),
                                  models.GenerationSpec(max_new_tokens=NEW_TOKENS, temperature=1.0, stop_tokens=()))
            jax.block_until_ready(out.tokens)
        return timed(go)

    first, warm = run_jmarl(0), run_jmarl(1)
    jm = [run_jmarl(10 + r) for r in range(repeats)]
    base = _torch_generate_times(shape, prompts, repeats)
    work = float(batch * NEW_TOKENS)
    if base is not None:
        row = make_row("generation_vs_hf_generate", "new_tokens_per_s", shape, work,
                       Paired(jm, base[1], first, warm, base[0]), batch=batch, dtype=dtype)
    else:
        tps = [work / t for t in jm]
        row = {"name": "generation_new_tokens_per_s", "metric": "new_tokens_per_s", "size": shape,
               "jmarl": statistics.median(tps), "baseline": None, "ratio": None, "jmarl_min": min(tps),
               "jmarl_max": max(tps), "repeats": repeats, "jmarl_compile_s": max(first - warm, 0.0),
               "batch": batch, "dtype": dtype}
    print(f"[generation {shape}] jmarl {row['jmarl']:,.0f} new tok/s", flush=True)
    return row


def _torch_generate_times(shape: str, prompts, repeats: int):
    """(first-call seconds, [seconds]) of HF generate on CUDA, or None without a CUDA torch."""
    import torch
    import transformers

    if not torch.cuda.is_available():
        return None
    model = transformers.AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, dtype=torch.int64, device="cuda")

    def run() -> float:
        torch.cuda.synchronize()

        def go():
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               pad_token_id=0)
            torch.cuda.synchronize()
        return timed(go)

    return run(), [run() for _ in range(repeats)]


def gpu_parity() -> dict[str, float]:
    """The parity gate on the `tiny` shape, fp32, jmarl on the accelerator."""
    from benchmarks.common import write_checkpoint
    from benchmarks.parity import check_parity
    from jmarl.models import load_hf

    import jax

    with tempfile.TemporaryDirectory() as d:
        torch_model = write_checkpoint("tiny", d, tokenizer=False)
        config, params = load_hf(d)
    with jax.default_matmul_precision("highest"):  # no TF32: the gate compares fp32 functions
        return check_parity(torch_model, config, params, prompt_len=32, new_tokens=32)


def tiny_cpu_settings() -> dict[str, Any]:
    """Settings of the `--allow-cpu` smoke run (the `tiny` shape, small batch)."""
    assert "tiny" in SHAPES
    return {"shapes": ("tiny",), "batch": 4, "seq": 64, "dtype": "float32"}
