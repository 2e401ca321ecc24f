"""Sharding on 8 simulated CPU devices: meshes, logical axes and the rules object, a sharded update
equal to the single-device one, sharded greedy sampling, sharded checkpoints, the memory planner."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _tiny_models import TINY_PRESET, VOCAB_SIZE, tiny_qwen3
from jmarl import algos, models
from jmarl.config import DistributedConfig, MeshConfig
from jmarl.errors import JmarlError
from jmarl import sharding
from jmarl.train.checkpoint import Checkpointer
from jmarl.train.lora import attach_lora, init_lora
from jmarl.train.optim import make_optimizer
from jmarl.train.step import init_train_state, make_update

TINY = tiny_qwen3()
TINY_AXES = models.param_axes(TINY)  # its declared logical axes: what the spec functions take
N, T = 16, 12  # batch rows, tokens per row


# ---------------------------------------------------------------------------------- meshes
def test_make_mesh_sizes_rest_and_errors():
    mesh = sharding.make_mesh(data=-1, tensor=2)
    assert dict(mesh.shape) == {"data": 4, "policy": 1, "fsdp": 1, "tensor": 2}
    assert mesh.size == 8 and mesh.axis_names == ("data", "policy", "fsdp", "tensor")
    small = sharding.mesh_from_config(MeshConfig(data=1, fsdp=2, tensor=1, policy=1))
    assert small.size == 2 and list(small.devices.flat) == jax.devices()[:2]
    with pytest.raises(JmarlError, match="needs 16 devices"):
        sharding.make_mesh(data=4, fsdp=4)
    with pytest.raises(JmarlError, match="do not split"):
        sharding.make_mesh(data=-1, fsdp=3)
    assert dict(sharding.make_mesh(fsdp=-1).shape) == {"data": 1, "policy": 1, "fsdp": 8, "tensor": 1}
    assert dict(sharding.make_mesh(fsdp=-1, tensor=2).shape)["fsdp"] == 4
    with pytest.raises(JmarlError, match="only one axis may be -1"):
        sharding.make_mesh(data=-1, fsdp=-1)
    assert sharding.parse_mesh("fsdp=4,tensor=2") == {"data": 1, "policy": 1, "fsdp": 4, "tensor": 2}
    with pytest.raises(JmarlError, match="axis=size"):
        sharding.parse_mesh("fdsp=4")


# ---------------------------------------------------------------------------------- partition rules
def _names(path):
    return "/".join(str(k.key) for k in path)


# expected specs on a mesh where fsdp=4 and tensor=2 divide every dimension of TINY
EXPECTED = {
    "embed/embedding": P("tensor", "fsdp"),
    "final_norm/scale": P(),
    "lm_head/kernel": P("fsdp", "tensor"),
    "layers/attn_norm/scale": P(),
    "layers/mlp_norm/scale": P(),
    "layers/attn/q_norm/scale": P(),
    "layers/attn/k_norm/scale": P(),
    "layers/attn/q_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/attn/k_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/attn/v_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/attn/o_proj/kernel": P(None, "tensor", "fsdp"),
    "layers/attn/q_proj/bias": P(None, "tensor"),
    "layers/attn/k_proj/bias": P(None, "tensor"),
    "layers/attn/v_proj/bias": P(None, "tensor"),
    "layers/attn/o_proj/bias": P(),
    "layers/mlp/gate_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/mlp/up_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/mlp/down_proj/kernel": P(None, "tensor", "fsdp"),
}


@pytest.mark.parametrize(
    "family", [dict(model_type="llama", o_bias=True, qk_norm=False), dict(model_type="qwen2", qkv_bias=True, qk_norm=False),
               dict(model_type="qwen3", tie_word_embeddings=True)]
)
def test_param_specs_every_family(family):
    config = TINY.replace(**{"o_bias": False, **family})
    shapes = models.param_shapes(config)
    specs = sharding.param_specs(models.param_axes(config), shapes, {"fsdp": 4, "tensor": 2})
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    got = {_names(path): spec for path, spec in flat}
    assert got == {k: v for k, v in EXPECTED.items() if k in got}
    assert ("lm_head/kernel" in got) != config.tie_word_embeddings
    assert ("layers/attn/q_norm/scale" in got) == config.qk_norm
    assert ("layers/attn/q_proj/bias" in got) == (config.qkv_bias or config.o_bias)


def test_specs_lora_stacked_optimizer_state_and_indivisible_axes():
    params = models.param_shapes(TINY)  # specs need shapes only: nothing is allocated

    def stacked_lora_state():
        adapters = init_lora(params, jax.random.key(1), rank=4, target_modules=("q_proj", "down_proj"))
        stacked = jax.tree.map(lambda x: jnp.stack([x, x]), adapters)
        return jax.vmap(lambda a: init_train_state(a, OPT))(stacked)

    state = jax.eval_shape(stacked_lora_state)
    specs = sharding.tree_specs(TINY_AXES, state, {"policy": 2, "fsdp": 4, "tensor": 2})
    q, down = specs.params["layers"]["attn"]["q_proj"]["kernel"], specs.params["layers"]["mlp"]["down_proj"]["kernel"]
    assert q == {"a": P("policy", None, "fsdp"), "b": P("policy", None, None, "tensor")}
    assert down == {"a": P("policy", None, "tensor"), "b": P("policy", None, None, "fsdp")}
    adam = specs.opt_state[1][0]  # chain(clip, adamw) -> adam's ScaleByAdamState
    assert adam.mu["layers"]["attn"]["q_proj"]["kernel"] == q and adam.nu["layers"]["mlp"]["down_proj"]["kernel"] == down
    assert adam.count == P("policy") and specs.step == P("policy")
    # an axis that does not divide a dimension is dropped: vocab 64 on tensor=8 fits, hidden 32 on fsdp=64 not
    odd = sharding.param_specs(TINY_AXES, params, {"fsdp": 64, "tensor": 8})
    assert odd["embed"]["embedding"] == P("tensor") and odd["layers"]["mlp"]["up_proj"]["kernel"] == P(None, None, "tensor")


# ---------------------------------------------------------------------------------- logical axes + rules
# The tiny Qwen3- and Llama-style shapes of tests/_tiny_models.py: vocab 99 (odd: "tensor" cannot
# split it), hidden 64, intermediate 96, 4 heads / 2 KV heads of 24 (Qwen3) or 16 (Llama).
QWEN3_STYLE = tiny_qwen3(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, head_dim=24, o_bias=False)
LLAMA_STYLE = QWEN3_STYLE.replace(model_type="llama", head_dim=16, qk_norm=False)
SIZES = {"policy": 2, "fsdp": 2, "tensor": 2}
LORA_TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head")
# written out from the rules table (the layout the name-keyed rules gave before logical axes), on SIZES
PLAIN = {
    "embed/embedding": P(None, "fsdp"),  # (vocab, embed): 99 on tensor=2 dropped
    "final_norm/scale": P(),
    "lm_head/kernel": P("fsdp"),  # (embed, vocab)
    "layers/attn_norm/scale": P(),
    "layers/mlp_norm/scale": P(),
    "layers/attn/q_norm/scale": P(),
    "layers/attn/k_norm/scale": P(),
    "layers/attn/q_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/attn/k_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/attn/v_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/attn/o_proj/kernel": P(None, "tensor", "fsdp"),
    "layers/mlp/gate_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/mlp/up_proj/kernel": P(None, "fsdp", "tensor"),
    "layers/mlp/down_proj/kernel": P(None, "tensor", "fsdp"),
}
LORA = {  # a [.., in, r] keeps the kernel's in axis, b [.., r, out] its out axis
    "layers/attn/q_proj/kernel/a": P(None, "fsdp"), "layers/attn/q_proj/kernel/b": P(None, None, "tensor"),
    "layers/attn/v_proj/kernel/a": P(None, "fsdp"), "layers/attn/v_proj/kernel/b": P(None, None, "tensor"),
    "layers/attn/o_proj/kernel/a": P(None, "tensor"), "layers/attn/o_proj/kernel/b": P(None, None, "fsdp"),
    "layers/mlp/up_proj/kernel/a": P(None, "fsdp"), "layers/mlp/up_proj/kernel/b": P(None, None, "tensor"),
    "layers/mlp/down_proj/kernel/a": P(None, "tensor"), "layers/mlp/down_proj/kernel/b": P(None, None, "fsdp"),
    "lm_head/kernel/a": P("fsdp"), "lm_head/kernel/b": P(),
}


def _flat_specs(specs):
    """'path' -> spec; a LoraKernel's fields read as {kernel}/w, /a, /b."""
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): s for path, s in flat}


