"""What bounds each CPU row: the roofline figures docs/benchmarks.md quotes under the benchmark tables.

    python -m benchmarks.bounds [--shape cpu-small|cpu-medium|all] [--repeats 5] [--out PATH] [--cpu-results PATH]

jmarl's side only (no PyTorch); writes `benchmarks/results/bounds.json`. For the machine:

- `matmul_peak_flops`: `benchmarks.common.measure_matmul_peak` (a large fp32 XLA matmul).
- `memory_bytes_per_s`: a jitted sum over 128 MiB of fp32 (bytes read per second, best run).

For each shape, median seconds over `--repeats` runs after a compile call:

- Train step (the benchmark's step, `benchmarks.train_step.jmarl_step`) and the same step with
  every attention core swapped for a stand-in of O(tokens) cost that still uses q, k and v
  (`attention_ablated`; the prompt keys are still gathered per row): `attention_share` = 1 -
  ablated / full. `rest_flops` = the step's executed FLOPs without attention over the ablated
  time, against the matmul peak.
- Train-step products: every matrix product (`dot_general`) the step runs (`matrix_products`:
  read from the traced update, a product inside a scan counted once per iteration), timed alone
  in a jitted program that runs each the same number of times, one after another, on random
  operands and nothing else (`products_floor`; batched products with their batch dims leading,
  `floor_operands`): the dense layers' products and attention's batched products (per row and
  head) separately. `train_products_floor_s` = their sum: what the step would take if nothing
  but its products ran, one after another; `train_step_floor_executed_fraction` = the executed
  FLOPs over that floor, against the peak: the most those products allow.
- Generation, batch 64 (8 prompts x 8) and batch 8, 64 new tokens (`jmarl.models.generate`);
  `prefill`: the same call with one new token (the prompts' prefill, which HF runs too); and
  `decode_matmul_floor`: a jitted 64-step loop of only the decode step's matrix products (per
  layer q, k, v, o, gate, up, down; the LM head) at the same rows and weights: what generation
  would take if nothing but those products ran. `weight_read_floor`: 64 steps x the fp32 weight
  bytes / `memory_bytes_per_s` (each decode step reads every weight once). `generation_bN_floor_s`
  = prefill + decode_matmul_floor: what the row would take if the decode loop were its products;
  where `benchmarks/results/cpu.json` has HF's figure for the row, `generation_bN_ratio_at_floor`
  = HF's seconds over that floor, the best ratio those products allow.
  `generation_bN_attention_share` = 1 - (generation with the decode loop's attention over the KV
  cache swapped for a stand-in that reads one slot, `decode_attention_ablated`) / generation.
  `decode_floor_with_cache_reads_bN_s`: the same product-only loop that also reads, per layer and
  step, the keys and values an average step's attention must read (the prompt, once per group
  at batch 64, and half the new tokens; `attention_read_slots`) with a plain sum and no attention
  arithmetic; `generation_bN_floor_with_cache_reads_s` = prefill + that, and
  `generation_bN_ratio_at_floor_with_cache_reads` = HF's seconds over it: the best ratio the
  products and the unavoidable cache reads allow together (on a CPU whose caches hold the
  weights or the KV cache but not both, the reads cost more beside the products than alone).
- GRPO iteration (`benchmarks.iteration.jmarl_trainer`, one agent): the trainer's own
  `time/generate` and `time/update`, and where `benchmarks/results/cpu.json` has TRL's figure for
  the shape, the seconds per iteration that 2x TRL needs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator

from benchmarks.common import (GROUP_SIZE, NEW_TOKENS, NUM_PROMPTS, PROMPT_LEN, forward_flops_per_token,
                               generation_group_size, generation_prompts, measure_matmul_peak, results_header,
                               shared_prefix_train_flops, timed, write_checkpoint, write_json)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def median_seconds(run: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `repeats` calls of `run` (which blocks until done), after one warm-up call."""
    run()
    return statistics.median(timed(run) for _ in range(repeats))


