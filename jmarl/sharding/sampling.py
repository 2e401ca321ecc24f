"""Sharded sampling: `jmarl.models.generate` on a mesh with parameters, prompt rows and the KV
cache placed by the rules."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jmarl.errors import JmarlError
from jmarl.sharding.placement import shard_batch, shard_params, shardings
from jmarl.sharding.rules import DEFAULT_RULES, ShardingRules
from jmarl.sharding.specs import cache_specs

Params = Any


def generate(
    config: Any,
    params: Params,
    prompt_tokens: Any,
    prompt_mask: Any,
    rng: jax.Array,
    mesh: Mesh,
    *,
    stacked: bool = False,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    rules: ShardingRules = DEFAULT_RULES,
) -> Any:
    """`jmarl.models.generate` (or `generate_stacked` with `stacked`) on `mesh`: parameters
    placed by `rules`, and so are the prompt rows and the KV cache (default: rows on data/fsdp,
    cache heads on tensor, policies on policy). prompt_tokens/mask [B, S] ([P, B, S] stacked) ->
    `Generation` with [(P,) B, max_new_tokens] fields, the same tokens as unsharded."""
    from jmarl.models import model as model_lib
    from jmarl.models import sampler
    from jmarl.rollouts import DEFAULT_LENGTH_BUCKETS, bucket_length

    sampler._check_options(max_new_tokens, temperature, top_p, top_k)
    tokens = np.asarray(prompt_tokens)
    mask = np.asarray(prompt_mask).astype(bool)
    if tokens.ndim != (3 if stacked else 2) or tokens.shape != mask.shape:
        raise JmarlError(f"prompt_tokens/prompt_mask must be {'[P, B, S]' if stacked else '[B, S]'}; got {tokens.shape}, {mask.shape}")
    length = bucket_length(max(int(mask.sum(axis=-1).max(initial=0)), 1), DEFAULT_LENGTH_BUCKETS)
    tokens, mask = sampler.left_align(tokens, mask, length, pad_id)
    greedy = float(temperature) == 0.0
    program = sampler._program(
        config, stacked, int(max_new_tokens), greedy, int(top_k), float(top_p) < 1.0,
        tuple(int(t) for t in stop_tokens), int(pad_id),
    )
    params = shard_params(config, params, mesh, rules=rules)
    prompts = shard_batch({"tokens": tokens, "mask": mask}, mesh, stacked=stacked, rules=rules)
    capacity = length + int(max_new_tokens) - 1
    abstract = jax.eval_shape(lambda: model_lib.empty_cache(config, tokens.shape[:-1], capacity))
    cache_sh = shardings(mesh, cache_specs(abstract, mesh, stacked=stacked, rules=rules))
    cache = jax.jit(lambda: model_lib.empty_cache(config, tokens.shape[:-1], capacity), out_shardings=cache_sh)()
    temp = jnp.float32(1.0 if greedy else temperature)
    generation, _ = program(params, cache, prompts["tokens"], prompts["mask"], None, rng, temp, jnp.float32(top_p))
    return generation
