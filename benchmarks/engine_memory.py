"""KV memory of the continuous engine: prompts shared in place vs a copy per slot.

    python -m benchmarks.engine_memory [--model qwen3-1.7b] [--prompt-len 4096] [--new-tokens 512]
                                       [--share 4] [--budget 20GiB] [--no-compile]

For a model preset (bf16 compute), a prompt bucket P, N new tokens, requests of K completions
each (a GRPO group, a tree node's candidates) and a KV budget per device:

- slots that fit the budget (`jmarl.models.generation.budget.slots_for_budget`): with the prompt pool, S
  slots of G = N - 1 generated tokens and Q = `entries_for`(S, K) prompt entries; against a copy
  of the prompt in every slot (the engine before the pool: S x (P + N - 1) tokens), which is the
  same rule with one entry per slot (K = 1). The engine rounds S down to a power of two, so the
  ratio of the two S moves in steps of 2x; the largest S of any size that fits (`unrounded`)
  is reported beside them, with its ratio;
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

from benchmarks.common import results_end, results_header, write_json

GIB = 1 << 30


def unrounded_slots(config, prompt_len: int, new_tokens: int, budget: int, share: int) -> tuple[int, int]:
    """(S, Q): the largest S of any size whose slots and `entries_for`(S, share) entries fit
    `budget` (what `slots_for_budget` would give without rounding S down to a power of two or
    capping it at the rows asked); (0, 0) when not one fits."""
    from jmarl.models.generation import budget as budget_lib

    def fits(slots: int) -> bool:
        return budget_lib.engine_bytes(config, slots, budget_lib.entries_for(slots, share), prompt_len,
                                       new_tokens) <= budget

    if not fits(1):
        return 0, 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, budget_lib.entries_for(lo, share)


def program_memory(config, slots: int, entries: int, prompt_len: int, new_tokens: int, max_prefill: int) -> dict:
    """Argument and temporary bytes of the engine's compiled prefill and decode-chunk programs."""
    from jmarl import models
    from jmarl.models.generation import budget as budget_lib
    from jmarl.models.generation import engine
    from jmarl.models.generation.spec import GenerationSpec

    params = jax.eval_shape(lambda: models.init(config, jax.random.key(0)))
    out = {"slots": slots, "entries": entries, "max_prefill": max_prefill,
           "state_bytes": budget_lib.engine_bytes(config, slots, entries, prompt_len, new_tokens)}
    spec = GenerationSpec(max_new_tokens=new_tokens, max_prefill=max_prefill)
    for name, fn, args in engine.planned_programs(config, params, spec, slots=slots, entries=entries,
                                                  prompt_len=prompt_len):
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
    header = results_header("benchmarks.engine_memory", argv)  # date and load average at the start

    from jmarl.config import parse_bytes
    from jmarl.models import presets
    from jmarl.models.generation import budget as budget_lib

    config = presets.preset_config(args.model, param_dtype="bfloat16", compute_dtype="bfloat16")
    f32_config = presets.preset_config(args.model, param_dtype="float32", compute_dtype="float32")
    budget = parse_bytes(args.budget)
    p, n, k = args.prompt_len, args.new_tokens, args.share
    shared = budget_lib.slots_for_budget(config, p, n, budget, args.rows, share=k)
    copied = budget_lib.slots_for_budget(config, p, n, budget, args.rows, share=1)
    shared_any, copied_any = unrounded_slots(config, p, n, budget, k), unrounded_slots(config, p, n, budget, 1)
    result = {
        **header,
        "settings": {"model": args.model, "prompt_len": p, "new_tokens": n, "share": k, "budget_bytes": budget,
                     "rows": args.rows, "dtype": "bfloat16"},
        "bytes": {"slot": budget_lib.slot_bytes(config, n), "entry": budget_lib.entry_bytes(config, p),
                  "copied_slot": budget_lib.engine_bytes(config, 1, 1, p, n)},
        "slots": {"shared": {"slots": shared[0], "entries": shared[1]},
                  "copied": {"slots": copied[0], "entries": copied[1]},
                  "ratio": shared[0] / copied[0],
                  "unrounded": {"shared": {"slots": shared_any[0], "entries": shared_any[1]},
                                "copied": {"slots": copied_any[0], "entries": copied_any[1]},
                                "ratio": shared_any[0] / copied_any[0]}},
    }
    print(f"{args.model}, P={p}, N={n}, K={k}, budget {budget / GIB:.1f} GiB per device: "
          f"{shared[0]} slots + {shared[1]} prompt entries shared vs {copied[0]} slots with a copy each "
          f"({shared[0] / copied[0]:.1f}x; S is rounded down to a power of two: of any size, "
          f"{shared_any[0]} + {shared_any[1]} vs {copied_any[0]}, {shared_any[0] / copied_any[0]:.2f}x)")
    if not args.no_compile:
        s, q = shared
        u = budget_lib.prefill_prompts(config, p, budget)  # as a run in bf16 caps its prefill calls
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
    result.update(results_end())
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "engine_memory.json")
    write_json(out, result)
    return result


if __name__ == "__main__":
    main()
