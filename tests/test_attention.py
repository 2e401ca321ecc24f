"""The attention entry point: exact against transformers at long lengths (every family, left
and right padding), every form equal (values and gradients), the shared-prefix layout (the
packing benchmark's baseline, `benchmarks.shared_prefix_model`) equal to the plain layout, and programs exported for CUDA / TPU carrying those platforms' kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import export

from _tiny_models import FAMILIES, VOCAB_SIZE, make_tiny_torch_model, tiny_qwen3
from benchmarks.shared_prefix_model import prefix_token_logprobs, prefixed_attention
from jmarl.errors import JmarlError
from jmarl.models import attention as attn
from jmarl.models import load_hf, token_logprobs
from jmarl.models.generation import static
from jmarl.models.config import ModelConfig
from jmarl.models.kv_cache import empty_cache
from jmarl.models.model import init

LONG = 1024  # tokens per row: two blocks of the blockwise form


def _long_batch(seed: int = 0):
    """[3, LONG] tokens: row 0 full, row 1 right-padded (600 real), row 2 left-padded (700 real)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, VOCAB_SIZE, (3, LONG))
    mask = np.ones((3, LONG), bool)
    mask[1, 600:] = False
    mask[2, : LONG - 700] = False
    tokens[~mask] = 0
    return tokens, mask


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_long_sequences_match_transformers_with_left_and_right_padding(family, tiny_hf_checkpoint):
    """Logits at 1,024 tokens equal transformers' on every real token, by the blockwise form and
    by auto (llama: llama3 RoPE scaling; qwen3: q/k norms and an explicit head_dim)."""
    overrides = dict(max_position_embeddings=2048)
    path = tiny_hf_checkpoint(family, **overrides)
    reference = make_tiny_torch_model(family, **overrides)
    config, params = load_hf(path)
    tokens, mask = _long_batch()
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                           position_ids=torch.tensor(positions)).logits.double()
    logp = torch.log_softmax(logits, -1)[:, :-1].gather(2, torch.tensor(tokens[:, 1:])[..., None])[..., 0].numpy()
    has_context = (mask & (positions > 0))[:, 1:]
    for impl in ("blockwise", "auto"):
        cfg = config.replace(attention=impl)
        out = np.asarray(jax.jit(token_logprobs, static_argnums=0)(cfg, params, tokens, mask))
        assert np.abs(out[:, 1:] - logp)[has_context].max() < 2e-4, impl
        assert np.all(out[:, 1:][~has_context] == 0.0)


