"""LoRA run unmerged (`attach_lora`: x W + s (x A) B): the same numbers as merged weights
(`merge_lora`) in every path the model runs (full forward, packed learner, KV-cache
sampler, stacked policies), the same adapter gradients, and one base in memory for many
adapters."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _tiny_models import tiny_qwen3
from jmarl import models, sharding
from jmarl.models import kv_cache as kv_cache_lib
from jmarl.models import layers as layers_lib
from jmarl.models import GenerationSpec
from jmarl.models.generation import layout, static
from jmarl.models.layers import LoraKernel
from jmarl.train.lora import attach_lora, init_lora, merge_lora
from jmarl.train.policies import PolicyGroup
from jmarl.batch import MODEL_INPUTS
from jmarl.train.packing import pack, packed_logprobs, plain_samples

TINY = tiny_qwen3()
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
RANK, ALPHA = 4, 8.0
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.partial(jax.jit, static_argnums=1)
def _adapters(base, seed: int):
    """Adapters on every projection and the LM head with random non-zero A and B (a fresh
    adapter's B is zero)."""
    ad = init_lora(base, jax.random.key(seed), rank=RANK, target_modules=ALL)
    keys = iter(jax.random.split(jax.random.key(seed + 100), len(jax.tree.leaves(ad))))
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), ad)


def _attached(base, ad):
    return attach_lora(base, ad, rank=RANK, alpha=ALPHA)


@jax.jit
def _merged(base, ad):
    return merge_lora(base, ad, rank=RANK, alpha=ALPHA)


@jax.jit
def _stack(*trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _fast(fn, *args):
    """fn(*args), jitted and compiled without LLVM's expensive passes (the same numbers, a
    faster compile)."""
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST)(*args)


