"""Generation throughput: jmarl's KV-cache sampler vs `transformers` `generate` on the same weights.

    python -m benchmarks.generation [--size small|medium|all] [--repeats 5] [--quick]

For each size (BENCHMARKS.md `cpu-small` / `cpu-medium`, Qwen2 architecture, fp32) a random
checkpoint is written to a temp dir as HF safetensors and loaded by both sides; the run is gated
on parity (logits and greedy tokens). Both sides sample at temperature 1 with no top-k/top-p,
prompt 64 tokens, 64 new tokens, EOS disabled (HF `min_new_tokens = max_new_tokens`, jmarl
`stop_tokens=()`), at batch 64 (8 prompts x group 8, the GRPO workload of BENCHMARKS.md; jmarl
runs the prefill once per distinct prompt, HF once per row) and batch 8 (8 distinct prompts). Warm-up runs are excluded (jmarl's compile time is
reported separately), then the two sides alternate A B A B for `--repeats` pairs. Rows go to
`benchmarks/results/generation_<size>.json` (`--quick`: fewer repeats, `_quick` suffix).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import jax
import numpy as np

SIZES: dict[str, dict[str, int]] = {
    "small": dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=768),
    "medium": dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, intermediate_size=1536),
}
ROW_NAMES = {64: "generation_vs_hf_generate", 8: "generation_small_batch_vs_hf_generate"}
PROMPT_LEN = 64
NEW_TOKENS = 64
GROUP_SIZE = 8  # batch 64 = 8 prompts x group 8 (BENCHMARKS.md); batch 8 = 8 distinct prompts


def machine_info() -> dict[str, Any]:
    """The machine the figures were measured on."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax_devices": [str(d) for d in jax.devices()],
    }


def versions() -> dict[str, str]:
    """Versions of the libraries on both sides."""
    import flax
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else jax.__version__,
        "flax": flax.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def write_checkpoint(size: str, directory: str) -> Any:
    """A random Qwen2 model of `size` saved to `directory`; returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        **SIZES[size], max_position_embeddings=1024, rope_theta=1e6, tie_word_embeddings=False,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def check_parity(config, params, torch_model, prompts: np.ndarray) -> dict[str, float]:
    """Gate: same logits (fp32) and the same greedy continuation on both sides."""
    import torch

    from jmarl.models import apply, generate

    small = prompts[:4]
    mask = np.ones_like(small, bool)
    with torch.no_grad():
        ref = torch_model(input_ids=torch.tensor(small)).logits.numpy()
        ref_tokens = torch_model.generate(
            input_ids=torch.tensor(small), attention_mask=torch.tensor(mask.astype(np.int64)),
            do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0,
        )[:, small.shape[1]:].numpy()
    logits = np.asarray(apply(config, params, small, mask))
    max_err = float(np.abs(logits - ref).max())
    ours = np.asarray(generate(config, params, small, mask, jax.random.key(0), max_new_tokens=8, temperature=0.0).tokens)
    if max_err > 1e-3 or not np.array_equal(ours, ref_tokens):
        raise SystemExit(f"parity gate failed: max logit error {max_err}, greedy tokens equal: {np.array_equal(ours, ref_tokens)}")
    return {"max_logit_abs_err": max_err}


def bench_size(size: str, repeats: int, new_tokens: int, batches: tuple[int, ...]) -> list[dict[str, Any]]:
    """Paired timings for one model size; returns the result rows."""
    import torch

    from jmarl.models import generate, load_hf

    rows = []
    with tempfile.TemporaryDirectory() as directory:
        torch_model = write_checkpoint(size, directory)
        config, params = load_hf(directory)
    rng = np.random.default_rng(0)
    for batch in batches:
        # The GRPO workload: `batch // group` distinct prompts, each repeated `group` times.
        group = GROUP_SIZE if batch >= 64 else 1
        distinct = rng.integers(3, config.vocab_size, (batch // group, PROMPT_LEN)).astype(np.int32)
        prompts = np.repeat(distinct, group, axis=0)
        mask = np.ones_like(prompts, bool)
        parity = check_parity(config, params, torch_model, distinct)
        torch_prompts = torch.tensor(prompts.astype(np.int64))
        torch_mask = torch.ones_like(torch_prompts)

        def run_jmarl(seed: int) -> float:
            start = time.perf_counter()
            out = generate(config, params, prompts, mask, jax.random.key(seed), max_new_tokens=new_tokens,
                           temperature=1.0, stop_tokens=())
            jax.block_until_ready(out.tokens)
            return time.perf_counter() - start

        def run_hf(seed: int) -> float:
            torch.manual_seed(seed)
            start = time.perf_counter()
            with torch.no_grad():
                torch_model.generate(
                    input_ids=torch_prompts, attention_mask=torch_mask, do_sample=True, temperature=1.0,
                    top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                )
            return time.perf_counter() - start

        first_call = run_jmarl(0)  # compile + first run
        warm = run_jmarl(1)
        run_hf(0)  # warm-up
        jmarl_times, hf_times = [], []
        for r in range(repeats):
            jmarl_times.append(run_jmarl(10 + r))
            hf_times.append(run_hf(10 + r))
        tokens = batch * new_tokens
        jm = [tokens / t for t in jmarl_times]
        hf = [tokens / t for t in hf_times]
        rows.append({
            "name": ROW_NAMES.get(batch, f"generation_batch{batch}_vs_hf_generate"),
            "metric": "new_tokens_per_s",
            "size": f"cpu-{size}",
            "jmarl": statistics.median(jm),
            "baseline": statistics.median(hf),
            "ratio": statistics.median(jm) / statistics.median(hf),
            "paired_ratio_median": statistics.median(a / b for a, b in zip(jm, hf)),
            "jmarl_min": min(jm), "jmarl_max": max(jm),
            "baseline_min": min(hf), "baseline_max": max(hf),
            "jmarl_compile_s": max(first_call - warm, 0.0),
            "batch": batch, "distinct_prompts": batch // group, "prompt_len": PROMPT_LEN, "new_tokens": new_tokens, "repeats": repeats,
            "dtype": "float32", "baseline_impl": "transformers generate (do_sample, eager torch)",
            "params": config.num_params(), **parity,
            "machine": machine_info(), "versions": versions(),
        })
        print(f"[{size} batch {batch}] jmarl {rows[-1]['jmarl']:.0f} tok/s, HF {rows[-1]['baseline']:.0f} tok/s, "
              f"ratio {rows[-1]['ratio']:.2f} (compile {rows[-1]['jmarl_compile_s']:.1f}s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["small", "medium", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small size, 2 repeats, 16 new tokens: checks it runs")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    sizes = ["small"] if args.quick else (["small", "medium"] if args.size == "all" else [args.size])
    repeats = 2 if args.quick else max(args.repeats, 5)
    new_tokens = 16 if args.quick else NEW_TOKENS
    os.makedirs(args.out_dir, exist_ok=True)
    for size in sizes:
        rows = bench_size(size, repeats, new_tokens, batches=(64, 8))
        suffix = "_quick" if args.quick else ""
        path = os.path.join(args.out_dir, f"generation_{size}{suffix}.json")
        with open(path, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