def _qkv(seed, b=3, t=70, s=70, h=4, kv=2, hd=16, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, h, hd)), dtype)
    k = jnp.asarray(rng.normal(size=(b, s, kv, hd)), dtype)
    v = jnp.asarray(rng.normal(size=(b, s, kv, hd)), dtype)
    return q, k, v


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_equals_dense_values_and_gradients(causal):
    """Ragged blocks (T = 70 in blocks of 16 and 32), rows of every length including an empty
    one, GQA: outputs and the gradients of q, k, v agree to float rounding."""
    q, k, v = _qkv(0)
    lengths = jnp.array([70, 33, 0])
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def loss(impl):
        def f(q, k, v):
            out = attn.attention(q, k, v, lengths, causal=causal, impl=impl, block_q=16, block_k=32)
            return jnp.sum(out * w * (jnp.arange(70)[None, :, None, None] < jnp.maximum(lengths, 1)[:, None, None, None]))
        return f

    dense = jax.value_and_grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    block = jax.value_and_grad(loss("blockwise"), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(block[0], dense[0], rtol=1e-5)
    for a, b in zip(block[1], dense[1]):
        np.testing.assert_allclose(a, b, atol=2e-5)
    out = attn.attention(q, k, v, lengths, causal=causal, impl="blockwise", block_q=16, block_k=32)
    assert np.all(np.isfinite(np.asarray(out)))  # the empty row averages instead of NaN


@pytest.mark.slow
def test_prefixed_attention_equals_attention_over_joined_keys():
    """Each continuation row over [its prefix's keys, its own keys] equals plain causal attention
    over the joined row, forms dense and blockwise, gradients included (they sum over the rows
    that share a prefix)."""
    n, c, p, u = 4, 20, 24, 2
    q, k, v = _qkv(2, b=n, t=c, s=c)
    _, pk, pv = _qkv(3, b=u, t=p, s=p)
    rows_list, prefix_list, own_list = [1, 0, 1, 1], [24, 9], [20, 5, 13, 1]
    rows, prefix_len, own_len = jnp.array(rows_list), jnp.array(prefix_list), jnp.array(own_list)

    def joined(q, k, v, pk, pv):
        outs = []
        for i in range(n):
            lp, lo = prefix_list[rows_list[i]], own_list[i]
            keys = jnp.concatenate([pk[rows[i], :lp], k[i, :lo]])[None]
            vals = jnp.concatenate([pv[rows[i], :lp], v[i, :lo]])[None]
            qi = jnp.concatenate([jnp.zeros((1, lp) + q.shape[2:]), q[i:i + 1, :lo]], axis=1)
            outs.append(attn.attention(qi, keys, vals, jnp.array([lp + lo]), causal=True, impl="xla")[0, lp:])
        return outs

    ref = jax.jit(joined)(q, k, v, pk, pv)
    for impl in ("xla", "blockwise"):
        fn = jax.jit(lambda *a, impl=impl: prefixed_attention(*a, impl=impl, block_q=8, block_k=8))
        out = fn(q, k, v, own_len, pk, pv, prefix_len, rows)
        for i in range(n):
            np.testing.assert_allclose(out[i, : own_list[i]], ref[i], atol=1e-5)

    def loss(q, k, v, pk, pv):
        out = prefixed_attention(q, k, v, own_len, pk, pv, prefix_len, rows, impl="blockwise", block_q=8, block_k=8)
        return sum(jnp.sum(jnp.sin(out[i, : own_list[i]])) for i in range(n))

    args = (q, k, v, pk, pv)
    g_ref = jax.jit(jax.grad(lambda *a: sum(jnp.sum(jnp.sin(o)) for o in joined(*a)), argnums=(0, 1, 2, 3, 4)))(*args)
    g_blk = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    for a, b in zip(g_blk, g_ref):
        np.testing.assert_allclose(a, b, atol=3e-5)


def _attention_grad_memory(impl: str, t: int, b: int = 1, h: int = 4, kv: int = 2, hd: int = 16):
    """memory_analysis() of the compiled gradient (q, k, v) of a causal attention loss at T = S = t."""
    q = jax.ShapeDtypeStruct((b, t, h, hd), jnp.float32)
    k = jax.ShapeDtypeStruct((b, t, kv, hd), jnp.float32)
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)

    def loss(q, k, v, n):
        return jnp.sum(jnp.sin(attn.attention(q, k, v, n, causal=True, impl=impl)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k, lengths).compile().memory_analysis()


def test_blockwise_gradient_temporaries_stay_far_below_the_score_matrix():
    """At T = S = 4,096 (8 x 8 tiles of 512) the compiled gradient of the blockwise form needs
    temporaries under 1/8 of one float32 [B, H, T, S] score matrix; the dense form, compiled the
    same way, needs at least that matrix (so the measure does see it)."""
    b, h, t = 1, 4, 4096
    scores = b * h * t * t * 4
    blockwise = _attention_grad_memory("blockwise", t, b=b, h=h)
    dense = _attention_grad_memory("xla", t, b=b, h=h)
    assert dense.temp_size_in_bytes >= scores
    assert blockwise.temp_size_in_bytes < scores / 8, blockwise.temp_size_in_bytes


def _tiny(**changes) -> ModelConfig:
    """`tiny_qwen3` twice as wide (heads of 16, an MLP of 96: the chunking below counts on it), for 4,096 positions."""
    wide = dict(hidden_size=64, intermediate_size=96, head_dim=16, o_bias=False, max_position_embeddings=4096)
    return tiny_qwen3(**{**wide, **changes})


@pytest.mark.slow
def test_shared_prefix_learner_blockwise_equals_plain_layout_and_gradients():
    """prefix_token_logprobs with the blockwise form (2 x 512-token blocks of prompt) equals
    token_logprobs on the joined rows by the dense form, and so do the parameter gradients."""
    config = _tiny()
    params = init(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    p_len, c_len = 700, 40
    prompts = rng.integers(3, 64, (2, p_len))
    prefix_mask = np.ones((2, p_len), bool)
    prefix_mask[1, :300] = False  # left-padded shorter prompt
    rows = np.array([0, 1, 1])
    conts = rng.integers(3, 64, (3, c_len))
    cont_mask = np.ones((3, c_len), bool)
    cont_mask[2, 25:] = False
    joined = np.concatenate([prompts[rows], conts], axis=1)
    joined_mask = np.concatenate([prefix_mask[rows], cont_mask], axis=1)

    def plain(p):
        lp = token_logprobs(config.replace(attention="xla"), p, joined, joined_mask)[:, p_len:]
        return jnp.sum(jnp.where(cont_mask, lp, 0.0)), lp

    def shared(p):
        lp = prefix_token_logprobs(config.replace(attention="blockwise"), p, prompts, prefix_mask, rows, conts, cont_mask)
        return jnp.sum(lp), lp

    (v_plain, lp_plain), g_plain = jax.jit(jax.value_and_grad(plain, has_aux=True))(params)
    (v_shared, lp_shared), g_shared = jax.jit(jax.value_and_grad(shared, has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(lp_shared)[cont_mask], np.asarray(lp_plain)[cont_mask], atol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), g_shared, g_plain)


@pytest.mark.slow
def test_remat_policies_give_equal_gradients(monkeypatch):
    """remat none / full / dots, and the feed-forward layer in token chunks: the same gradient
    of a long-sequence loss as the plain layers (the blockwise form and the chunked MLP run
    inside the rematerialised layers)."""
    from jmarl.models import layers as layers_lib

    config = _tiny(attention="blockwise")
    params = init(config, jax.random.key(1))
    tokens = np.random.default_rng(1).integers(3, 64, (2, 600))
    mask = np.ones_like(tokens, bool)

    def grad(remat):
        return jax.jit(jax.grad(lambda p: jnp.sum(token_logprobs(config.replace(remat=remat), p, tokens, mask))))(params)

    g_none = grad("none")  # 1,200 tokens x F=96: below the chunking threshold
    monkeypatch.setattr(layers_lib, "MLP_CHUNK_ELEMENTS", 256 * 96)  # now 5 chunks of 120 tokens x 2 rows
    for remat in ("none", "full", "dots"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grad(remat), g_none)


def test_unknown_form_is_a_clear_error():
    q, k, v = _qkv(0, t=4, s=4)
    with pytest.raises(JmarlError, match="model.attention"):
        attn.attention(q, k, v, jnp.array([4, 4, 4]), causal=True, impl="flash")
    with pytest.raises(JmarlError, match="attention"):
        ModelConfig(**dict(_tiny().__dict__, attention="flash"))


# ---------------------------------------------------------------------------------- export
_CUDNN_TARGETS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


def _exported_text(fn, args, platform: str) -> str:
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in _CUDNN_TARGETS] if platform == "cuda" else []
    return export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args).mlir_module()