def _close(a, b, rtol=1e-5, atol=1e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


def _packed_batch(rng):
    """2 prompts (6 and 4 tokens) each continued by 2 samples (5 and 3, 4 and 5 tokens), packed."""
    rows = []
    for plen, lens in ((6, (5, 3)), (4, (4, 5))):
        prompt = rng.integers(3, TINY.vocab_size, plen).tolist()
        rows += [(prompt, rng.integers(3, TINY.vocab_size, n).tolist()) for n in lens]
    tokens = np.zeros((4, 11), np.int32)
    attn, loss = np.zeros((4, 11), bool), np.zeros((4, 11), bool)
    for i, (p, c) in enumerate(rows):
        tokens[i, :len(p) + len(c)] = p + c
        attn[i, :len(p) + len(c)] = True
        loss[i, len(p):len(p) + len(c)] = True
    (out,) = pack([plain_samples({"tokens": tokens, "attention_mask": attn, "loss_mask": loss})])
    return {k: out[k] for k in MODEL_INPUTS}


@pytest.fixture(scope="module")
def base(tiny_qwen3_model):
    """The frozen base of every adapter here: the shared tiny model's parameters (TINY's)."""
    config, params = tiny_qwen3_model
    assert config == TINY
    return params


@pytest.fixture(scope="module")
def ad(base):
    """Adapters of seed 1 on `base`."""
    return _adapters(base, 1)


def test_attach_holds_the_base_and_adapters_unmerged(base, ad):
    params = _attached(base, ad)
    q = params["layers"]["attn"]["q_proj"]["kernel"]
    assert isinstance(q, LoraKernel) and q.scale == ALPHA / RANK
    assert q.w is base["layers"]["attn"]["q_proj"]["kernel"] and q.a is ad["layers"]["attn"]["q_proj"]["kernel"]["a"]
    assert q.shape == q.w.shape and q.dtype == q.w.dtype
    assert params["layers"]["attn"]["q_proj"]["bias"] is base["layers"]["attn"]["q_proj"]["bias"]
    assert params["embed"]["embedding"] is base["embed"]["embedding"]  # not a target: the base's own


def test_logits_and_logprobs_equal_merged(base, ad):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, TINY.vocab_size, (3, 12)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[0, :4] = False  # left padding
    mask[1, 9:] = False  # right padding
    attached, merged = _attached(base, ad), _merged(base, ad)

    @jax.jit
    def run(params):
        return models.apply(TINY, params, tokens, mask), models.token_logprobs(TINY, params, tokens, mask)

    (logits, lp), (want, want_lp) = run(attached), run(merged)
    _close(logits, want)
    _close(lp, want_lp)
    assert float(jnp.max(jnp.abs(want - run(base)[0]))) > 0.1  # the adapters matter


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_packed_logprobs_and_adapter_gradients_equal_merged(remat, monkeypatch, base, ad):
    """The learner's path (packed rows, the layer scan with each remat policy, the feed-forward
    layer in token chunks, the chunked LM head): log-probs and the gradient w.r.t. A and B."""
    monkeypatch.setattr(layers_lib, "MLP_CHUNK_ELEMENTS", 4 * TINY.intermediate_size)  # chunks of 4 tokens
    config = TINY.replace(remat=remat)
    batch = _packed_batch(np.random.default_rng(1))

    def loss(params):
        lp = packed_logprobs(config, params, batch, 0.9)
        return jnp.sum(jnp.sin(lp)), lp

    (_, lp_a), g_a = _fast(jax.value_and_grad(lambda a: loss(_attached(base, a)), has_aux=True), ad)
    (_, lp_m), g_m = _fast(jax.value_and_grad(lambda a: loss(_merged(base, a)), has_aux=True), ad)
    _close(lp_a, lp_m)
    _close(g_a, g_m, rtol=1e-3, atol=1e-4)
    assert float(jnp.max(jnp.abs(g_a["layers"]["attn"]["q_proj"]["kernel"]["a"]))) > 0  # gradients reach A and B
    assert float(jnp.max(jnp.abs(g_a["lm_head"]["kernel"]["b"]))) > 0


def test_base_gets_no_gradient(base, ad):
    """The base in a LoraKernel is frozen: a gradient w.r.t. the whole attached tree is zero on W."""
    config = TINY.replace(remat="full")
    batch = _packed_batch(np.random.default_rng(2))
    grads = _fast(jax.grad(lambda p: jnp.sum(packed_logprobs(config, p, batch))), _attached(base, ad))
    q = grads["layers"]["attn"]["q_proj"]["kernel"]
    assert not np.any(np.asarray(q.w)) and np.any(np.asarray(q.a))


@pytest.mark.slow
def test_greedy_generation_equals_merged(base, ad):
    rng = np.random.default_rng(3)
    prompts = rng.integers(3, TINY.vocab_size, (4, 6)).astype(np.int32)
    mask = np.arange(6)[None] >= rng.integers(0, 3, (4, 1))
    grouped = np.repeat(prompts[:2], 2, axis=0), np.repeat(mask[:2], 2, axis=0)  # a group's shared prompt cache
    kw = dict(max_new_tokens=6, temperature=0.0)
    for toks, msk in ((prompts, mask), grouped):
        got = models.generate(TINY, _attached(base, ad), toks, msk, jax.random.key(0), GenerationSpec(**kw))
        want = models.generate(TINY, _merged(base, ad), toks, msk, jax.random.key(0), GenerationSpec(**kw))
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        _close(got.logprobs, want.logprobs)


@pytest.mark.slow
def test_stacked_policies_gradients_with_one_base(base, ad):
    """Two policies' adapters [2, ...] vmapped over with the base unmapped (the update's form):
    each policy's gradient equals the one through its merged weights."""
    ads = [ad, _adapters(base, 2)]
    batch = _packed_batch(np.random.default_rng(4))
    stacked_batch = {k: np.stack([v, v]) for k, v in batch.items()}

    def loss(ad, base, b, join):
        return jnp.sum(jnp.sin(packed_logprobs(TINY.replace(remat="full"), join(base, ad), b)))

    grads = _fast(jax.vmap(jax.grad(functools.partial(loss, join=_attached)), in_axes=(0, None, 0)),
                  _stack(*ads), base, stacked_batch)
    want = _fast(jax.vmap(jax.grad(functools.partial(loss, join=_merged)), in_axes=(0, None, None)),
                 _stack(*ads), base, batch)
    _close(grads, want, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_stacked_generation_with_one_base(base, ad):
    """Two policies' adapters [2, ...] on one base (what `PolicyGroup.full_params` gives): the
    stacked sampler and one policy of the stack decoded alone generate, greedily, what each
    policy's merged weights do."""
    ads = [ad, _adapters(base, 2)]
    attached = _attached(base, _stack(*ads))  # the base once, adapters [2, ...]: what PolicyGroup.full_params gives
    axes = layout.policy_axes(TINY, attached)
    assert axes["layers"]["attn"]["q_proj"]["kernel"] == LoraKernel(None, 0, 0, ALPHA / RANK)
    assert axes["embed"]["embedding"] is None
    rng = np.random.default_rng(5)
    prompts = rng.integers(3, TINY.vocab_size, (2, 4, 6)).astype(np.int32)
    mask = np.ones_like(prompts, bool)
    kw = dict(max_new_tokens=5, temperature=0.0)
    got = models.generate_stacked(TINY, attached, prompts, mask, jax.random.key(0), GenerationSpec(**kw))
    one = models.generate(TINY, attached, prompts[1], mask[1], jax.random.key(0), GenerationSpec(**kw), policy=1)
    for i, policy_ad in enumerate(ads):
        want = models.generate(TINY, _merged(base, policy_ad), prompts[i], mask[i], jax.random.key(0), GenerationSpec(**kw))
        np.testing.assert_array_equal(np.asarray(got.tokens[i]), np.asarray(want.tokens))
        _close(got.logprobs[i], want.logprobs)
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(got.tokens[1]))


@pytest.mark.slow
def test_bf16_base_float32_adapters(base, ad):
    """A bf16 base with bf16 compute: close to the merged weights, float32 adapter gradients."""
    config = TINY.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    bf16_base = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
    tokens = np.random.default_rng(6).integers(3, TINY.vocab_size, (2, 10)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    logprobs = jax.jit(lambda params: models.token_logprobs(config, params, tokens, mask))
    _close(logprobs(_attached(bf16_base, ad)), logprobs(_merged(bf16_base, ad)), rtol=0.05, atol=0.05)
    grads = jax.jit(jax.grad(lambda a: jnp.sum(models.token_logprobs(config, _attached(bf16_base, a), tokens, mask))))(ad)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


@pytest.mark.slow
def test_policy_group_runs_unmerged_and_exports_merged(base, ad):
    stacked = _stack(ad, _adapters(base, 2))
    group = PolicyGroup(name="lora", model_config=TINY, tokenizer=None, policy_ids=(0, 1), stacked=True,
                        lora_rank=RANK, lora_alpha=ALPHA, base=base, state=types.SimpleNamespace(params=stacked), ref=None)
    full = group.full_params()
    q = full["layers"]["attn"]["q_proj"]["kernel"]
    assert isinstance(q, LoraKernel) and q.w is base["layers"]["attn"]["q_proj"]["kernel"] and q.a.shape[0] == 2
    exported = group.policy_params(1)  # real merged weights for a Hugging Face export
    _close(exported, _merged(base, jax.tree.map(lambda x: x[1], stacked)))


@pytest.mark.slow
def test_sharding_of_attached_adapters_and_sharded_generation(base, ad, mesh):
    """Specs: a LoraKernel's w is placed like the kernel (no policy axis: one base), a and b like
    the adapters'. Stacked generation on a (policy, data, tensor) mesh equals the unsharded one."""
    stacked = _stack(ad, _adapters(base, 2))
    attached = _attached(base, stacked)
    specs = sharding.param_specs(models.param_axes(TINY), attached, {"policy": 2, "fsdp": 2, "tensor": 2})
    assert specs["layers"]["attn"]["q_proj"]["kernel"] == LoraKernel(
        P(None, "fsdp", "tensor"), P("policy", None, "fsdp"), P("policy", None, None, "tensor"), ALPHA / RANK)
    assert specs["layers"]["mlp"]["down_proj"]["kernel"].w == P(None, "tensor", "fsdp")
    assert specs["embed"]["embedding"] == P("tensor", "fsdp")

    rng = np.random.default_rng(7)
    prompts = rng.integers(3, TINY.vocab_size, (2, 8, 6)).astype(np.int32)
    mask = np.arange(6) >= rng.integers(0, 3, (2, 8, 1))
    kw = dict(max_new_tokens=5, temperature=0.0)
    want = models.generate_stacked(TINY, attached, prompts, mask, jax.random.key(0), GenerationSpec(**kw))
    mesh = mesh(policy=2, data=2, tensor=2)
    placed = sharding.shard_params(models.param_axes(TINY), attached, mesh)
    got = models.generate_stacked(TINY, placed, prompts, mask, jax.random.key(0), GenerationSpec(mesh=mesh, **kw))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    _close(got.logprobs, want.logprobs)


# ---------------------------------------------------------------------------------- memory
# A model whose weights dwarf its activations (4.9 MB of weights, a few tokens per policy), so
# compiled memory shows the weight copies. XLA:CPU also copies each layer's weight slices once
# (temporaries of about one base whatever the number of policies: the layer scan's slices).
WIDE = TINY.replace(hidden_size=256, intermediate_size=512, head_dim=64)
AGENTS = 4


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _stats(jitted, *args):
    return jitted.lower(*args).compile(compiler_options=FAST).memory_analysis()


def _wide(policies: int):
    """(base, adapters [policies, ...] on all 7 projections, packed batch [policies, ...]):
    shapes only. Per policy one 4-token prompt shared by two 3-token continuations."""
    base = jax.eval_shape(lambda: models.init(WIDE, jax.random.key(0)))
    ads = jax.eval_shape(lambda: jax.vmap(lambda k: init_lora(models.init(WIDE, jax.random.key(0)), k, rank=RANK,
                                                              target_modules=ALL[:-1]))(jax.random.split(jax.random.key(1), policies)))
    s = jax.ShapeDtypeStruct
    i32 = jnp.int32
    batch = {**{k: s((policies, 1, 10), i32) for k in ("packed_tokens", "packed_positions", "packed_segment", "packed_branch")},
             "pred_source": s((policies, 6), i32), "pred_target": s((policies, 6), i32), "pred_slot": s((policies, 2, 3), i32)}
    return base, ads, batch


def _update_bytes(join, policies: int) -> int:
    """Argument + temporary bytes of the adapters' gradient vmapped over `policies` adapters with
    the base unmapped (the trainer's update), the model run with `join(base, adapters)`."""
    base, ads, batch = _wide(policies)

    def loss(ad, b, mb):
        return jnp.sum(packed_logprobs(WIDE.replace(remat="full"), join(b, ad), mb))

    stats = _stats(jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None, 0))), ads, base, batch)
    return int(stats.argument_size_in_bytes + stats.temp_size_in_bytes)


