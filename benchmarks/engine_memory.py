"""KV memory of the continuous engine: prompts shared in place vs a copy per slot.

    python -m benchmarks.engine_memory [--model qwen3-1.7b] [--prompt-len 4096] [--new-tokens 512]
                                       [--share 4] [--budget 20GiB] [--no-compile]

For a model preset (bf16 compute), a prompt bucket P, N new tokens, requests of K completions
each (a GRPO group, a tree node's candidates) and a KV budget per device:

- slots that fit the budget (`jmarl.models.engine.slots_for_budget`): with the prompt pool, S
  slots of G = N - 1 generated tokens and Q = `entries_for`(S, K) prompt entries; against a copy
  of the prompt in every slot (the engine before the pool: S x (P + N - 1) tokens), which is the
  same rule with one entry per slot (K = 1);
- XLA's memory analysis of the compiled prefill and decode-chunk programs (abstract shapes,
  compiled for this machine's CPU, nothing allocated): arguments (weights + engine state) and
  temporaries, at the pooled S and Q, and at the same S with one entry per slot (what copying
  costs). The prefill's largest call fills min(S, Q, `prefill_prompts`) entries at once (its
  temporaries hold those prompts' keys/values for every layer before they are stored in the
  pool; `prefill_prompts` keeps them within a quarter of the budget). The programs
  are compiled in float32 (weights and caches): XLA:CPU has no bf16 arithmetic and would add
  float32 copies of bf16 caches that an accelerator does not make (docs/scaling.md). The
  decode temporaries hold one layer's gathered prompt rows (gathered layer by layer) and the
  per-layer weight slices the decode loop reads.

Writes `benchmarks/results/engine_memory.json`.
"""

from __future__ import annotations

import argparse
import os
import time

import jax

from benchmarks.common import results_header, write_json

GIB = 1 << 30


def program_memory(config, slots: int, entries: int, prompt_len: int, new_tokens: int, max_prefill: int) -> dict:
    """Argument and temporary bytes of the engine's compiled prefill and decode-chunk programs."""
    from jmarl import models
    from jmarl.models import engine

    params = jax.eval_shape(lambda: models.init(config, jax.random.key(0)))
    out = {"slots": slots, "entries": entries, "max_prefill": max_prefill,
           "state_bytes": engine.engine_bytes(config, slots, entries, prompt_len, new_tokens)}
    for name, fn, args in engine.planned_programs(config, params, slots=slots, entries=entries,
                                                  prompt_len=prompt_len, max_new_tokens=new_tokens,
                                                  max_prefill=max_prefill):
        t0 = time.perf_counter()
        analysis = fn.lower(*args).compile().memory_analysis()
        out[name] = {"argument_bytes": int(analysis.argument_size_in_bytes),
                     "temp_bytes": int(analysis.temp_size_in_bytes), "compile_seconds": time.perf_counter() - t0}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-1.7b", help="a model preset (jmarl.models.presets)")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--share", type=int, default=4, help="completions per prompt (K)")
    parser.add_argument("--budget", default="20GiB", help="KV budget per device (sampling.kv_budget_bytes)")
    parser.add_argument("--rows", type=int, default=4096, help="completions asked (caps S at next_pow2)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled-program figures")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from jmarl.config import parse_bytes
    from jmarl.models import engine, presets

    config = presets.preset_config(args.model, param_dtype="bfloat16", compute_dtype="bfloat16")
    f32_config = presets.preset_config(args.model, param_dtype="float32", compute_dtype="float32")
    budget = parse_bytes(args.budget)
    p, n, k = args.prompt_len, args.new_tokens, args.share
    shared = engine.slots_for_budget(config, p, n, budget, args.rows, share=k)
    copied = engine.slots_for_budget(config, p, n, budget, args.rows, share=1)
    result = {
        **results_header("benchmarks.engine_memory", argv),
        "settings": {"model": args.model, "prompt_len": p, "new_tokens": n, "share": k, "budget_bytes": budget,
                     "rows": args.rows, "dtype": "bfloat16"},
        "bytes": {"slot": engine.slot_bytes(config, n), "entry": engine.entry_bytes(config, p),
                  "copied_slot": engine.engine_bytes(config, 1, 1, p, n)},
        "slots": {"shared": {"slots": shared[0], "entries": shared[1]},
                  "copied": {"slots": copied[0], "entries": copied[1]},
                  "ratio": shared[0] / copied[0]},
    }
    print(f"{args.model}, P={p}, N={n}, K={k}, budget {budget / GIB:.1f} GiB per device: "
          f"{shared[0]} slots + {shared[1]} prompt entries shared vs {copied[0]} slots with a copy each "
          f"({shared[0] / copied[0]:.1f}x)")
    if not args.no_compile:
        s, q = shared
        u = engine.prefill_prompts(config, p, budget)  # as a run in bf16 caps its prefill calls
        pooled = program_memory(f32_config, s, q, p, n, u)
        per_slot = program_memory(f32_config, s, s, p, n, u)
        print(f"  a prefill call runs at most {u} prompts (a quarter of the budget in their keys/values)")
        one_layer = s * 2 * config.num_kv_heads * config.head_dim * p * 4  # keys + values of one layer, float32
        result["programs"] = {"dtype": "float32", "shared": pooled, "copied_same_slots": per_slot,
                              "one_layer_gathered_bytes": one_layer}
        for name, m in (("shared", pooled), ("copy per slot", per_slot)):
            for program in ("engine_prefill", "engine_decode"):
                f = m[program]
                print(f"  {program} in float32, {name} (S={m['slots']}, Q={m['entries']}): arguments "
                      f"{f['argument_bytes'] / GIB:.2f} GiB, temporaries {f['temp_bytes'] / GIB:.2f} GiB")
        print(f"  one layer's gathered prompt rows: {one_layer / GIB:.2f} GiB")
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "engine_memory.json")
    write_json(out, result)
    return result


if __name__ == "__main__":
    main()