def measure_memory_bandwidth(mib: int = 128, repeats: int = 5) -> float:
    """Bytes per second a jitted sum reads from a `mib` MiB fp32 array (best of `repeats`)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    return x.nbytes / min(timed(lambda: jax.block_until_ready(total(x))) for _ in range(repeats))


def _no_attention(q, k, v):
    """Attention stand-in: q [B,T,H,hd] plus the mean over the S keys of k + v [B,S,KV,hd] (O(B S) work)."""
    import jax.numpy as jnp

    heads, kv = q.shape[2], k.shape[2]
    mixed = jnp.mean(k + v, axis=1, keepdims=True)  # [B, 1, KV, hd]
    return q + jnp.repeat(mixed, heads // kv, axis=2)


@contextlib.contextmanager
def attention_ablated() -> Iterator[None]:
    """Within the block, functions traced through `jmarl.models.model` use `_no_attention`
    instead of the attention entry points of `jmarl.models.attention` (programs compiled inside
    keep it; the originals are restored)."""
    from jmarl.models import attention

    originals = attention.attention, attention.prefixed_attention
    attention.attention = lambda q, k, v, *args, **kwargs: _no_attention(q, k, v)
    attention.prefixed_attention = lambda q, k, v, *args, **kwargs: _no_attention(q, k, v)
    try:
        yield
    finally:
        attention.attention, attention.prefixed_attention = originals


def _cache_reads(keys, values) -> Any:
    """The first cache slot's keys + values [B,KV,hd] of the first block (what the decode-attention
    stand-ins read: every cache buffer stays in use, at O(B KV hd) cost)."""
    from jmarl.models.model import _blocks

    return _blocks(keys)[0][:, :, :, 0] + _blocks(values)[0][:, :, 0, :]


def _no_cached_attention(q, keys, values, key_mask):
    """Decode-attention stand-in for `cached_attention`: q [B,1,H,hd] plus the first slot's keys and
    values of its kv head (no scores, no softmax, no pass over the cache)."""
    import jax.numpy as jnp

    reads = _cache_reads(keys, values)  # [B,KV,hd]
    return q + jnp.repeat(reads, q.shape[2] // reads.shape[1], axis=1)[:, None].astype(q.dtype)


def _no_prefixed_cached_attention(q, prefix_keys, prefix_values, prefix_mask, keys, values, key_mask, **_):
    """Stand-in for `prefixed_cached_attention`: `_no_cached_attention` plus its group's prompt's
    first slot (the shared prompt cache stays in use too)."""
    import jax.numpy as jnp

    heads, kv = q.shape[2], prefix_keys.shape[1]
    prompt = jnp.repeat(_cache_reads(prefix_keys, prefix_values), q.shape[0] // prefix_keys.shape[0], axis=0)
    return _no_cached_attention(q, keys, values, key_mask) + jnp.repeat(prompt, heads // kv, axis=1)[:, None]


@contextlib.contextmanager
def decode_attention_ablated() -> Iterator[None]:
    """Within the block, generation programs traced afresh run the decode loop's attention over
    the KV cache as the stand-ins above (the prefill keeps its attention, and every cache write
    stays); generation programs compiled before or inside are dropped on entry and exit."""
    from jmarl.models import model, sampler

    originals = model.cached_attention, model.prefixed_cached_attention
    sampler._program.cache_clear()
    model.cached_attention, model.prefixed_cached_attention = _no_cached_attention, _no_prefixed_cached_attention
    try:
        yield
    finally:
        model.cached_attention, model.prefixed_cached_attention = originals
        sampler._program.cache_clear()


def bound_train_step(shape: str, config, params, repeats: int, peak: float) -> dict[str, float]:
    """Train-step seconds with and without attention, and what the rest executes (see module doc)."""
    from benchmarks.parity import make_batch
    from benchmarks.train_step import jmarl_step, jmarl_update

    batch = make_batch(config.vocab_size, NUM_PROMPTS * GROUP_SIZE, PROMPT_LEN, NEW_TOKENS, group_size=GROUP_SIZE)
    full, _ = jmarl_step(config, params, batch)
    full_s = median_seconds(lambda: full(0), repeats)
    update, state, device_batch = jmarl_update(config, params, batch)
    products = matrix_products(update, state, None, device_batch)
    dense = [p for p in products if not p.batched]
    attention = [p for p in products if p.batched]
    dense_s = median_seconds(products_floor(dense), repeats)
    attention_s = median_seconds(products_floor(attention), repeats) if attention else 0.0
    with attention_ablated():
        ablated, _ = jmarl_step(config, params, batch)
        ablated(0)  # compiled with the stand-in
    ablated_s = median_seconds(lambda: ablated(0), repeats)
    layout = batch.shared_prefix()
    (prefixes, p_len), (rows, c_len) = layout["prefix_tokens"].shape, layout["tokens"].shape
    executed = shared_prefix_train_flops(shape, prefixes, p_len, rows, c_len)
    without_attention = 3.0 * forward_flops_per_token(shape, 0) * (prefixes * p_len + rows * c_len)
    return {
        "train_step_s": full_s,
        "train_step_attention_ablated_s": ablated_s,
        "attention_share": 1.0 - ablated_s / full_s,
        "train_step_executed_flops": executed / full_s,
        "train_step_executed_fraction_of_peak": executed / full_s / peak,
        "rest_flops": without_attention / ablated_s,
        "rest_fraction_of_peak": without_attention / ablated_s / peak,
        "train_products_flops_per_step": total_flops(products),
        "train_dense_products_s": dense_s,
        "train_dense_products_fraction_of_peak": total_flops(dense) / dense_s / peak,
        "train_attention_products_s": attention_s,
        "train_attention_products_fraction_of_peak":
            total_flops(attention) / attention_s / peak if attention else 0.0,
        "train_products_floor_s": dense_s + attention_s,
        "train_step_over_products_floor": full_s / (dense_s + attention_s),
        "train_step_floor_executed_fraction": executed / (dense_s + attention_s) / peak,
    }


@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix-product signature of a traced function: operand shapes, `jax.lax.dot_general`
    dimension numbers ((lhs contracting, rhs contracting), (lhs batch, rhs batch)), dtype, and how
    many times one call of the function runs it."""

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    dimension_numbers: tuple
    dtype: str
    count: int

    @property
    def batched(self) -> bool:
        """Whether the product has batch dimensions (attention's per-row, per-head products)."""
        return bool(self.dimension_numbers[1][0])

    @property
    def flops(self) -> float:
        """FLOPs of one run: 2 x batch x m x k x n (`as_batched_matmul`)."""
        batch, m, k, n = self.as_batched_matmul()
        return 2.0 * batch * m * k * n

    def as_batched_matmul(self) -> tuple[int, int, int, int]:
        """(batch, m, k, n): the product as a batch of [m, k] x [k, n] matrix products (the batch,
        free and contracted dims each flattened; batch 1 without batch dims)."""
        (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = self.dimension_numbers
        batch = math.prod(self.lhs[i] for i in lhs_batch)
        k = math.prod(self.lhs[i] for i in lhs_contracting)
        m = math.prod(d for i, d in enumerate(self.lhs) if i not in lhs_contracting and i not in lhs_batch)
        n = math.prod(d for i, d in enumerate(self.rhs) if i not in rhs_contracting and i not in rhs_batch)
        return batch, m, k, n


def matrix_products(fn: Callable[..., Any], *args: Any) -> list[Product]:
    """Every `dot_general` that fn(*args) runs, one `Product` per signature, in first-seen order.
    Nested jaxprs (jit, remat, custom derivatives, scans) are walked; a product inside a scan of
    length n counts n times. Raises ValueError on a while loop or a cond (their run counts are not
    known from the trace)."""
    import jax

    counts: collections.Counter = collections.Counter()

    def walk(jaxpr, times: int) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                lhs, rhs = (v.aval for v in eqn.invars[:2])
                key = (tuple(lhs.shape), tuple(rhs.shape), eqn.params["dimension_numbers"], str(lhs.dtype))
                counts[key] += times
                continue
            if name in ("while", "cond"):
                raise ValueError(f"matrix_products: a {name} in the traced function; its run count is unknown")
            inner = times * eqn.params["length"] if name == "scan" else times
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub, inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr, 1)
    return [Product(lhs, rhs, dims, dtype, n) for (lhs, rhs, dims, dtype), n in counts.items()]


