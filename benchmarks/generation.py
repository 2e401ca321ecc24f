"""Generation throughput: jmarl's KV-cache sampler vs `transformers` `generate` on the same weights.

    python -m benchmarks.generation [--shape cpu-small|cpu-medium|smollm2|all] [--repeats 5] [--quick]

For each shape (docs/benchmarks.md: `cpu-small` / `cpu-medium`, random Qwen2-architecture
weights; `smollm2`, SmolLM2-135M-Instruct's GGUF dequantised; all fp32) the checkpoint is written
to a temp dir as HF safetensors and loaded by both sides; prompts are random ids of the model's
vocabulary. The run is gated on parity (logits, and the same greedy tokens with EOS neither
stopping nor suppressed on either side). Both sides sample at temperature 1 with no top-k/top-p,
prompt 64 tokens, 64 new tokens, EOS disabled (HF `min_new_tokens = max_new_tokens`, jmarl
`stop_tokens=()`), at batch 64 (8 prompts x group 8, the GRPO workload of docs/benchmarks.md; jmarl
runs the prefill once per distinct prompt, HF once per row) and batch 8 (8 distinct prompts).
HF runs in a process of its own, out of the box (`benchmarks.baseline_process`). Warm-up runs are
excluded (jmarl's compile time is reported separately), then the two sides alternate A B A B for
`--repeats` pairs (`benchmarks.common.paired_times`). Rows go to
`benchmarks/results/generation_<shape>.json` (`--quick`: fewer repeats and new tokens, `_quick` suffix).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import jax
import numpy as np

from benchmarks.baseline_process import BaselineProcess
from benchmarks.common import (NEW_TOKENS, PROMPT_LEN, REAL_MODELS, generation_prompts, make_row, paired_times,
                               results_end, results_header, weights_of, write_checkpoint, write_json)

ROW_NAMES = {64: "generation_vs_hf_generate", 8: "generation_small_batch_vs_hf_generate"}


def pad_id_of(torch_model) -> int:
    """The pad id `generate` is given: the checkpoint's own (a real model's), else 0."""
    pad = torch_model.config.pad_token_id
    return 0 if pad is None else int(pad)


def check_parity(config, params, torch_model, prompts: np.ndarray) -> dict[str, float]:
    """Gate: same logits (fp32; max abs error <= 1e-3 x max(1, largest |logit|)) and the same 8
    greedy tokens on both sides, of the first 4 rows of `prompts` (int32[B, S]). EOS neither
    stops a row nor is suppressed on either side (HF `eos_token_id=None`, jmarl
    `stop_tokens=()`): a real model may pick EOS greedily. Returns the logit error and scale."""
    import torch

    from jmarl.models import GenerationSpec, apply, generate

    small = prompts[:4]
    mask = np.ones_like(small, bool)
    pad = pad_id_of(torch_model)
    with torch.no_grad():
        ref = torch_model(input_ids=torch.tensor(small)).logits.numpy()
        ref_tokens = torch_model.generate(
            input_ids=torch.tensor(small), attention_mask=torch.tensor(mask.astype(np.int64)),
            do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=pad,
        )[:, small.shape[1]:].numpy()
    logits = np.asarray(apply(config, params, small, mask))
    max_err = float(np.abs(logits - ref).max())
    scale = float(np.abs(ref).max())
    # 1e-3 absolute for logits of magnitude <= 1 (random weights); a trained model's logits reach
    # tens, and fp32 rounding grows with them, so the bound scales with the largest logit
    tol = 1e-3 * max(1.0, scale)
    ours = np.asarray(generate(config, params, small, mask, jax.random.key(0),
                               GenerationSpec(max_new_tokens=8, temperature=0.0, stop_tokens=(), pad_id=pad)).tokens)
    if max_err > tol or not np.array_equal(ours, ref_tokens):
        raise SystemExit(f"parity gate failed: max logit error {max_err} (tolerance {tol}), "
                         f"greedy tokens equal: {np.array_equal(ours, ref_tokens)}")
    return {"max_logit_abs_err": max_err, "max_logit_abs": scale}


def hf_generate_runner(checkpoint: str, prompts_file: str, new_tokens: int):
    """Baseline-process setup: run(seed) -> seconds of one HF `generate` of the rows in
    `prompts_file` (int32[batch, PROMPT_LEN] .npy) from the checkpoint in `checkpoint`."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = torch.tensor(np.load(prompts_file).astype(np.int64))
    mask = torch.ones_like(prompts)
    pad = pad_id_of(model)

    def run(seed: int) -> float:
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids=prompts, attention_mask=mask, do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
            )
        return time.perf_counter() - start

    return run