@pytest.mark.slow
@pytest.mark.parametrize("platform,marker", [("cuda", "__cudnn$fmhaSoftmax"), ("tpu", "tpu_custom_call")])
def test_exported_programs_carry_the_platforms_attention(platform, marker):
    """The train step (loss + gradient + AdamW), token_logprobs and generate, lowered on this CPU
    for CUDA / TPU with attention auto, carry cuDNN flash attention / the splash kernel (chosen
    when lowering, not by the backend that traced them); lowered for CPU they carry neither."""
    import optax

    from jmarl.train.step import init_train_state, make_update

    config = _tiny(compute_dtype="bfloat16", head_dim=64, hidden_size=128)
    params = jax.eval_shape(lambda: init(config, jax.random.key(0)))
    b, t = 2, 4096  # long enough that auto leaves the dense form
    tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
    mask = jax.ShapeDtypeStruct((b, t), jnp.bool_)

    def loss(p, frozen, batch):
        lp = token_logprobs(config, p, batch["tokens"], batch["mask"])
        return -jnp.mean(lp), {}

    optimizer = optax.adamw(1e-6)
    state = jax.eval_shape(lambda p: init_train_state(p, optimizer), params)
    update = make_update(loss, optimizer)
    batch = {"tokens": tokens, "mask": mask}
    programs = {
        "train_step": (lambda s, bt: update(s, None, bt), (state, batch)),
        "token_logprobs": (lambda p, tk, m: token_logprobs(config, p, tk, m), (params, tokens, mask)),
    }
    # per-agent policies stacked on a leading axis: the attention runs under jax.vmap
    stacked_q = jax.ShapeDtypeStruct((2, 1, t, 16, 64), jnp.bfloat16)
    stacked_kv = jax.ShapeDtypeStruct((2, 1, t, 8, 64), jnp.bfloat16)
    stacked_len = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    vmapped = jax.vmap(lambda q, k, v, n: jnp.sum(attn.attention(q, k, v, n, causal=True).astype(jnp.float32)))
    programs["stacked_attention_grad"] = (
        jax.grad(lambda q, k, v, n: jnp.sum(vmapped(q, k, v, n)), argnums=(0, 1, 2)),
        (stacked_q, stacked_kv, stacked_kv, stacked_len))
    for name, (fn, args) in programs.items():
        assert marker in _exported_text(fn, args, platform), name
        assert marker not in _exported_text(fn, args, "cpu"), name

    # generate's device program (the host part pads and aligns prompts): prefill + decode loop
    program = static._program(config, False, 4, False, 0, False, (), 0)
    prompt = jax.ShapeDtypeStruct((2, 4096), jnp.int32)
    prompt_mask = jax.ShapeDtypeStruct((2, 4096), jnp.bool_)
    cache = jax.eval_shape(lambda: empty_cache(config, (2,), 4096 + 3))
    text = _exported_text(
        lambda p, c, tk, m: program(p, c, tk, m, None, jax.random.key(0), jnp.float32(1.0), jnp.float32(1.0)),
        (params, cache, prompt, prompt_mask), platform)
    assert marker in text
