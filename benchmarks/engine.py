"""Continuous batching (`jmarl.models.generation.engine`) vs the static sampler on a long-tail workload.

    python -m benchmarks.engine [--quick] [--repeats 1] [--quickstart-repeats 15]

Workload: a random model (`ModelConfig` below, fp32), 512 requests (--quick: 128) of one
completion each, distinct 16-token prompts, completion lengths drawn from a heavy-tailed law,
L = min(512, floor(4 * P)) with P Pareto(alpha = 1.1, x_min = 1) (--quick: capped at 256), seed
0. Lengths are forced, not left to a stop token (a random model's stop-token rate cannot be
controlled): no stop tokens, and

- continuous: the engine with 64 slots (`num_slots`, i.e. a KV budget of 64 slots) and a
  per-request limit `limits[r] = L_r`: a slot is refilled as soon as its row has L_r tokens;
- static: the same requests in order, in fixed batches of 64 rows (the same 64 rows in flight),
  each batch one `jmarl.models.generate` call with max_new_tokens = the longest L of the batch
  (what a static batch costs: every row keeps its slot until the batch's longest row ends; the
  shorter rows' extra tokens are not counted).

Both sample at temperature 1 with the same seed. Throughput = sum of L_r (the useful new
tokens) / seconds, after one untimed warm-up pass of the whole workload on each side (compiles
excluded). Also reported, from each side's own counters of its last timed pass:

- row utilization: real rows (completions asked) / decoded rows (static: the rows of each
  `generate` call's output; continuous: `EngineStats.rows`, the completions its slots decoded);
- decode utilization: useful new tokens / token positions decoded (static: each call's rows x
  the steps its decode loop ran, i.e. its longest output; continuous: `EngineStats.slot_steps`,
  S x the decode steps of every chunk, plus one position per completion for the first token it
  samples when its slot starts);
- slot utilization: static, sum L / (64 x the sum of the batches' longest L) (the same figure as
  its decode utilization); continuous, `busy_slot_steps / slot_steps` (decode chunks only);
- the engine's queue wait (decode chunks a request waited before its slot started).

Writes `benchmarks/results/engine.json` (--quick: `engine_quick.json`).

Quickstart replay (`quickstart`, skipped with --no-quickstart): the sampler calls of two RL
steps of `configs/quickstart.yaml`, recorded and replayed through both engines,
`--quickstart-repeats` timed passes each (a pass is about 0.3 s on 2 cores, and a shared
machine's load moves single passes by 10-30%, hence more passes than the long-tail side); with the
continuous engine's counters over the timed passes (`quickstart.continuous.engine`: its runs,
those served by one fused program, decode calls and those whose slots read their prompts in
groups, prefill calls).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from benchmarks.common import results_end, results_header, write_json

CONFIG = dict(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4,
              num_heads=4, num_kv_heads=2, head_dim=32)
SLOTS = 64
PROMPT_LEN = 16
CHUNK_STEPS = 8


def workload(requests: int, max_len: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], np.ndarray]:
    """(prompts, lengths int32[requests]): distinct random prompts and heavy-tailed lengths."""
    rs = np.random.default_rng(seed)
    prompts = [rs.integers(3, vocab, PROMPT_LEN).tolist() for _ in range(requests)]
    lengths = np.minimum(max_len, np.floor(4 * (1 + rs.pareto(1.1, requests)))).astype(np.int32)
    return prompts, np.maximum(lengths, 1)


def run_static(config, params, prompts, lengths, rng) -> tuple[float, dict[str, int]]:
    """Seconds and counters of the static side: real rows, decoded rows (the rows of each call's
    output), decoded positions (each call's rows x the steps its decode loop ran: its longest
    output, every row decoding until the last one stops) and the useful new tokens kept."""
    from jmarl import models
    from jmarl.models import GenerationSpec
    from jmarl.train.sampling import left_pad

    start = time.perf_counter()
    outputs = []
    for b in range(0, len(prompts), SLOTS):
        part = prompts[b:b + SLOTS]
        longest = int(lengths[b:b + SLOTS].max())
        tokens, mask = left_pad(part, SLOTS, PROMPT_LEN, 0)
        gen = models.generate(config, params, tokens, mask, jax.random.fold_in(rng, b),
                              GenerationSpec(max_new_tokens=longest, temperature=1.0))
        jax.block_until_ready(gen.tokens)
        outputs.append((len(part), gen.lengths))
    seconds = time.perf_counter() - start
    counts = {"rows": 0, "decoded_rows": 0, "decoded_positions": 0, "useful_tokens": 0}
    for b, (real, made) in zip(range(0, len(prompts), SLOTS), outputs):
        made = np.asarray(made)
        counts["rows"] += real
        counts["decoded_rows"] += made.shape[0]
        counts["decoded_positions"] += made.shape[0] * int(made.max())
        counts["useful_tokens"] += int(np.minimum(made[:real], lengths[b:b + real]).sum())
    return seconds, counts


def run_engine(config, params, prompts, lengths, rng):
    """Seconds, `EngineStats` and the completions returned of the continuous side."""
    from jmarl.models.generation import engine
    from jmarl.models.generation.spec import GenerationSpec

    start = time.perf_counter()
    spec = GenerationSpec(max_new_tokens=int(lengths.max()), temperature=1.0, num_slots=SLOTS,
                          chunk_steps=CHUNK_STEPS)
    res = engine.run(config, params, prompts, 1, rng, spec, limits=lengths.tolist())
    seconds = time.perf_counter() - start
    made = sum(len(c[0][0]) for c in res.completions)
    assert made == int(lengths.sum()), (made, int(lengths.sum()))
    return seconds, res.stats, sum(len(c) for c in res.completions)


def utilizations(static: dict[str, int], stats, completions: int, useful: int) -> dict[str, dict[str, float]]:
    """Row and decode utilization of both sides from their counters (module docstring)."""
    return {
        "static": {"row_utilization": static["rows"] / static["decoded_rows"],
                   "decode_utilization": static["useful_tokens"] / static["decoded_positions"]},
        "continuous": {"row_utilization": completions / stats.rows,
                       "decode_utilization": useful / (stats.slot_steps + stats.rows)},
    }


def quickstart(steps: int = 2, repeats: int = 3) -> dict:
    """The quickstart's own sampler calls: `configs/quickstart.yaml` (warm start off) runs
    `steps` RL steps with the static sampler while every `sample` call (requests, n, key) is
    recorded; the calls are then replayed through a static and a continuous `ModelSampler` over
    the same policies (one untimed warm-up pass each, then `repeats` timed passes A B A B).
    Greedy agreement of the two is checked on the recorded requests too."""
    from jmarl.config import load_config
    import dataclasses

    from jmarl.train.sampling import ModelSampler
    from jmarl.train.trainer import Trainer

    config = load_config("configs/quickstart.yaml", ["train.warm_start.steps=0", "output_dir=/tmp/jmarl-engine-bench",
                                                      "logging.tensorboard=false", "logging.plots=false",
                                                      "logging.progress=false"])
    trainer = Trainer(config)
    calls = []
    sample = trainer.sampler.sample

    def recording(requests, n, rng):
        calls.append((list(requests), n, rng))
        return sample(requests, n, rng)

    trainer.sampler.sample = recording
    for _ in range(steps):
        trainer.rl_step()
        trainer.step += 1
    base = config.sampling
    samplers = {name: ModelSampler(trainer.policies, dataclasses.replace(base, engine=name))
                for name in ("static", "continuous")}

    def replay(sampler) -> float:
        start = time.perf_counter()
        for requests, n, rng in calls:
            sampler.sample(requests, n, rng)
        return time.perf_counter() - start

    from jmarl.models.generation.spec import EngineStats

    for sampler in samplers.values():  # warm-up: compiles
        replay(sampler)
        sampler.take_stats()
        sampler.new_tokens = 0
        sampler.engine_stats = EngineStats()
    seconds = {name: [] for name in samplers}
    for _ in range(repeats):
        for name, sampler in samplers.items():
            seconds[name].append(replay(sampler))
    out: dict = {"calls": len(calls), "rows": sum(len(r) * n for r, n, _ in calls)}
    for name, sampler in samplers.items():
        stats = sampler.take_stats()
        med = float(np.median(seconds[name]))
        out[name] = {"seconds": seconds[name], "new_tokens_per_s": sampler.new_tokens / sum(seconds[name]),
                     **{k: v for k, v in stats.items() if k.startswith("rollout/")}}
        out[name]["median_seconds"] = med
    st = samplers["continuous"].engine_stats
    out["continuous"]["engine"] = {"sampler_calls": len(calls) * repeats, "fused_runs": st.fused, "chunks": st.chunks,
                                   "grouped_chunks": st.grouped_chunks, "prefill_calls": st.prefills}
    out["ratio"] = out["static"]["median_seconds"] / out["continuous"]["median_seconds"]
    greedy = {name: ModelSampler(trainer.policies, dataclasses.replace(base, engine=name, temperature=0.0))
              for name in samplers}
    requests, n, rng = calls[0]
    a, b = (greedy[name].sample(requests, n, rng) for name in ("static", "continuous"))
    out["greedy_equal"] = all(np.array_equal(x.completion_tokens, y.completion_tokens)
                              for ca, cb in zip(a, b) for x, y in zip(ca, cb))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 requests, lengths up to 256")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each side (medians reported)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-quickstart", action="store_true", help="skip the quickstart replay")
    parser.add_argument("--quickstart-repeats", type=int, default=15,
                        help="timed passes of each side of the quickstart replay (at least --repeats)")
    args = parser.parse_args(argv)
    header = results_header("benchmarks.engine", argv)  # date and load average at the start

    from jmarl import models

    config = models.ModelConfig(**CONFIG)
    params = jax.jit(models.init, static_argnums=0)(config, jax.random.key(0))
    requests, max_len = (128, 256) if args.quick else (512, 512)
    prompts, lengths = workload(requests, max_len, config.vocab_size)
    rng = jax.random.key(1)
    useful = int(lengths.sum())

    t0 = time.perf_counter()
    run_engine(config, params, prompts, lengths, rng)  # warm-up: compiles
    engine_warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_static(config, params, prompts, lengths, rng)
    static_warmup = time.perf_counter() - t0
    engine_s, static_s = [], []
    for _ in range(args.repeats):  # A B A B
        seconds, stats, completions = run_engine(config, params, prompts, lengths, rng)
        engine_s.append(seconds)
        seconds, static_counts = run_static(config, params, prompts, lengths, rng)
        static_s.append(seconds)
    e, s = float(np.median(engine_s)), float(np.median(static_s))
    used = utilizations(static_counts, stats, completions, useful)
    result = {
        **header,
        "workload": {
            "requests": requests, "prompt_len": PROMPT_LEN, "slots": SLOTS, "chunk_steps": CHUNK_STEPS,
            "lengths": "min(max_len, floor(4 * Pareto(1.1))), seed 0", "max_len": max_len,
            "new_tokens": useful, "length_mean": float(lengths.mean()), "length_p50": float(np.median(lengths)),
            "length_p90": float(np.percentile(lengths, 90)), "length_max": int(lengths.max()),
            "model": CONFIG, "temperature": 1.0,
        },
        "continuous": {
            "seconds": engine_s, "tokens_per_s": useful / e, **used["continuous"],
            "slot_utilization": stats.busy_slot_steps / stats.slot_steps,
            "rows": completions, "decoded_rows": stats.rows, "slot_steps": stats.slot_steps,
            "queue_wait_chunks": stats.queue_wait_chunks / stats.requests, "chunks": stats.chunks,
            "prefill_calls": stats.prefills, "warmup_seconds": engine_warmup,
        },
        "static": {
            "seconds": static_s, "tokens_per_s": useful / s, **used["static"],
            "slot_utilization": static_counts["useful_tokens"] / static_counts["decoded_positions"],
            **static_counts, "calls": -(-requests // SLOTS),
            "warmup_seconds": static_warmup,
        },
        "ratio": s / e,
    }
    if not args.no_quickstart:
        result["quickstart"] = quickstart(repeats=max(args.repeats, args.quickstart_repeats))
    result.update(results_end())
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   "engine_quick.json" if args.quick else "engine.json")
    write_json(out, result)
    for side, seconds in (("continuous", e), ("static", s)):
        r = result[side]
        print(f"{side}: {useful / seconds:.0f} new tok/s ({seconds:.2f} s), row utilization {r['row_utilization']:.3f}, "
              f"decode utilization {r['decode_utilization']:.3f}, slot utilization {r['slot_utilization']:.3f}")
    print(f"new tokens {useful}: ratio {s / e:.2f}x -> {out}")
    if "quickstart" in result:
        q = result["quickstart"]
        print(f"quickstart replay ({q['calls']} calls, {q['rows']} rows): "
              f"static {q['static']['median_seconds']:.2f} s, "
              f"continuous {q['continuous']['median_seconds']:.2f} s, ratio {q['ratio']:.2f}x, row utilization "
              f"static {q['static'].get('rollout/row_utilization')}, continuous "
              f"{q['continuous'].get('rollout/row_utilization')}, decode utilization static "
              f"{q['static'].get('rollout/decode_utilization', 0):.3f}, continuous "
              f"{q['continuous'].get('rollout/decode_utilization', 0):.3f}, greedy equal {q['greedy_equal']}, "
              f"engine {q['continuous']['engine']}")
    return result


if __name__ == "__main__":
    main()
