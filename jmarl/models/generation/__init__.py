"""Generation: completions of prompts sampled from a model's KV cache, by one of two engines.

Both engines take the same `spec.GenerationSpec` (sampling options, checked once, prompt buckets,
mesh; plus the continuous engine's capacity fields) and report the same log-probs (under
softmax(logits / T) before truncation):

- static (`static.generate(config, params, prompt_tokens, prompt_mask, rng, spec, *, policy=None)`,
  `static.generate_stacked(config, params, tokens, mask, rng, spec)`): one compiled program per
  call; every row keeps its place until the call's longest row ends;
- continuous (`engine.run(config, params, prompts, n, rng, spec, *, limits=None, policy=None)`, or
  `engine.start(...)` to overlap host work): S slots sized by a KV budget, a queue, and a pool of
  shared prompt caches; a finished row's slot takes the next queued completion.

Modules, one concept each: `spec` (settings, their checks, result types), `sampling` (token
choice), `layout` (policy selection, compute-dtype cast, cache placement on a mesh), `static` (the
static sampler: host prep and its program), `budget` (the engine's slots and entries per KV
budget), `engine_programs` (the engine's device programs), `engine` (its host loop).

Which engine runs: the static one is the default (`sampling.engine: static`). On the
quickstart's own sampler calls the two take the same time: `benchmarks/results/engine.json`
(`python -m benchmarks.engine --repeats 3`, commit 6366090, 2 CPU cores), key `quickstart`
(8 calls, 1024 rows): median 0.345 s static vs 0.344 s continuous per replay (ratio 1.003), with
greedy completions equal, and 42,810 vs 38,784 new tokens/s. The continuous engine wins where
completion lengths have a long tail: on that file's long-tail workload (512 requests, lengths
min(512, floor(4 Pareto(1.1))), 64 slots) it is 5.74x faster (`ratio`; static decode
utilization 0.06 vs 0.64), so runs with such tails set `sampling.engine: continuous`.

The static sampler stays (it is not the engine's degenerate case of slots = rows, no refill)
because it does what the engine does not: it records each token's mixture-of-experts routing for
routing replay (`engine.check_no_routing_replay` refuses such configs), and it decodes the
prompts of P stacked policies in one vmapped program (`generate_stacked`: a whole multi-agent
turn is one device call), where the engine runs one policy per run.
"""