def _stacked(table):
    """The same layout with a leading policy axis [P, ...] on "policy"."""
    return {k: P("policy", *v) for k, v in table.items()}


@pytest.mark.parametrize(
    "config", [QWEN3_STYLE, LLAMA_STYLE, TINY, TINY.replace(qkv_bias=True, tie_word_embeddings=True)]
)
def test_declared_logical_axes_cover_every_parameter(config):
    shapes, axes, is_axes = models.param_shapes(config), models.param_axes(config), sharding.is_axes
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(shapes)
    for shape, names in zip(jax.tree.leaves(shapes), jax.tree.leaves(axes, is_leaf=is_axes)):
        assert len(names) == len(shape.shape)
        assert all(n in sharding.ShardingRules.logical_axes() for n in names)


@pytest.mark.parametrize("config", [QWEN3_STYLE, LLAMA_STYLE])
def test_rules_give_the_layout_of_every_tree_form(config):
    """Plain, stacked [P, ...], adam TrainStates of both, LoRA adapters ({'a', 'b'} dicts, stacked,
    attached as LoraKernels over one base): the specs written out above."""
    qk_norms = ("layers/attn/q_norm/scale", "layers/attn/k_norm/scale")  # Qwen3 only
    plain_want = {k: v for k, v in PLAIN.items() if config.qk_norm or k not in qk_norms}

    def trees():
        params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), models.param_shapes(config))
        stacked = jax.tree.map(lambda x: jnp.stack([x, x]), params)
        adapters = init_lora(params, jax.random.key(1), rank=4, target_modules=LORA_TARGETS)
        stacked_adapters = jax.tree.map(lambda x: jnp.stack([x, x]), adapters)
        return dict(params=params, stacked=stacked, adapters=adapters, stacked_adapters=stacked_adapters,
                    state=init_train_state(params, OPT), stacked_state=_init_state(stacked, True),
                    attached=attach_lora(params, stacked_adapters, rank=4, alpha=8.0))

    t = jax.eval_shape(trees)
    axes = models.param_axes(config)

    def specs(tree, **kw):
        return _flat_specs(sharding.tree_specs(axes, tree, SIZES, **kw))

    assert specs(t["params"]) == plain_want
    assert specs(t["stacked"]) == specs(t["stacked"], stacked=True) == _stacked(plain_want)
    assert specs(t["adapters"]) == LORA and specs(t["stacked_adapters"]) == _stacked(LORA)
    for key, stacked, want in (("state", False, plain_want), ("stacked_state", True, _stacked(plain_want))):
        state = sharding.tree_specs(axes, t[key], SIZES, stacked=stacked)
        assert state == sharding.tree_specs(axes, t[key], SIZES)  # the fallback that reads counters' shapes
        adam = state.opt_state[1][0]  # chain(clip, adamw) -> adam's ScaleByAdamState
        assert _flat_specs(state.params) == _flat_specs(adam.mu) == _flat_specs(adam.nu) == want
        assert adam.count == state.step == state.skipped == (P("policy") if stacked else P())
    # attached: w placed like the kernel with no policy axis (one base), a and b like the stacked adapters
    attached = specs(t["attached"])
    lora_stacked = _stacked(LORA)
    for path, spec in plain_want.items():
        kernel = path[:-len("/kernel")].split("/")[-1] if path.endswith("/kernel") else None
        if kernel in LORA_TARGETS:
            assert attached[path + "/w"] == spec
            assert (attached[path + "/a"], attached[path + "/b"]) == (lora_stacked[path + "/a"], lora_stacked[path + "/b"])
        else:
            assert attached[path] == spec


