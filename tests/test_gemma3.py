"""Gemma 3 text (`gemma3_text`) parity with PyTorch `transformers.Gemma3ForCausalLM` on a tiny
random model whose sequences run past its sliding window: logits (left and right padding),
token log-probs and their gradients, the packed learner layout, greedy generation (static
sampler, grouped prompts, continuous engine), the HF round trip, and the settings refused."""

import contextlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from _tiny_models import left_padded
from benchmarks.shared_prefix_model import prefix_token_logprobs
from jmarl.errors import JmarlError
from jmarl.models import GenerationSpec, apply, generate, load_hf, save_hf, token_logprobs
from jmarl.models import attention as attention_lib
from jmarl.models import packed_pallas
from jmarl.models.hf import _tensor_specs
from jmarl.models.hf_config import config_from_hf, config_to_hf
from jmarl.models.presets import preset_config

VOCAB = 128
WINDOW = 5
# sliding layers first and last (the prefill's last layer is a sliding one), one full layer
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
B, T = 3, 20
N_NEW = 14  # generated past the window


def _hf_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        query_pre_attn_scalar=24,  # != head_dim: the scale is tested too
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
        max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        final_logit_softcapping=None, attn_logit_softcapping=None,
    )
    kwargs.update(overrides)
    return transformers.Gemma3TextConfig(**kwargs)


def _torch_model(seed=0, **overrides):
    torch.manual_seed(seed)
    config = _hf_config(**overrides)
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32)
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # non-trivial (1 + w) norm weights, so they are tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # greedy references run the full length, EOS not suppressed
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = _torch_model()
    path = str(tmp_path_factory.mktemp("gemma3") / "ckpt")
    model.save_pretrained(path, safe_serialization=True)
    config, params = load_hf(path, "float32")
    return config, params, model