BATCHED_MATMUL = (((2,), (1,)), ((0,), (0,)))  # [b, m, k] x [b, k, n] -> [b, m, n]


def total_flops(products: list[Product]) -> float:
    """FLOPs of every run of every product."""
    return sum(p.flops * p.count for p in products)


def floor_operands(p: Product) -> tuple[tuple[int, ...], tuple[int, ...], tuple]:
    """(lhs shape, rhs shape, dimension numbers) a floor runs `p` as: a product without batch dims
    as the traced function wrote it (XLA reads either operand transposed in place); a batched one
    as [batch, m, k] x [batch, k, n], batch dims leading, so that the floor times the products and
    not the copies XLA adds to bring scattered batch dims to the front (in the traced program the
    operands' producers write them in the layout the product needs)."""
    if not p.batched:
        return p.lhs, p.rhs, p.dimension_numbers
    batch, m, k, n = p.as_batched_matmul()
    return (batch, m, k), (batch, k, n), BATCHED_MATMUL


def floor_inputs(products: list[Product], seed: int = 0) -> list[tuple[Any, Any]]:
    """The random normal (lhs, rhs) pair, in `floor_operands`' shapes, that `products_floor` runs
    each product on."""
    import jax

    keys = jax.random.split(jax.random.key(seed), 2 * max(len(products), 1))
    pairs = []
    for i, p in enumerate(products):
        lhs, rhs, _ = floor_operands(p)
        pairs.append((jax.random.normal(keys[2 * i], lhs, p.dtype), jax.random.normal(keys[2 * i + 1], rhs, p.dtype)))
    return pairs


