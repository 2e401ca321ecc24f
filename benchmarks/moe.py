"""Mixture of experts: forward tokens/s on CPU against a dense model of equal active parameters,
and the compiled per-device memory of one Qwen3-30B-A3B expert layer (forward + backward) with
its experts split over fsdp (expert parallelism: the tokens move) against the experts sharded
FSDP-style on D (left to XLA's partitioner).

    python -m benchmarks.moe [--json benchmarks/results/moe.json] [--repeats 7] [--skip-memory]
                             [--batch 8] [--seq 256] [--memory-devices 8 64]

Forward (`cpu_forward`, one CPU device, float32, B x T tokens through `jmarl.models.apply`;
`--batch` and `--seq`, default 8 x 256, set B and T): a
tiny all-sparse Qwen3-MoE (E experts, top-k, expert width Fe) against a dense Qwen3 whose MLP
width is k x Fe, so a token runs the same number of weights in both (the MoE adds its router,
D x E per layer: listed). Three forms, interleaved A B C per repeat, medians:

    moe (tiled)       the library's CPU form of the grouped products (`jmarl.models.grouped_matmul`:
                      a scan over row tiles, each tile's groups only)
    moe (ragged_dot)  `jax.lax.ragged_dot` as XLA:CPU lowers it: one dense product over every
                      expert, through an [N x k, E x D] masked copy of the rows
    dense             the dense model

Layer memory (`layer_memory`, in a subprocess per device count of `--memory-devices`, default 8
and 64, simulated CPU devices): value
and gradient of sum(expert layer(x) * probe) for `TOKENS_PER_DEVICE` tokens a device, float32
expert weights cast to bf16 (as `Experts` does), routing given (no router), mesh fsdp=N:

    expert parallel   weights [E, D, Fe] split on E over fsdp; `moe.expert_parallel_ffn`
    weights gathered  the same placement, the layer left to XLA's partitioner
                      (`moe.chunked_expert_ffn`, no shard_map), which gathers the experts' weights
    fsdp on D         weights split on D over fsdp (the rule expert -> ()), the layer a model
                      runs when its experts are not split (`moe.chunked_expert_ffn`), partitioned
                      by XLA

Figures are XLA's `memory_analysis()` per device (arguments, temporaries, outputs) and the
result shapes of the compiled collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import results_end, results_header, write_json

# the tiny pair: hidden 256, 4 layers, 16 experts top-2 of width 256 against a dense MLP of 512
BASE = dict(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True,
            compute_dtype="float32", param_dtype="float32", remat="none")
MOE = dict(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
           intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1)
DENSE = dict(model_type="qwen3", intermediate_size=512)
BATCH, SEQ = 8, 256
# Qwen3-30B-A3B's expert layer
D30, E30, K30, F30 = 2048, 128, 8, 768
TOKENS_PER_DEVICE = 4096
MEMORY_DEVICES = (8, 64)


def active_params(config: Any) -> dict[str, int]:
    """Parameters a token runs through per layer: attention, feed-forward (the k experts' of an
    MoE), router."""
    d = config.hidden_size
    attn = d * config.num_heads * config.head_dim * 2 + d * config.num_kv_heads * config.head_dim * 2
    if config.num_experts:
        return {"attention": attn, "feed_forward": config.num_experts_per_tok * 3 * d * config.moe_intermediate_size,
                "router": d * config.num_experts}
    return {"attention": attn, "feed_forward": 3 * d * config.intermediate_size, "router": 0}


def cpu_forward(repeats: int, batch: int = BATCH, seq: int = SEQ) -> dict[str, Any]:
    """Forward tokens/s of the three forms (module docstring) on one CPU device, on `batch` x
    `seq` tokens."""
    import jax
    import numpy as np

    from jmarl.models import ModelConfig, apply, init, moe

    moe_config, dense_config = ModelConfig(**BASE, **MOE), ModelConfig(**BASE, **DENSE)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, BASE["vocab_size"], (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), bool)
    moe_params = init(moe_config, jax.random.key(0))
    dense_params = init(dense_config, jax.random.key(0))
    grouped = moe.grouped_matmul

    def program(config: Any, ragged: bool):
        """The jitted forward, traced now with the grouped product it is to use."""
        moe.grouped_matmul = jax.lax.ragged_dot if ragged else grouped
        try:
            fn = jax.jit(lambda p, t, m: apply(config, p, t, m))
            params = moe_params if config.num_experts else dense_params
            compiled = fn.lower(params, tokens, mask).compile()  # traced with this form
        finally:
            moe.grouped_matmul = grouped
        return lambda: compiled(params, tokens, mask).block_until_ready()

    forms = {"moe (tiled)": program(moe_config, False), "moe (ragged_dot)": program(moe_config, True),
             "dense": program(dense_config, False)}
    for run in forms.values():  # warm-up
        run()
    seconds: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(repeats):
        for name, run in forms.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    n = batch * seq
    rows = {name: {"tokens_per_s": n / statistics.median(s), "seconds": s} for name, s in seconds.items()}
    for name in rows:
        rows[name]["ratio_to_dense"] = rows[name]["tokens_per_s"] / rows["dense"]["tokens_per_s"]
    return {"tokens": n, "batch": batch, "seq": seq, "repeats": repeats, "moe_config": {**BASE, **MOE},
            "dense_config": {**BASE, **DENSE}, "active_params_per_layer": {
                "moe": active_params(moe_config), "dense": active_params(dense_config)}, "forms": rows}


def _collectives(hlo: str) -> dict[str, list[str]]:
    """Result shapes of the all-gathers, reduce-scatters and all-reduces of compiled HLO text."""
    out: dict[str, list[str]] = {}
    for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all"):
        pattern = r"= \(?([a-z0-9]+\[[0-9,]*\])[^ ]* " + op + r"(-start)?\("
        out[op] = sorted({m.group(1) for m in re.finditer(pattern, hlo)})
    return out


def layer_memory(devices: int) -> list[dict[str, Any]]:
    """Per-device compiled memory of one 30B-A3B expert layer, both layouts (module docstring).
    Runs in a process started with `devices` simulated CPU devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jmarl.models import moe
    from jmarl.sharding import make_mesh

    mesh = make_mesh(fsdp=devices)
    n = TOKENS_PER_DEVICE * devices

    def arg(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    rows = P("fsdp")
    results = []
    for name, w_spec, down_spec in (("expert parallel", P("fsdp"), P("fsdp")),
                                    ("weights gathered", P("fsdp"), P("fsdp")),
                                    ("fsdp on D", P(None, "fsdp"), P(None, None, "fsdp"))):
        args = (arg((n, D30), jnp.bfloat16, rows), arg((n, K30), jnp.int32, rows), arg((n, K30), jnp.bfloat16, rows),
                arg((E30, D30, F30), jnp.float32, w_spec), arg((E30, D30, F30), jnp.float32, w_spec),
                arg((E30, F30, D30), jnp.float32, down_spec), arg((n, D30), jnp.bfloat16, rows))

        def loss(x, experts, weights, gate, up, down, probe, parallel=name == "expert parallel"):
            gate, up, down = (w.astype(jnp.bfloat16) for w in (gate, up, down))
            if parallel:
                y = moe.expert_parallel_ffn(x, experts, weights, gate, up, down)
            else:
                y = moe.chunked_expert_ffn(x, experts, weights, gate, up, down)
            return jnp.sum((y * probe).astype(jnp.float32))

        start = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 3, 4, 5))).lower(*args).compile()
        analysis = compiled.memory_analysis()
        results.append({
            "layout": name, "devices": devices, "tokens_per_device": TOKENS_PER_DEVICE,
            "arguments": int(analysis.argument_size_in_bytes), "temporaries": int(analysis.temp_size_in_bytes),
            "outputs": int(analysis.output_size_in_bytes), "collectives": _collectives(compiled.as_text()),
            "compile_s": round(time.perf_counter() - start, 1),
        })
    return results