def _batch(seed=0):
    """Tokens [B,T]: row 0 full, row 1 right-padded (13 real), row 2 left-padded (6 pads)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, VOCAB, (B, T))
    mask = np.ones((B, T), bool)
    mask[1, 13:] = False
    mask[2, :6] = False
    tokens[~mask] = 0
    return tokens, mask


def _positions(mask):
    return np.maximum(np.cumsum(mask, 1) - 1, 0)


def _torch_logits(model, tokens, mask):
    return model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                 position_ids=torch.tensor(_positions(mask))).logits


def test_config_reads_the_gemma3_settings(tiny):
    config, _, _ = tiny
    assert config.model_type == "gemma3_text" and config.is_gemma3 and config.qk_norm
    assert config.sliding_window == WINDOW and config.layer_types == tuple(LAYER_TYPES)
    assert config.sliding_layers() == (True, False, True, True)
    assert (config.rope_theta, config.rope_local_theta, config.rope_type, config.rope_factor) == (1e6, 1e4, "linear", 2.0)
    assert config.query_pre_attn_scalar == 24 and config.tie_word_embeddings
    # the older style: sliding_window_pattern instead of layer_types; a multimodal config's text part
    old = dict(_hf_config().to_dict(), layer_types=None, sliding_window_pattern=2, rope_parameters=None)
    assert config_from_hf(old).layer_types == ("sliding_attention", "full_attention") * 2
    outer = {"model_type": "gemma3", "text_config": dict(_hf_config().to_dict())}
    assert config_from_hf(outer) == config.replace(param_dtype="float32", compute_dtype="float32")


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_logits_match_transformers_with_left_and_right_padding(tiny, impl):
    config, params, model = tiny
    tokens, mask = _batch()
    ours = np.asarray(apply(config.replace(attention=impl), params, jnp.asarray(tokens), jnp.asarray(mask)))
    with torch.no_grad():
        ref = _torch_logits(model, tokens, mask).numpy()
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_token_logprobs_and_gradients_match_torch_autograd(tiny):
    config, params, model = tiny
    tokens, mask = _batch(1)
    weights = np.random.default_rng(2).normal(size=tokens.shape).astype(np.float32)

    def loss(p):
        return jnp.sum(token_logprobs(config, p, jnp.asarray(tokens), jnp.asarray(mask)) * weights)

    value, grads = jax.value_and_grad(loss)(params)
    model.zero_grad()
    logp = torch.log_softmax(_torch_logits(model, tokens, mask), dim=-1)
    picked = torch.gather(logp[:, :-1], 2, torch.tensor(tokens[:, 1:])[..., None])[..., 0]
    has_context = torch.tensor((mask & (_positions(mask) > 0))[:, 1:])
    ref = torch.sum(torch.where(has_context, picked, 0.0) * torch.tensor(weights[:, 1:]))
    ref.backward()
    np.testing.assert_allclose(float(value), float(ref.detach()), rtol=1e-5, atol=1e-4)
    hf_grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    hf_grads["model.embed_tokens.weight"] = model.model.embed_tokens.weight.grad.numpy()  # tied head included
    checked = 0
    for path, name, transposed, layer in _tensor_specs(config):
        g = grads
        for key in path:
            g = g[key]
        g = np.asarray(g if layer is None else g[layer])
        ref_g = hf_grads[name].T if transposed else hf_grads[name]
        np.testing.assert_allclose(g, ref_g, atol=2e-4, rtol=2e-3, err_msg=name)
        checked += 1
    assert checked == 1 + 1 + 4 * 13  # embedding, final norm, 13 tensors per layer (4 norms, 2 q/k norms)


@pytest.mark.slow
def test_packed_layout_equals_per_sequence_logprobs(tiny):
    from jmarl.train.packing import pack, packed_logprobs, plain_samples

    config, params, _ = tiny
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (7, 3)]
    rows = [(prompts[0], rng.integers(3, VOCAB, 9).tolist()), (prompts[0], rng.integers(3, VOCAB, 4).tolist()),
            (prompts[1], rng.integers(3, VOCAB, 11).tolist()), (prompts[1], rng.integers(3, VOCAB, 6).tolist())]
    t = 16
    n = len(rows)
    plain = {"tokens": np.zeros((n, t), np.int32), "attention_mask": np.zeros((n, t), bool),
             "loss_mask": np.zeros((n, t), bool), "behavior_logprobs": np.zeros((n, t), np.float32),
             "reward": np.zeros((n,), np.float32)}
    for i, (p, c) in enumerate(rows):
        plain["tokens"][i, :len(p) + len(c)] = p + c
        plain["attention_mask"][i, :len(p) + len(c)] = True
        plain["loss_mask"][i, len(p):len(p) + len(c)] = True
    full = np.asarray(token_logprobs(config, params, jnp.asarray(plain["tokens"]), jnp.asarray(plain["attention_mask"])))
    (packed,) = pack([plain_samples(plain)], parts=1, width=64)
    for impl in ("xla", "blockwise", "pallas"):  # pallas: the fused kernel, interpreted, windows by position
        with packed_pallas.interpret_kernels() if impl == "pallas" else contextlib.nullcontext():
            got = np.asarray(packed_logprobs(config.replace(attention=impl), params,
                                             {k: jnp.asarray(v) for k, v in packed.items()}))
        for i, (p, c) in enumerate(rows):
            np.testing.assert_allclose(got[i, :len(c)], full[i, len(p):len(p) + len(c)], atol=2e-5, err_msg=impl)


def _left_padded(lengths, width, seed=0):
    return left_padded(lengths, width, VOCAB, seed)


def _hf_greedy(model, tokens, mask, n):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                             do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[:, tokens.shape[1]:].numpy()


@pytest.mark.slow
def test_greedy_generation_matches_transformers_past_the_window(tiny):
    config, params, model = tiny
    tokens, mask = _left_padded([9, 4, 7, 1], 9)
    ref = _hf_greedy(model, tokens, mask, N_NEW)
    out = generate(config, params, tokens, mask, jax.random.key(0),
                   GenerationSpec(max_new_tokens=N_NEW, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    # past 32 generated slots the decode loop runs in two phases over two cache blocks
    long_ref = _hf_greedy(model, tokens[:2], mask[:2], 36)
    long = generate(config, params, tokens[:2], mask[:2], jax.random.key(0),
                    GenerationSpec(max_new_tokens=36, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(long.tokens), long_ref)
    # the log-probs the sampler reports are the learner's (token_logprobs over prompt + completion)
    full = np.concatenate([tokens, np.asarray(out.tokens)], 1)
    full_mask = np.concatenate([mask, np.asarray(out.mask)], 1)
    rescored = np.asarray(token_logprobs(config, params, full, full_mask))[:, tokens.shape[1]:]
    np.testing.assert_allclose(np.asarray(out.logprobs), rescored, atol=1e-4)


@pytest.mark.slow
def test_grouped_prompts_and_continuous_engine_match_transformers(tiny):
    from jmarl.models.generation import engine

    config, params, model = tiny
    distinct, distinct_mask = _left_padded([8, 3], 8, seed=4)
    rows = np.array([0, 0, 0, 1, 1, 1])  # groups of 3 consecutive rows: the prompt cache shared per group
    tokens, mask = distinct[rows], distinct_mask[rows]
    ref = _hf_greedy(model, distinct, distinct_mask, N_NEW)
    out = generate(config, params, tokens, mask, jax.random.key(0),
                   GenerationSpec(max_new_tokens=N_NEW, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(out.tokens), ref[rows])
    prompts = [row[m].tolist() for row, m in zip(distinct, distinct_mask)]
    res = engine.run(config, params, prompts, 1, jax.random.key(0),
                     GenerationSpec(max_new_tokens=N_NEW, temperature=0.0, num_slots=1, chunk_steps=4))
    np.testing.assert_array_equal(np.stack([c[0][0] for c in res.completions]), ref)


@pytest.mark.slow
def test_save_hf_round_trip_loads_in_transformers(tiny, tmp_path):
    config, params, _ = tiny
    # perturbed parameters, so the round trip is not the checkpoint read back
    params = jax.tree.map(lambda a: a + 0.01 * jnp.sin(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape)), params)
    save_hf(tmp_path, config, params)
    hf = json.load(open(os.path.join(tmp_path, "config.json")))
    assert hf["model_type"] == "gemma3_text" and hf["layer_types"] == LAYER_TYPES
    model = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    tokens, mask = _batch(5)
    with torch.no_grad():
        ref = _torch_logits(model, tokens, mask).numpy()
    ours = np.asarray(apply(config, params, jnp.asarray(tokens), jnp.asarray(mask)))
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)
    config2, params2 = load_hf(tmp_path)
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)


@pytest.mark.parametrize("key", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_softcapping_is_refused(key):
    hf = dict(_hf_config().to_dict(), **{key: 30.0})
    with pytest.raises(JmarlError, match=key):
        config_from_hf(hf)


@pytest.mark.slow
def test_other_refusals(tiny):
    with pytest.raises(JmarlError, match="use_bidirectional_attention"):
        config_from_hf(dict(_hf_config().to_dict(), use_bidirectional_attention=True))
    with pytest.raises(JmarlError, match="hidden_activation"):
        config_from_hf(dict(_hf_config().to_dict(), hidden_activation="gelu"))
    with pytest.raises(JmarlError, match="gemma3_text only"):
        preset_config("qwen3-0.6b", sliding_window=4)
    # the shared-prefix layout past the window: refused; within it: exact
    config, params, _ = tiny
    prefix, prefix_mask = _left_padded([4, 3], 4, seed=6)
    rows = np.array([0, 1])
    cont = np.random.default_rng(7).integers(3, VOCAB, (2, 5))
    cont_mask = np.ones((2, 5), bool)
    with pytest.raises(JmarlError, match="sliding_window"):
        prefix_token_logprobs(config, params, prefix, prefix_mask, rows, cont, cont_mask)
    short = np.asarray(prefix_token_logprobs(config, params, prefix, prefix_mask, rows, cont[:, :1], cont_mask[:, :1]))
    full = np.asarray(token_logprobs(config, params, np.concatenate([prefix, cont[:, :1]], 1),
                                     np.concatenate([prefix_mask, cont_mask[:, :1]], 1)))
    np.testing.assert_allclose(short, full[:, 4:], atol=2e-5)


@pytest.mark.slow
def test_windowed_blockwise_attention_skips_tiles_exactly():
    """Small tiles: the blockwise form (tiles before the window skipped, forward and gradient)
    equals the dense form, for a fixed and a traced window, padded rows included."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 23, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 23, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 23, 2, 8)), jnp.float32)
    lengths = jnp.asarray([13, 9])  # no row fills the 23 slots: query tile 5 lies past every window
    # padding queries (t >= length) may have no valid key in their window: their outputs are
    # unspecified (finite) and left out of the loss, as the model leaves them out
    weights = jnp.cos(jnp.arange(2 * 23 * 4 * 8).reshape(2, 23, 4, 8)) * (jnp.arange(23)[None, :] < lengths[:, None])[..., None, None]
    for window in (3, 7, attention_lib.NO_WINDOW):
        def run(impl, q, k, v, window=window):
            out = attention_lib.attention(q, k, v, lengths, causal=True, impl=impl, block_q=4, block_k=4,
                                          window=jnp.int32(window))
            return jnp.sum(out * weights)
        dense, dense_g = jax.value_and_grad(run, argnums=(1, 2, 3))("xla", q, k, v)
        block, block_g = jax.jit(jax.value_and_grad(run, argnums=(1, 2, 3)), static_argnums=0)("blockwise", q, k, v)
        np.testing.assert_allclose(block, dense, rtol=1e-5, atol=1e-5)
        for a, b in zip(block_g, dense_g):
            np.testing.assert_allclose(a, b, atol=1e-5)
        out = attention_lib.attention(q, k, v, lengths, causal=True, impl="blockwise", block_q=4, block_k=4,
                                      window=jnp.int32(window))
        assert np.isfinite(np.asarray(out)).all()  # query tiles that visit no key tile: 0, not 0 / 0
    # no window at all is the plain causal attention
    plain = attention_lib.attention(q, k, v, lengths, causal=True, impl="xla")
    huge = attention_lib.attention(q, k, v, lengths, causal=True, impl="xla", window=attention_lib.NO_WINDOW)
    np.testing.assert_array_equal(plain, huge)


@pytest.mark.parametrize("name,params_m,window", [("gemma3-270m", 268, 512), ("gemma3-1b", 1000, 512),
                                                 ("gemma3-4b", 3880, 1024), ("gemma3-12b", 11766, 1024),
                                                 ("gemma3-27b", 27009, 1024)])
def test_presets(name, params_m, window):
    """Published shapes (the text part of 4B and larger): jmarl's parameter count equals that of
    transformers' Gemma3ForCausalLM built (on the meta device) from the preset's HF config."""
    import torch

    config = preset_config(name)
    assert config.is_gemma3 and config.sliding_window == window
    assert config.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert (config.rope_type, config.rope_factor if config.rope_type == "linear" else None) == (
        ("linear", 8.0) if window == 1024 else ("default", None))
    assert abs(config.num_params() / 1e6 - params_m) / params_m < 0.001
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in config_to_hf(config).items() if k not in ("architectures", "model_type")})
    assert config_from_hf(hf.to_dict()) == config
    with torch.device("meta"):
        reference = transformers.Gemma3ForCausalLM(hf)
    assert config.num_params() == sum(p.numel() for p in reference.parameters())
