"""Train step (GRPO loss, backward, AdamW) tokens/s: jmarl vs PyTorch eager and `torch.compile`.

    python -m benchmarks.train_step [--shape cpu-small|cpu-medium|smollm2] [--repeats 5] [--quick]
        [--rows N] [--prompt-len N] [--new-tokens N] [--modes eager,compile]

Both sides load the same safetensors checkpoint (a random reference shape, or `smollm2`:
SmolLM2-135M-Instruct's GGUF dequantised to fp32, `benchmarks.common.REAL_MODELS`) and are gated
on parity (`benchmarks.parity`); the batch's tokens are random ids of the model's vocabulary.
Work per step: 64 sequences (8 prompts x group 8) of 64 prompt + 64 completion tokens, fp32;
the GRPO loss of `jmarl.algos.grpo` on the completion tokens, its gradient, global-norm
clipping at 1.0 and AdamW (lr 1e-6, betas 0.9/0.999, eps 1e-8, weight decay 0.01).

jmarl runs what its trainer runs: `jmarl.train.step.make_update` over the packed batch
layout (`jmarl.train.packing`: each group's prompt runs through the model once, not G
times; same log-probs, loss and gradients, which the parity gate checks against PyTorch) and
`jmarl.algos.policy_loss` (GRPO's defaults) with `jmarl.train.optim.make_optimizer`, jitted with the state donated. PyTorch runs the minimal step: HF forward, log-softmax gather, the same loss,
`backward`, `clip_grad_norm_`, `torch.optim.AdamW.step`, `zero_grad`; once eager and once with
the loss function (forward + loss; backward through AOTAutograd) under `torch.compile`, each in a
process of its own, out of the box (`benchmarks.baseline_process`).
Tokens/s counts every token of the batch (prompt and completion go through forward and
backward); model FLOP/s = tokens/s x `train_flops_per_token` (the dense count: what the same
step costs without prompt sharing, as PyTorch runs it). `jmarl_executed_flops` counts what jmarl
runs instead (each distinct prompt once: `shared_prefix_train_flops`), the figure to hold
against the matmul peak.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from benchmarks.baseline_process import BaselineProcess
from benchmarks.common import (GROUP_SIZE, LR, NEW_TOKENS, NUM_PROMPTS, PROMPT_LEN, known_shapes, make_row,
                               paired_times, results_end, results_header, shared_prefix_train_flops, timed,
                               train_flops_per_token, weights_of, write_checkpoint, write_json)
from benchmarks.parity import GrpoBatch, check_parity, jmarl_loss_fn, make_batch, torch_batch, torch_loss_of


def jmarl_update(config, params, batch: GrpoBatch):
    """(update, state, device batch): the benchmark's GRPO update, not jitted (update(state, None,
    device_batch) -> (state, metrics)), a fresh train state and the packed batch on device."""
    import jax
    import jax.numpy as jnp

    from jmarl.train.optim import make_optimizer
    from jmarl.train.step import init_train_state, make_update

    optimizer = make_optimizer(LR, total_steps=10**6, weight_decay=0.01, grad_clip=1.0)
    state = init_train_state(jax.tree.map(jnp.array, params), optimizer)
    device_batch = jax.device_put({k: jnp.asarray(v) for k, v in batch.packed().items()})
    return make_update(jmarl_loss_fn(config), optimizer), state, device_batch


def jmarl_step(config, params, batch: GrpoBatch):
    """(run(i) -> seconds, state holder): one jitted GRPO update per call, state donated."""
    import jax

    from jmarl.train.step import jit_update

    plain, state, device_batch = jmarl_update(config, params, batch)
    update = jit_update(plain)
    holder = {"state": state}

    def once() -> None:
        holder["state"], metrics = update(holder["state"], None, device_batch)
        jax.block_until_ready((holder["state"].params, metrics))

    return lambda i: timed(once), holder


def torch_step(torch_model, batch: GrpoBatch, *, compile: bool):
    """run(i) -> seconds of one PyTorch GRPO step (eager, or the loss under `torch.compile`)."""
    import copy

    import torch

    model = copy.deepcopy(torch_model).float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    tb = torch_batch(batch)
    loss_of = functools.partial(torch_loss_of, model)
    if compile:
        loss_of = torch.compile(loss_of)

    def once() -> None:
        loss = loss_of(tb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return lambda i: timed(once)


def torch_step_runner(checkpoint: str, rows: int, prompt_len: int, new_tokens: int, mode: str):
    """Baseline-process setup: `torch_step` of the checkpoint in `checkpoint` on the benchmark
    batch (`make_batch(vocab, rows, prompt_len, new_tokens, group_size=GROUP_SIZE)`, seed 0: the
    batch jmarl's side builds), eager or compiled (`mode`)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    batch = make_batch(model.config.vocab_size, rows, prompt_len, new_tokens, group_size=GROUP_SIZE)
    return torch_step(model, batch, compile=(mode == "compile"))


def bench_train_step(shape: str, repeats: int, *, peak_flops: float | None = None, rows: int = NUM_PROMPTS * GROUP_SIZE,
                     prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS, modes=("eager", "compile"),
                     baseline_host_memory: str = "default") -> list[dict]:
    """Paired jmarl vs PyTorch train-step rows for `shape` (gated on parity; PyTorch in a
    `BaselineProcess` per mode)."""
    with tempfile.TemporaryDirectory() as d:
        return _bench_train_step(shape, d, repeats, peak_flops, rows, prompt_len, new_tokens, modes,
                                 baseline_host_memory)


def _bench_train_step(shape: str, checkpoint: str, repeats: int, peak_flops: float | None, rows: int, prompt_len: int,
                      new_tokens: int, modes, baseline_host_memory: str) -> list[dict]:
    from jmarl.models import load_hf

    torch_model = write_checkpoint(shape, checkpoint, tokenizer=False)
    config, params = load_hf(checkpoint)
    parity = check_parity(torch_model, config, params, prompt_len=min(prompt_len, 64), new_tokens=min(new_tokens, 64))
    del torch_model
    batch = make_batch(config.vocab_size, rows, prompt_len, new_tokens, group_size=GROUP_SIZE)
    tokens = float(batch.tokens.size)
    flops_per_token = train_flops_per_token(shape, prompt_len + new_tokens)
    # packed: each group's prompt once, then its completions (all of equal length here, so no padding)
    executed_per_step = shared_prefix_train_flops(shape, rows // GROUP_SIZE, prompt_len, rows, new_tokens)
    run_jmarl, _ = jmarl_step(config, params, batch)
    out = []
    for mode in modes:
        with BaselineProcess("benchmarks.train_step:torch_step_runner", host_memory=baseline_host_memory,
                             checkpoint=checkpoint, rows=rows, prompt_len=prompt_len, new_tokens=new_tokens,
                             mode=mode) as torch_side:
            paired = paired_times(run_jmarl, torch_side.run, repeats, warmup=2 if mode == "compile" else 1)
        row = make_row(f"train_step_vs_torch_{mode}", "train_tokens_per_s", shape, tokens, paired,
                       batch=rows, seq_len=prompt_len + new_tokens, dtype="float32",
                       baseline_impl=f"transformers model + minimal GRPO step, torch {mode}",
                       baseline_host_memory=torch_side.info["host_memory_policy"],
                       params=config.num_params(), weights=weights_of(shape), flops_per_token=flops_per_token,
                       **parity)
        if out:  # jmarl compiled in the first comparison; later ones reuse the program
            row["jmarl_compile_s"] = out[0]["jmarl_compile_s"]
        row["jmarl_flops"] = row["jmarl"] * flops_per_token
        row["baseline_flops"] = row["baseline"] * flops_per_token
        row["jmarl_executed_flops"] = row["jmarl"] / tokens * executed_per_step
        if peak_flops:
            row["matmul_peak_flops"] = peak_flops
            row["jmarl_fraction_of_peak"] = row["jmarl_flops"] / peak_flops
            row["jmarl_executed_fraction_of_peak"] = row["jmarl_executed_flops"] / peak_flops
            row["baseline_fraction_of_peak"] = row["baseline_flops"] / peak_flops
        print(f"[train step {shape} vs {mode}] jmarl {row['jmarl']:.0f} tok/s "
              f"({row['jmarl_flops'] / 1e9:.0f} GFLOP/s dense, {row['jmarl_executed_flops'] / 1e9:.0f} executed), torch {row['baseline']:.0f} tok/s, "
              f"ratio {row['paired_ratio_median']:.2f}", flush=True)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    import json

    from benchmarks.common import measure_matmul_peak

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=known_shapes(), default="cpu-small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 repeats and 16 rows (unless --rows): checks it runs")
    parser.add_argument("--rows", type=int, default=None, help=f"sequences per step (default {NUM_PROMPTS * GROUP_SIZE})")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--modes", default="eager,compile", help="PyTorch sides, comma-separated: eager, compile")
    parser.add_argument("--out", default=None, help="also write the rows, with the command, date, machine and "
                        "commit, to this JSON file")
    args = parser.parse_args(argv)
    header = results_header("benchmarks.train_step", argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or set(modes) - {"eager", "compile"}:
        parser.error(f"--modes {args.modes!r}: name eager and/or compile")
    batch_rows = args.rows if args.rows is not None else (16 if args.quick else NUM_PROMPTS * GROUP_SIZE)
    if batch_rows < GROUP_SIZE or batch_rows % GROUP_SIZE or args.prompt_len < 1 or args.new_tokens < 1:
        parser.error(f"--rows must be a positive multiple of the group size {GROUP_SIZE}; "
                     "--prompt-len and --new-tokens at least 1")
    peak = measure_matmul_peak()["matmul_peak_flops"]
    rows = bench_train_step(args.shape, 2 if args.quick else args.repeats, peak_flops=peak, rows=batch_rows,
                            prompt_len=args.prompt_len, new_tokens=args.new_tokens, modes=modes)
    print(json.dumps([{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rows], indent=1))
    if args.out:
        write_json(args.out, {**header, "matmul_peak_flops": peak, "rows": rows, **results_end()})


if __name__ == "__main__":
    from jmarl.host_memory import apply_on_cpu

    apply_on_cpu()  # jmarl's CPU host memory policy, before JAX starts (JMARL_KEEP_HOST_MEMORY=0: off)
    main()
