"""Memory at scale from XLA's compiled memory analysis: abstract shapes, nothing allocated.

    python -m benchmarks.memory [--json benchmarks/results/memory.json]
                                [--row PRESET BATCH TOKENS REMAT ATTENTION ...]

Rows: loss + gradient of `token_logprobs` (sum of the log-probs) at a preset's shape, float32
master parameters, bf16 compute, the library's defaults (remat auto, attention auto), per
(batch, tokens); and, for comparison, the same with the dense attention form and no remat (what
jmarl did before the attention entry point). `--row` (repeatable) compiles the rows given
instead (e.g. one small shape for a smoke test). Figures are per device, in bytes: arguments
(parameters + batch), outputs (the gradient), temporaries.

Caveat: compiled here by XLA:CPU, which has no bf16 arithmetic: it upcasts bf16 values to
float32, and for the layer scan it keeps a float32 copy of the saved bf16 layer inputs
(about L x B x T x D x 4 bytes) that a bf16-native GPU/TPU compilation does not make, so these
temporaries are an upper bound for accelerators.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence

from benchmarks.common import results_end, results_header, write_json

Row = tuple[str, int, int, str, str]  # (preset, batch, tokens, remat, attention)

ROWS: tuple[Row, ...] = (
    ("qwen3-1.7b", 8, 8192, "auto", "auto"),
    ("qwen3-1.7b", 2, 32768, "auto", "auto"),
    ("qwen3-1.7b", 8, 8192, "none", "xla"),
)


def parse_row(fields: Sequence[str]) -> Row:
    """A `--row` as a ROWS entry: (preset, batch, tokens, remat, attention)."""
    preset, batch, tokens, remat, attention = fields
    return preset, int(batch), int(tokens), remat, attention


def logprob_grad_memory(preset: str, batch: int, tokens: int, remat: str = "auto", attention: str = "auto") -> dict[str, Any]:
    """Per-device bytes of jit(grad(sum of token_logprobs)) at `preset`'s shape on [batch, tokens]."""
    import jax
    import jax.numpy as jnp

    from jmarl.models import logprobs, model, presets
    from jmarl.train.policies import resolve_remat

    config = presets.preset_config(preset, param_dtype="float32", compute_dtype="bfloat16", attention=attention)
    config = config.replace(remat=resolve_remat(remat, config.num_params()))
    params = jax.eval_shape(lambda: model.init(config, jax.random.key(0)))
    tok = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, tokens), jnp.bool_)

    def loss(p, t, m):
        return -jnp.sum(logprobs.token_logprobs(config, p, t, m))

    start = time.perf_counter()
    analysis = jax.jit(jax.grad(loss)).lower(params, tok, mask).compile().memory_analysis()
    return {
        "preset": preset, "batch": batch, "tokens": tokens, "remat": config.remat, "attention": attention,
        "arguments": int(analysis.argument_size_in_bytes), "outputs": int(analysis.output_size_in_bytes),
        "temporaries": int(analysis.temp_size_in_bytes), "compile_s": round(time.perf_counter() - start, 1),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of `logprob_grad_memory` results (GiB)."""
    gib = 2.0**30
    lines = ["| model | batch x tokens | remat | attention | parameters + batch | gradient | temporaries |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['batch']} x {r['tokens']:,} | {r['remat']} | {r['attention']} | "
                     f"{r['arguments'] / gib:.2f} GiB | {r['outputs'] / gib:.2f} GiB | **{r['temporaries'] / gib:.2f} GiB** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--row", nargs=5, action="append", default=None,
                        metavar=("PRESET", "BATCH", "TOKENS", "REMAT", "ATTENTION"),
                        help="compile this row instead of the default ones (repeatable)")
    args = parser.parse_args(argv)
    header = results_header("benchmarks.memory", argv)  # date, machine and commit at the start
    import jax

    rows = []
    for preset, batch, tokens, remat, attention in ROWS if args.row is None else map(parse_row, args.row):
        print(f"compiling {preset} {batch} x {tokens} (remat {remat}, attention {attention}) ...", file=sys.stderr, flush=True)
        rows.append(logprob_grad_memory(preset, batch, tokens, remat, attention))
    print(table(rows))
    if args.json:
        write_json(args.json, {**header, **results_end(), "backend": jax.default_backend(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