def products_floor(products: list[Product], seed: int = 0) -> Callable[[], Any]:
    """run() -> the outputs of a jitted program that runs each product `count` times
    (`floor_operands`' form, same FLOPs) on random operands and nothing else. Each run writes one
    element of the previous output (through tanh; the first run: 0) into its lhs's first element,
    so no run can be hoisted out of its loop or merged with another."""
    import jax
    import jax.numpy as jnp

    operands = floor_inputs(products, seed)

    def repeated(count: int, dims: tuple, a: jax.Array, b: jax.Array) -> jax.Array:
        def body(_, carry):
            a, out = carry
            first = jnp.tanh(out.reshape(-1)[:1]).astype(a.dtype).reshape((1,) * a.ndim)
            a = jax.lax.dynamic_update_slice(a, first, (0,) * a.ndim)
            return a, jax.lax.dot_general(a, b, dims)

        out = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), a, b)
        return jax.lax.fori_loop(0, count, body, (a, jnp.zeros(out.shape, out.dtype)))[1]

    program = jax.jit(lambda ops: [repeated(p.count, floor_operands(p)[2], a, b) for p, (a, b) in zip(products, ops)])
    return lambda: jax.block_until_ready(program(operands))


def attention_read_slots(rows: int, prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS) -> tuple[int, int, int]:
    """What one average decode step's attention must read, per layer, as (prompts, prompt slots,
    own slots per row): decode step t (1 .. new_tokens - 1) attends to the prompt and to t
    generated tokens (t - 1 earlier ones and its own), new_tokens / 2 on average. Each prompt is
    read once for the rows that share it (`generation_group_size`: 8 at batch 64)."""
    prompts = rows // generation_group_size(rows)
    return prompts, prompt_len, new_tokens // 2