def bench_shape(shape: str, repeats: int, new_tokens: int, batches: tuple[int, ...], *,
                baseline_host_memory: str = "default") -> list[dict[str, Any]]:
    """Paired timings for one model shape (HF in a `BaselineProcess`); returns the result rows."""
    from jmarl.models import GenerationSpec, generate, load_hf

    rows = []
    with tempfile.TemporaryDirectory() as directory:
        torch_model = write_checkpoint(shape, directory, tokenizer=False)
        config, params = load_hf(directory)
        rng = np.random.default_rng(0)
        for batch in batches:
            # The GRPO workload at batch 64 (8 distinct prompts x 8), distinct prompts at batch 8.
            distinct, prompts = generation_prompts(config.vocab_size, batch, rng)
            mask = np.ones_like(prompts, bool)
            parity = check_parity(config, params, torch_model, distinct)
            prompts_file = os.path.join(directory, f"prompts_{batch}.npy")
            np.save(prompts_file, prompts)

            def run_jmarl(seed: int) -> float:
                start = time.perf_counter()
                out = generate(config, params, prompts, mask, jax.random.key(seed),
                               GenerationSpec(max_new_tokens=new_tokens, temperature=1.0, stop_tokens=()))
                jax.block_until_ready(out.tokens)
                return time.perf_counter() - start

            with BaselineProcess("benchmarks.generation:hf_generate_runner", host_memory=baseline_host_memory,
                                 checkpoint=directory, prompts_file=prompts_file, new_tokens=new_tokens) as hf:
                paired = paired_times(run_jmarl, hf.run, repeats)
            row = make_row(ROW_NAMES.get(batch, f"generation_batch{batch}_vs_hf_generate"), "new_tokens_per_s", shape,
                           float(batch * new_tokens), paired, batch=batch, distinct_prompts=len(distinct),
                           prompt_len=PROMPT_LEN, new_tokens=new_tokens, dtype="float32",
                           baseline_impl="transformers generate (do_sample, eager torch)", params=config.num_params(),
                           weights=weights_of(shape), baseline_host_memory=hf.info["host_memory_policy"], **parity)
            rows.append(row)
            print(f"[{shape} batch {batch}] jmarl {row['jmarl']:.0f} tok/s, HF {row['baseline']:.0f} tok/s, "
                  f"ratio {row['paired_ratio_median']:.2f} (compile {row['jmarl_compile_s']:.1f}s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["cpu-small", "cpu-medium", *REAL_MODELS, "all"], default="all",
                        help="all: cpu-small and cpu-medium (a real model runs only when named)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="2 repeats, 16 new tokens, cpu-small unless --shape names one: checks it runs")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    if args.shape == "all":
        shapes = ["cpu-small"] if args.quick else ["cpu-small", "cpu-medium"]
    else:
        shapes = [args.shape]
    repeats = 2 if args.quick else max(args.repeats, 5)
    new_tokens = 16 if args.quick else NEW_TOKENS
    for shape in shapes:
        header = results_header("benchmarks.generation", argv)
        rows = bench_shape(shape, repeats, new_tokens, batches=(64, 8))
        suffix = "_quick" if args.quick else ""
        path = os.path.join(args.out_dir, f"generation_{shape}{suffix}.json")
        write_json(path, {**header, "rows": [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rows],
                          **results_end()})
        print(f"wrote {path}")


if __name__ == "__main__":
    from jmarl.host_memory import apply_on_cpu

    apply_on_cpu()  # jmarl's CPU host memory policy, before JAX starts (JMARL_KEEP_HOST_MEMORY=0: off)
    main()