def _generation_bytes(params, policies: int) -> int:
    """Argument + temporary bytes (less the KV cache) of the stacked sampler program over
    `policies` policies run with `params`."""
    program = static._program(WIDE, True, 3, True, 0, False, (1,), 0)
    cache = jax.eval_shape(lambda: kv_cache_lib.empty_cache(WIDE, (policies, 2), 6))
    s = jax.ShapeDtypeStruct
    stats = _stats(program, params, cache, s((policies, 2, 4), jnp.int32), s((policies, 2, 4), jnp.bool_), None,
                   jax.eval_shape(lambda: jax.random.key(0)), s((), jnp.float32), s((), jnp.float32))
    return int(stats.argument_size_in_bytes + stats.temp_size_in_bytes) - _bytes(cache)


@pytest.mark.slow
def test_four_agent_update_holds_one_base():
    """4 per-agent adapters on one base: the update's compiled memory is about the base argument
    plus XLA:CPU's copy of the layer slices (~2.5x the base), and grows by much less than a base
    from 1 to 4 agents; merged weights hold 4 merged copies and their gradients (~9x)."""
    base_bytes = _bytes(_wide(1)[0])
    one, four = _update_bytes(_attached, 1), _update_bytes(_attached, AGENTS)
    merged = _update_bytes(_merged, AGENTS)
    assert four < 3 * base_bytes and four - one < 0.5 * base_bytes, (one, four, base_bytes)
    assert merged > 6 * base_bytes, (merged, base_bytes)


@pytest.mark.slow
def test_four_agent_generation_holds_one_base():
    """Stacked generation of 4 per-agent LoRA policies reads the base once (~2.3x the base with
    XLA:CPU's layer slices), not 4 merged copies (~8x)."""
    base, ads, _ = _wide(AGENTS)
    base_bytes = _bytes(base)
    attached = _generation_bytes(jax.eval_shape(_attached, base, ads), AGENTS)
    merged = _generation_bytes(jax.eval_shape(jax.vmap(_merged, in_axes=(None, 0)), base, ads), AGENTS)
    assert attached < 3 * base_bytes < 6 * base_bytes < merged, (attached, merged, base_bytes)