def decode_matmul_floor(
    config, params, rows: int, steps: int = NEW_TOKENS, *, cache_reads: bool = False, seed: int = 0
) -> Callable[[], Any]:
    """A jitted loop of `steps` decode steps that run only the model's matrix products on [rows, D]
    activations (per layer q, k, v, o, gate, up, down; then the LM head). Returns run() -> logits.

    cache_reads: each layer also reads, once, fp32 keys and values of the size an average step's
    attention needs (`attention_read_slots`: [prompts, KV, hd, S] for the prompts and [rows, KV,
    hd, n/2] for each row's generated tokens, random, passed to the program as arguments), as a
    plain sum per row and head whose result feeds the next layer: the products plus the bytes
    attention cannot avoid reading, and no attention arithmetic."""
    import jax
    import jax.numpy as jnp

    layers = params["layers"]
    names = (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
             ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
    weights = {f"{a}.{b}": layers[a][b]["kernel"] for a, b in names}
    head = params["lm_head"]["kernel"] if params.get("lm_head") else params["embed"]["embedding"].T
    prompts, prompt_slots, own_slots = attention_read_slots(rows)
    kv, hd = config.num_kv_heads, config.head_dim
    caches = []
    if cache_reads:
        key = jax.random.key(seed)
        shapes = ((prompts, kv, hd, prompt_slots), (prompts, kv, prompt_slots, hd), (rows, kv, hd, own_slots),
                  (rows, kv, own_slots, hd))
        caches = [[jax.random.normal(jax.random.fold_in(key, 4 * i + j), shape, jnp.float32)
                   for j, shape in enumerate(shapes)] for i in range(config.num_layers)]

    def read(cache, x):
        """[rows, 1]: a sum over the layer's prompt and own keys and values, per row, of
        max(entry, a value of x) (so the read is neither hoisted out of the loop nor dropped)."""
        floor = x[0, 0] * 1e-6 - 10.0
        prompt = sum(jnp.sum(jnp.maximum(a, floor), axis=(1, 2, 3)) for a in cache[:2])  # [prompts]
        own = sum(jnp.sum(jnp.maximum(a, floor), axis=(1, 2, 3)) for a in cache[2:])  # [rows]
        return 1e-6 * (jnp.repeat(prompt, rows // prompts) + own)[:, None]

    def step(x, caches):
        for i in range(config.num_layers):
            w = {k: v[i] for k, v in weights.items()}
            q, k, v = x @ w["attn.q_proj"], x @ w["attn.k_proj"], x @ w["attn.v_proj"]
            if cache_reads:
                q = q + read(caches[i], x)
            # every output of k and v stays in use (a slice of k or v would let XLA shrink the product)
            x = x + q @ w["attn.o_proj"] + jnp.tanh(k).sum(-1, keepdims=True) + jnp.tanh(v).sum(-1, keepdims=True)
            x = x + (x @ w["mlp.gate_proj"] * (x @ w["mlp.up_proj"])) @ w["mlp.down_proj"]
        return x * 0.5 + jnp.tanh(x @ head)[:, : x.shape[1]]

    @jax.jit
    def loop(x0, caches):
        return jax.lax.fori_loop(0, steps, lambda _, x: step(x, caches), x0)

    x0 = jax.random.normal(jax.random.key(0), (rows, config.hidden_size), jnp.float32)
    return lambda: jax.block_until_ready(loop(x0, caches))


GENERATION_ROWS = {64: "generation_vs_hf_generate", 8: "generation_small_batch_vs_hf_generate"}


def bound_generation(
    shape: str, config, params, repeats: int, bandwidth: float, cpu_results: dict[str, Any] | None = None
) -> dict[str, float]:
    """Generation seconds at batch 64 and 8 beside the product-only and weight-read floors; where
    `cpu_results` has HF's figure for the row, the ratio over HF that the floor would give."""
    import jax
    import numpy as np

    from jmarl.models import generate

    out: dict[str, float] = {}
    # every weight is read once per step, except the embedding, of which only the B looked-up rows
    # are read (unless it is also the tied LM head)
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    weight_bytes = 4.0 * (config.num_params() - embedding)
    rng = np.random.default_rng(0)
    for batch in (64, 8):
        _, prompts = generation_prompts(config.vocab_size, batch, rng)
        mask = np.ones_like(prompts, bool)

        def run(new_tokens: int = NEW_TOKENS) -> None:
            g = generate(config, params, prompts, mask, jax.random.key(0), max_new_tokens=new_tokens,
                         temperature=1.0, stop_tokens=())
            jax.block_until_ready(g.tokens)

        gen_s = median_seconds(run, repeats)
        prefill_s = median_seconds(lambda: run(1), repeats)
        floor_s = median_seconds(decode_matmul_floor(config, params, batch), repeats)
        reads_s = median_seconds(decode_matmul_floor(config, params, batch, cache_reads=True), repeats)
        with decode_attention_ablated():
            ablated_s = median_seconds(run, repeats)
        out[f"generation_b{batch}_s"] = gen_s
        out[f"generation_b{batch}_attention_ablated_s"] = ablated_s
        out[f"generation_b{batch}_attention_share"] = 1.0 - ablated_s / gen_s
        out[f"prefill_b{batch}_s"] = prefill_s
        out[f"decode_matmul_floor_b{batch}_s"] = floor_s
        out[f"decode_matmul_floor_b{batch}_flops"] = NEW_TOKENS * batch * forward_flops_per_token(shape, 0) / floor_s
        out[f"generation_b{batch}_over_floor"] = gen_s / floor_s
        out[f"generation_b{batch}_floor_s"] = prefill_s + floor_s
        out[f"decode_floor_with_cache_reads_b{batch}_s"] = reads_s
        out[f"generation_b{batch}_floor_with_cache_reads_s"] = prefill_s + reads_s
        out[f"generation_b{batch}_over_floor_with_cache_reads"] = gen_s / (prefill_s + reads_s)
        for row in (cpu_results or {}).get("rows", []):
            if row.get("name") == GENERATION_ROWS[batch] and row.get("size") == shape:
                hf_s = batch * NEW_TOKENS / row["baseline"]
                out[f"hf_generate_b{batch}_s"] = hf_s
                out[f"generation_b{batch}_ratio_at_floor"] = hf_s / out[f"generation_b{batch}_floor_s"]
                out[f"generation_b{batch}_ratio_at_floor_with_cache_reads"] = (
                    hf_s / out[f"generation_b{batch}_floor_with_cache_reads_s"])
    out["weight_bytes"] = weight_bytes
    out["weight_read_floor_s"] = NEW_TOKENS * weight_bytes / bandwidth
    return out


def bound_grpo_iteration(shape: str, repeats: int, cpu_results: dict[str, Any] | None) -> dict[str, float]:
    """The trainer's generate / update split of a GRPO iteration, and the time 2x TRL needs."""
    from benchmarks.iteration import jmarl_trainer

    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "model")
        write_checkpoint(shape, ckpt)
        trainer = jmarl_trainer(ckpt, os.path.join(d, "jmarl"), num_agents=1)
        metrics = []
        for i in range(repeats + 2):  # the first two compile and warm up
            m = trainer.rl_step()
            trainer.step += 1
            if i >= 2:
                metrics.append(m)
    out = {f"grpo_{k.split('/')[1]}_s": statistics.median(m[k] for m in metrics)
           for k in ("time/step", "time/generate", "time/update")}
    for row in (cpu_results or {}).get("rows", []):
        if row.get("name") == "grpo_iteration_vs_trl" and row.get("size") == shape:
            out["trl_completions_per_s"] = row["baseline"]
            out["grpo_step_s_for_2x_trl"] = NUM_PROMPTS * GROUP_SIZE / (2.0 * row["baseline"])
    return out


def run_shape(shape: str, repeats: int, peak: float, bandwidth: float, cpu_results: dict | None) -> dict[str, Any]:
    """Every bound of one reference shape."""
    from jmarl.models import load_hf

    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(shape, d, tokenizer=False)
        config, params = load_hf(d)
    out: dict[str, Any] = {"params": config.num_params()}
    out.update(bound_train_step(shape, config, params, repeats, peak))
    out.update(bound_generation(shape, config, params, repeats, bandwidth, cpu_results))
    out.update(bound_grpo_iteration(shape, repeats, cpu_results))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["cpu-small", "cpu-medium", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "bounds.json"))
    parser.add_argument("--cpu-results", default=None,
                        help="the suite's results to read HF's and TRL's figures from (run on the same machine; "
                             "default benchmarks/results/cpu.json where it exists)")
    args = parser.parse_args(argv)
    shapes = ["cpu-small", "cpu-medium"] if args.shape == "all" else [args.shape]
    if args.cpu_results is not None and not os.path.exists(args.cpu_results):
        parser.error(f"--cpu-results {args.cpu_results}: no such file (run `python -m benchmarks.run --suite cpu "
                     "--out-dir DIR` first, or leave the option out)")
    cpu_path = args.cpu_results or os.path.join(RESULTS_DIR, "cpu.json")
    cpu_results = json.load(open(cpu_path)) if os.path.exists(cpu_path) else None
    peak = measure_matmul_peak()["matmul_peak_flops"]
    bandwidth = measure_memory_bandwidth()
    results: dict[str, Any] = {
        **results_header("benchmarks.bounds", argv),
        "matmul_peak_flops": peak, "memory_bytes_per_s": bandwidth, "shapes": {},
    }
    print(f"[machine] matmul peak {peak / 1e9:.0f} GFLOP/s, memory {bandwidth / 1e9:.1f} GB/s", flush=True)
    for shape in shapes:
        start = time.perf_counter()
        results["shapes"][shape] = figures = run_shape(shape, args.repeats, peak, bandwidth, cpu_results)
        print(f"[{shape}] ({time.perf_counter() - start:.0f} s) " + ", ".join(
            f"{k} {v:.4g}" for k, v in figures.items()), flush=True)
    write_json(args.out, results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from jmarl.host_memory import apply_on_cpu

    apply_on_cpu()  # jmarl's CPU host memory policy, before JAX starts (JMARL_KEEP_HOST_MEMORY=0: off)
    raise SystemExit(main())