def test_custom_rules_change_only_their_axes():
    """mlp replicated: the three MLP kernels lose "tensor", nothing else moves; a rules object
    reaches batch and cache specs too, and an undeclared logical axis is refused."""
    params = models.param_shapes(QWEN3_STYLE)
    rules = sharding.ShardingRules(mlp=())
    default = _flat_specs(sharding.param_specs(models.param_axes(QWEN3_STYLE), params, SIZES))
    custom = _flat_specs(sharding.param_specs(models.param_axes(QWEN3_STYLE), params, SIZES, rules=rules))
    changed = {k for k in default if default[k] != custom[k]}
    assert changed == {"layers/mlp/gate_proj/kernel", "layers/mlp/up_proj/kernel", "layers/mlp/down_proj/kernel"}
    assert custom["layers/mlp/gate_proj/kernel"] == P(None, "fsdp")
    assert custom["layers/mlp/down_proj/kernel"] == P(None, None, "fsdp")
    assert sharding.DEFAULT_RULES.replace(mlp="fsdp").mlp == ("fsdp",)

    # batch rows: (data, fsdp), + policy when no policy axis is stacked; rules may move them
    sizes = {"data": 2, "policy": 2, "fsdp": 2}
    assert sharding.batch_spec((16, 4), sizes) == P(("data", "fsdp", "policy"))
    assert sharding.batch_spec((2, 16, 4), sizes, stacked=True) == P("policy", ("data", "fsdp"))
    assert sharding.batch_spec((16, 4), sizes, rules=sharding.ShardingRules(batch="data", policy_spare=())) == P("data")
    cache = jax.eval_shape(lambda: models.kv_cache.empty_cache(QWEN3_STYLE, (8,), 16))
    cache_axes, rows_heads = models.model.cache_axes(cache), {"data": 2, "tensor": 2}
    assert sharding.cache_specs(cache_axes, cache, rows_heads).keys[0] == P("data", "tensor")
    no_heads = sharding.cache_specs(cache_axes, cache, rows_heads, rules=sharding.ShardingRules(kv_heads=()))
    assert no_heads.values[1] == P("data")
    with pytest.raises(JmarlError, match="unknown logical axis 'heads'"):
        sharding.DEFAULT_RULES.spec(("batch", "heads"), (8, 4), sizes)
    with pytest.raises(TypeError, match="tree of logical-axis tuples"):  # a config where its declared axes go
        sharding.param_specs(QWEN3_STYLE, params, SIZES)