def _layer_memory_subprocess(devices: int) -> list[dict[str, Any]]:
    """`layer_memory(devices)` in a fresh process (the device count is fixed when JAX starts);
    the caller's other XLA flags (e.g. the tests' compile settings) are kept."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.moe", "--layer-memory-only", str(devices)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/moe.json")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-memory", action="store_true", help="forward tokens/s only")
    parser.add_argument("--batch", type=int, default=BATCH, help="rows of the forward workload")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per row of the forward workload")
    parser.add_argument("--memory-devices", type=int, nargs="+", default=list(MEMORY_DEVICES),
                        help="simulated device counts of the layer memory (each must divide the 128 experts)")
    parser.add_argument("--layer-memory-only", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layer_memory_only is not None:
        print(json.dumps(layer_memory(args.layer_memory_only)))
        return 0
    results = results_header("benchmarks.moe", argv)
    results["cpu_forward"] = cpu_forward(args.repeats, args.batch, args.seq)
    for name, row in results["cpu_forward"]["forms"].items():
        print(f"{name:18s} {row['tokens_per_s']:10.0f} tokens/s  x{row['ratio_to_dense']:.2f} of dense",
              file=sys.stderr)
    if not args.skip_memory:
        results["layer_memory"] = [r for devices in args.memory_devices for r in _layer_memory_subprocess(devices)]
        gib = 2.0**30
        for r in results["layer_memory"]:
            print(f"{r['devices']:4d} devices {r['layout']:16s} arguments {r['arguments'] / gib:6.2f} GiB  "
                  f"temporaries {r['temporaries'] / gib:6.2f} GiB  all-gathers {r['collectives']['all-gather']}",
                  file=sys.stderr)
    results.update(results_end())
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
