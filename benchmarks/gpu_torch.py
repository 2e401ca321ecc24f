"""The GPU suite's train step in PyTorch on the same card: the baseline of `train_step_mfu`.

    JAX_PLATFORMS=cpu python -m benchmarks.gpu_torch --out torch.json [--shapes gpu-0.5b,gpu-1.5b]
        [--modes eager,compile] [--repeats 5] [--allow-cpu]

The same GRPO step as `benchmarks.gpu.bench_train_mfu` (GPU_BATCH x GPU_SEQ tokens of distinct
prompts, `benchmarks.parity.make_batch(group_size=1)`, the GRPO loss, global-norm clipping at 1.0,
AdamW) on the `transformers` model of the shape with random weights: float32 masters under bf16
autocast, SDPA attention (flash on CUDA), fused AdamW, activation checkpointing where jmarl remats
the layers (1.5B up), the batch as plain [rows, tokens]; eager, and with the loss under
`torch.compile`. Run in a process of its own with JAX kept off the GPU (`JAX_PLATFORMS=cpu`), so
that PyTorch has the whole card (JAX takes most of it when it starts). Rows `train_step_torch_<mode>`
with tokens/s and model FLOP/s (`train_flops_per_token`, as jmarl's row) against the nominal peak;
a shape or mode that fails (out of memory, a compile error) is recorded under `errors`.
`--allow-cpu` runs the `tiny` shape on the CPU, to check the code path.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
from typing import Any

from benchmarks.common import LR, timed, train_flops_per_token

MODES = ("eager", "compile")


def bench_torch_train(shape: str, repeats: int, mode: str, *, batch: int, seq: int, device: str) -> dict[str, Any]:
    """The `train_step_torch_<mode>` row of `shape` on `device` ("cuda", or "cpu" for a check)."""
    import torch
    import transformers

    from benchmarks.gpu import NOMINAL_BF16_PEAK, jmarl_config
    from benchmarks.common import hf_config
    from benchmarks.parity import make_batch, torch_batch, torch_loss_of

    remat = jmarl_config(shape, "bfloat16").remat not in (False, None, "none")
    config = hf_config(shape)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(device).train()
    if remat:  # transformers 5.2x renamed it
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    host = make_batch(config.vocab_size, batch, seq // 2, seq - seq // 2, group_size=1)
    tb = {k: v.to(device) for k, v in torch_batch(host).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                  fused=device == "cuda")
    loss_of = functools.partial(torch_loss_of, model)
    if mode == "compile":
        loss_of = torch.compile(loss_of)
    autocast = torch.autocast(device, dtype=torch.bfloat16)

    def once() -> None:
        with autocast:
            loss = loss_of(tb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    first, warm = timed(once), timed(once)
    times = [timed(once) for _ in range(repeats)]
    tokens = float(batch * seq)
    fpt = train_flops_per_token(shape, seq)
    med = statistics.median(tokens / t for t in times)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    nominal = next((f for k, f in NOMINAL_BF16_PEAK.items() if k.lower() in name.lower()), None)
    row = {"name": f"train_step_torch_{mode}", "metric": "train_tokens_per_s", "size": shape, "baseline": med,
           "baseline_seconds": times, "baseline_compile_s": max(first - warm, 0.0), "batch": batch, "seq_len": seq,
           "mode": mode, "activation_checkpointing": bool(remat), "attention": "sdpa", "dtype": "bfloat16 autocast",
           "flops_per_token": fpt, "baseline_flops": med * fpt, "device": name,
           "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}
    if nominal:
        row["nominal_peak_flops"] = nominal
        row["mfu_vs_nominal"] = med * fpt / nominal
    print(f"[torch train step {shape}, {mode}] {med:,.0f} tok/s, {med * fpt / 1e12:.1f} TFLOP/s "
          f"(compile {row['baseline_compile_s']:.0f}s)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.gpu import GPU_BATCH, GPU_SEQ, tiny_cpu_settings
    from jmarl import provenance

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_torch", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="gpu-0.5b,gpu-1.5b")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--allow-cpu", action="store_true", help="the tiny shape on the CPU (checks the code path)")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        print("benchmarks.gpu_torch: PyTorch sees no CUDA device (use --allow-cpu to check the code path)")
        return 2
    shapes = args.shapes.split(",") if on_gpu else ["tiny"]
    settings = {"batch": GPU_BATCH, "seq": GPU_SEQ} if on_gpu else {k: tiny_cpu_settings()[k] for k in ("batch", "seq")}
    results: dict[str, Any] = {"suite": "gpu_torch", "rows": [], "errors": [], "torch": torch.__version__,
                               provenance.KEY: provenance.record("python -m benchmarks.gpu_torch " + " ".join(argv or []))}

    def write() -> None:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    for mode in args.modes.split(","):  # every shape eager first: compiling is the long part
        for shape in shapes:
            try:
                results["rows"].append(bench_torch_train(shape, args.repeats, mode, device="cuda" if on_gpu else "cpu",
                                                         **settings))
            except Exception as e:  # noqa: BLE001 - one failed row must not cost the others
                results["errors"].append({"name": f"train_step_torch_{mode}", "size": shape,
                                          "error": f"{type(e).__name__}: {e}"[:1000]})
                print(f"[torch train step {shape}, {mode}] failed: {results['errors'][-1]['error'][:300]}", flush=True)
            gc.collect()  # the row's model, optimizer state and compiled graph (a failure's traceback too)
            if on_gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            write()
    write()
    return 0 if results["rows"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