# ---------------------------------------------------------------------------------- sharded update
def _batch(rng, policies=None):
    lead = () if policies is None else (policies,)
    tokens = rng.integers(0, TINY.vocab_size, lead + (N, T)).astype(np.int32)
    lengths = rng.integers(T // 2, T + 1, lead + (N,))
    attn = np.arange(T) < lengths[..., None]
    loss_mask = attn & (np.arange(T) >= 4)
    return {
        "tokens": tokens, "attention_mask": attn, "loss_mask": loss_mask,
        "old_logprobs": np.where(attn, -rng.uniform(2.0, 6.0, lead + (N, T)), 0.0).astype(np.float32),
        "advantages": rng.normal(size=lead + (N,)).astype(np.float32),
    }


def _loss(trainable, frozen, batch):
    """The trainer's loss: model log-probs (LoRA attached unmerged over `frozen` when given) -> GRPO."""
    params = trainable if frozen is None else attach_lora(frozen, trainable, rank=4, alpha=8.0)
    lp = models.token_logprobs(TINY, params, batch["tokens"], batch["attention_mask"])
    return algos.policy_loss(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"])


OPT = make_optimizer(1e-3, total_steps=10, eps=1e-6)
# LLVM optimisation off: compiles ~2x faster on CPU; the computation (and its numerics) is the same
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _close(a, b, atol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=atol)


def _grad_fn(stacked):
    grad = jax.grad(lambda p, b: _loss(p, None, b)[0])
    return jax.vmap(grad) if stacked else grad


def _init_state(params, stacked):
    return jax.vmap(lambda p: init_train_state(p, OPT))(params) if stacked else init_train_state(params, OPT)


UPDATE = make_update(_loss, OPT, num_minibatches=2)


@pytest.fixture(scope="module")
def reference(tiny_qwen3_model):
    """Single-device numbers for one policy and for two stacked policies (computed once)."""
    out = {}
    for stacked in (False, True):
        rng = np.random.default_rng(0)
        params = [tiny_qwen3_model[1], models.init(TINY, jax.random.key(1))][:2 if stacked else 1]
        params = jax.tree.map(lambda *xs: jnp.stack(xs), *params) if stacked else params[0]
        batch = _batch(rng, 2 if stacked else None)
        grads = jax.jit(_grad_fn(stacked), compiler_options=FAST)(params, batch)
        fn = jax.vmap(UPDATE, in_axes=(0, None, 0)) if stacked else UPDATE
        state, metrics = jax.jit(fn, compiler_options=FAST)(_init_state(params, stacked), None, batch)
        out[stacked] = (params, batch, grads, state, metrics)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("axes", [dict(data=8), dict(fsdp=4, tensor=2), dict(policy=2, data=4)])
def test_sharded_update_equals_single_device(axes, reference, mesh):
    stacked = axes.get("policy", 1) > 1
    params, batch, ref_grads, ref_state, ref_metrics = reference[stacked]
    mesh = mesh(**axes)
    # a copy: placing may reuse the reference's buffers, and the update donates its state
    sharded_params = sharding.shard_params(TINY_AXES, jax.tree.map(jnp.copy, params), mesh)
    state = sharding.shard_train_state(TINY_AXES, _init_state(sharded_params, stacked), mesh, stacked=stacked)
    state_sh = sharding.train_state_shardings(TINY_AXES, state, mesh, stacked=stacked)
    step = sharding.sharded_update(UPDATE, mesh, state_sh, stacked=stacked, vmap_policies=stacked, compiler_options=FAST)
    sharded_batch = sharding.shard_batch(batch, mesh, stacked=stacked)
    param_sh = sharding.shardings(mesh, sharding.param_specs(TINY_AXES, params, mesh))
    grads = jax.jit(_grad_fn(stacked), out_shardings=param_sh, compiler_options=FAST)(sharded_params, sharded_batch)
    new_state, metrics = step(state, None, batch)

    _close(grads, ref_grads)
    _close(new_state.params, ref_state.params)
    _close(new_state.opt_state, ref_state.opt_state)
    np.testing.assert_allclose(np.asarray(metrics["loss"]), np.asarray(ref_metrics["loss"]), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(new_state.step) == 2)

    # the arrays really are sharded as the rules say
    gate = new_state.params["layers"]["mlp"]["gate_proj"]["kernel"]
    L, D, F = TINY.num_layers, TINY.hidden_size, TINY.intermediate_size
    tokens = sharded_batch["tokens"]
    if axes == dict(data=8):
        assert gate.sharding.spec == P() and tokens.sharding.spec == P("data")
        assert {s.data.shape for s in tokens.addressable_shards} == {(N // 8, T)}
    elif axes == dict(fsdp=4, tensor=2):
        assert gate.sharding.spec == P(None, "fsdp", "tensor")
        assert {s.data.shape for s in gate.addressable_shards} == {(L, D // 4, F // 2)}
        assert grads["layers"]["mlp"]["gate_proj"]["kernel"].sharding.spec == gate.sharding.spec
        mu = new_state.opt_state[1][0].mu["layers"]["mlp"]["gate_proj"]["kernel"]
        assert mu.sharding.spec == gate.sharding.spec
        assert tokens.sharding.spec == P("fsdp")
    else:
        assert gate.sharding.spec == P("policy")
        assert {s.data.shape for s in gate.addressable_shards} == {(1, L, D, F)}
        assert tokens.sharding.spec == P("policy", "data")
        assert {s.data.shape for s in tokens.addressable_shards} == {(1, N // 4, T)}
    assert gate.sharding == state_sh.params["layers"]["mlp"]["gate_proj"]["kernel"]


@pytest.mark.slow
def test_sharded_lora_update_with_frozen_base(tiny_qwen3_model, mesh):
    rng = np.random.default_rng(1)
    _, base = tiny_qwen3_model
    adapters = init_lora(base, jax.random.key(1), rank=4, target_modules=("q_proj", "v_proj", "up_proj"))
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # non-zero B, so A gets gradients too
    batch = _batch(rng)
    update = make_update(_loss, OPT)
    ref_state, _ = jax.jit(update, compiler_options=FAST)(init_train_state(adapters, OPT), base, batch)

    mesh = mesh(fsdp=4, tensor=2)
    base_sh = sharding.shardings(mesh, sharding.param_specs(TINY_AXES, base, mesh))
    state = sharding.shard_train_state(TINY_AXES, init_train_state(adapters, OPT), mesh)
    step = sharding.sharded_update(
        update, mesh, sharding.train_state_shardings(TINY_AXES, state, mesh), frozen_shardings=base_sh,
        compiler_options=FAST,
    )
    new_state, _ = step(state, base, batch)
    _close(new_state.params, ref_state.params)
    a = new_state.params["layers"]["mlp"]["up_proj"]["kernel"]["a"]
    assert a.sharding.spec == P(None, "fsdp") and {s.data.shape for s in a.addressable_shards} == {(2, 8, 4)}


# ---------------------------------------------------------------------------------- sampling
@pytest.mark.slow
def test_sharded_greedy_sampling_matches_unsharded(mesh):
    rng = np.random.default_rng(2)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[models.init(TINY, jax.random.key(i)) for i in (5, 6)])
    prompts = rng.integers(3, TINY.vocab_size, (2, 8, 6)).astype(np.int32)
    mask = np.arange(6) >= rng.integers(0, 3, (2, 8, 1))  # left padding of 0-2 tokens
    kw = dict(max_new_tokens=6, temperature=0.0)
    want = models.generate_stacked(TINY, stacked, prompts, mask, jax.random.key(0), models.GenerationSpec(**kw))

    # two policies on (policy, data, tensor): parameters, prompt rows and the KV cache sharded
    policy_mesh = mesh(policy=2, data=2, tensor=2)
    placed = sharding.shard_params(TINY_AXES, stacked, policy_mesh)
    got = models.generate_stacked(TINY, placed, prompts, mask, jax.random.key(0),
                                  models.GenerationSpec(mesh=policy_mesh, **kw))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)
    assert tuple(got.tokens.sharding.spec)[:2] == ("policy", "data")
    cache = jax.eval_shape(lambda: models.kv_cache.empty_cache(TINY, (2, 8), 16))
    specs = sharding.cache_specs(models.model.cache_axes(cache, stacked=True), cache, policy_mesh)
    assert specs.keys[0] == P("policy", "data", "tensor") and specs.values[1] == P("policy", "data", "tensor")

    # one policy (greedy ignores the key) with rows on data and heads on tensor
    first = jax.tree.map(lambda x: x[0], stacked)
    data_mesh = mesh(data=4, tensor=2)
    got = models.generate(TINY, sharding.shard_params(TINY_AXES, first, data_mesh), prompts[0], mask[0],
                          jax.random.key(0), models.GenerationSpec(mesh=data_mesh, **kw))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens[0]))
    assert got.tokens.sharding.spec[0] == "data"
    # (the trainer's sampler makes these calls; test_trainer_runs_sharded_from_config runs it)


# ---------------------------------------------------------------------------------- checkpoints
@pytest.mark.slow
def test_checkpoint_restores_into_target_shardings(tmp_path, mesh):
    params = models.init(TINY, jax.random.key(7))
    state = sharding.shard_train_state(TINY_AXES, init_train_state(params, OPT), mesh(fsdp=4, tensor=2))
    with Checkpointer(tmp_path / "ckpt", keep=2) as ckpt:
        ckpt.save(1, state, {"note": "sharded"})
        other = mesh(data=2, fsdp=2, tensor=2)  # restore onto a different layout
        target = sharding.shard_train_state(TINY_AXES, jax.tree.map(jnp.zeros_like, state), other)
        restored = ckpt.restore(target)
    _close(restored.state, state, atol=0)
    for got, tgt in zip(jax.tree.leaves(restored.state), jax.tree.leaves(target)):
        assert got.sharding == tgt.sharding
    q = restored.state.params["layers"]["attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P(None, "fsdp", "tensor") and q.addressable_shards[0].data.shape == (2, 16, 16)


# ---------------------------------------------------------------------------------- bytes per device
def test_device_bytes_matches_real_shards_and_abstract_states(tiny_qwen3_model, mesh):
    state = init_train_state(tiny_qwen3_model[1], OPT)
    for axes in (dict(fsdp=8), dict(fsdp=4, tensor=2), dict(data=2, tensor=4)):
        placed_on = mesh(**axes)
        placed = sharding.shard_train_state(TINY_AXES, state, placed_on)
        device0 = jax.devices()[0]
        real = sum(
            s.data.nbytes for leaf in jax.tree.leaves(placed) for s in leaf.addressable_shards if s.device == device0
        )
        assert sharding.device_bytes(placed) == real
        abstract = sharding.shard_train_state(TINY_AXES, jax.eval_shape(lambda: state), placed_on)  # shardings attached
        assert all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None for x in jax.tree.leaves(abstract))
        assert sharding.device_bytes(abstract) == real
    assert sharding.device_bytes(state) == sum(x.nbytes for x in jax.tree.leaves(state))  # one device: all of it
    assert sharding.device_bytes([state, state]) == sharding.device_bytes(state)  # the same arrays count once


# ---------------------------------------------------------------------------------- multi-host config
def test_distributed_config_off_by_default(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    assert sharding.maybe_initialize_distributed(DistributedConfig()) is False
    assert sharding.maybe_initialize_distributed(DistributedConfig(initialize="never")) is False
    assert jax.process_count() == 1
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert sharding.distributed._cluster_in_environment() == "SLURM"


# ---------------------------------------------------------------------------------- trainer
@pytest.mark.slow
def test_trainer_runs_sharded_from_config(tmp_path):
    import yaml

    from jmarl.config import load_config
    from jmarl.train.trainer import Trainer

    run = {
        "seed": 0, "output_dir": str(tmp_path / "run"), "env": {"name": "_toy_env:Letters"}, "algo": {"name": "grpo"},
        "model": {"preset": TINY_PRESET},
        "tokenizer": "char", "workflow": {"plan": "independent", "group_size": 4, "num_tasks": 2},
        "policies": {"mode": "per_agent"}, "sampling": {"max_new_tokens": 8, "max_prompt_len": 64},
        "train": {"steps": 1}, "logging": {"progress": False, "tensorboard": False, "plots": False},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    trainer = Trainer(load_config(tmp_path / "run.yaml", ["mesh.policy=2", "mesh.data=-1"]))
    assert dict(trainer.mesh.shape) == {"data": 4, "policy": 2, "fsdp": 1, "tensor": 1}
    group = trainer.policies.groups[0]
    metrics = trainer.rl_step()
    assert np.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    assert int(np.asarray(group.state.step).min()) == 1  # both policies took an optimizer step
    for leaf in jax.tree.leaves(group.state.params):
        assert leaf.sharding.spec[0] == "policy" and leaf.addressable_shards[0].data.shape[0] == 1
    trainer.step = 1
    trainer.save()
    restored = trainer.checkpointer.restore(trainer.state_tree()).state  # back into the same shardings
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(trainer.state_tree())):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    trainer.checkpointer.close()
