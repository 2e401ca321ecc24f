"""Qwen3-MoE (`qwen3_moe`) parity with PyTorch `transformers.Qwen3MoeForCausalLM` on tiny random
models: one mixing dense and sparse layers (decoder_sparse_step=2 and mlp_only_layers, top-k
renormalised), one all sparse (every released checkpoint's layout; no renormalisation, tied
head, YaRN RoPE). Logits with padding, the top-k renormalisation seen in them, token log-prob
gradients against torch autograd, the load-balancing loss (alone and from the forward pass,
with its gradient), greedy generation, the HF round trip (released and fused expert layouts),
the expert sharding axis (split over fsdp), the refusals, and the presets' parameter counts."""

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
from jmarl.models import (GenerationSpec, apply, generate, load_hf, packed_token_logprobs, param_axes,
                          param_shapes, save_hf, token_logprobs)
from jmarl.models import moe
from jmarl.models.hf import _tensor_specs, read_safetensors, write_safetensors
from jmarl.models.hf_config import config_from_hf, config_to_hf
from jmarl.models.presets import preset_config
from jmarl.sharding.rules import DEFAULT_RULES, is_axes

VOCAB = 96
B, T = 3, 20
N_NEW = 16
BASE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, rope_theta=10_000.0, max_position_embeddings=256, rms_norm_eps=1e-6,
    bos_token_id=2, eos_token_id=1, pad_token_id=0, router_aux_loss_coef=0.01,
)
# layers 1 and 5 sparse ((i + 1) % 2 == 0, 3 listed dense), layers 0, 2, 3, 4 dense; top-2 of 8 renormalised
MIXED = dict(num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
             norm_topk_prob=True)
# every layer sparse, top-2 of 4 not renormalised, tied head, YaRN past 16 positions
SPARSE = dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
              norm_topk_prob=False, tie_word_embeddings=True,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                               "original_max_position_embeddings": 16})
KINDS = {"mixed": MIXED, "sparse": SPARSE}


def _torch_model(kind: str, seed: int = 0, **overrides):
    """A random tiny Qwen3MoeForCausalLM (fp32, eager attention and experts) whose routing is
    decisive (router weights N(0, 0.5^2): no near-ties for float error to flip) and whose experts
    move the residual stream (N(0, 0.15^2)), so a routing or weighting error shows in the logits."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**{**BASE, **KINDS[kind], **overrides})
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32)
    model.config._attn_implementation = "eager"
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif ".experts." in name:
                p.normal_(0.0, 0.15)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None  # greedy references run the full length
    return model.eval()


_BUILT: dict = {}


def _built(kind: str, tmp_path_factory) -> tuple:
    """(kind, config, params, torch model, checkpoint path) of a tiny model, built once per module."""
    if kind not in _BUILT:
        model = _torch_model(kind)
        path = str(tmp_path_factory.mktemp(f"qwen3moe-{kind}") / "ckpt")
        model.save_pretrained(path, safe_serialization=True)
        config, params = load_hf(path, "float32")
        _BUILT[kind] = (kind, config, params, model, path)
    return _BUILT[kind]


@pytest.fixture(scope="module", params=list(KINDS))
def tiny(request, tmp_path_factory):
    return _built(request.param, tmp_path_factory)


def _batch(seed=0):
    """Tokens [B,T]: row 0 full, row 1 right-padded (13 real), row 2 left-padded (5 pads); positions
    16-19 lie past the sparse model's YaRN original context (16)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, VOCAB, (B, T))
    mask = np.ones((B, T), bool)
    mask[1, 13:] = False
    mask[2, :5] = False
    tokens[~mask] = 0
    return tokens, mask


def _positions(mask):
    return np.maximum(np.cumsum(mask, 1) - 1, 0)


def _torch_forward(model, tokens, mask, **kwargs):
    return model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                 position_ids=torch.tensor(_positions(mask)), **kwargs)


# ------------------------------------------------------------------------------ config


def test_config_reads_the_moe_settings_and_counts_transformers_parameters(tiny):
    kind, config, params, model, _ = tiny
    hf_sparse = tuple(isinstance(layer.mlp, transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock)
                      for layer in model.model.layers)
    assert config.model_type == "qwen3_moe" and config.qk_norm and config.sparse_layers() == hf_sparse
    assert hf_sparse == ((False, True, False, False, False, True) if kind == "mixed" else (True,) * 3)
    assert config.has_mixed_mlps == (kind == "mixed") and config.is_moe
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        KINDS[kind]["num_experts"], 2, 16)
    assert config.norm_topk_prob == (kind == "mixed") and config.router_aux_loss_coef == 0.01
    assert config.rope_type == ("yarn" if kind == "sparse" else "default")
    n_torch = sum(p.numel() for p in model.parameters())
    assert config.num_params() == n_torch
    stored = sum(x.size for x in jax.tree.leaves(params))
    if kind == "sparse":
        assert stored == n_torch and "mlp" not in params["layers"]
    else:  # every layer holds a dense MLP and the experts; the unused one is zeros
        assert stored > n_torch
        sparse = np.array(config.sparse_layers())
        assert not np.any(np.asarray(params["layers"]["mlp"]["gate_proj"]["kernel"])[sparse])
        assert not np.any(np.asarray(params["layers"]["moe"]["experts"]["down_proj"])[~sparse])
    assert config_from_hf(config_to_hf(config)) == config
    # transformers 5 writes num_experts as num_local_experts; released configs say num_experts
    written = model.config.to_dict()
    assert "num_local_experts" in written and config_from_hf(written) == config.replace(
        param_dtype="float32", compute_dtype="float32")


def test_refusals_and_validation():
    hf = transformers.Qwen3MoeConfig(**{**BASE, **MIXED}).to_dict()
    with pytest.raises(JmarlError, match="shared expert"):
        config_from_hf({**hf, "shared_expert_intermediate_size": 64})
    with pytest.raises(JmarlError, match="shared expert"):
        config_from_hf({**hf, "model_type": "qwen2_moe"})
    with pytest.raises(JmarlError, match="use_sliding_window"):
        config_from_hf({**hf, "use_sliding_window": True})
    config = config_from_hf(hf)
    with pytest.raises(JmarlError, match="num_experts_per_tok"):
        config.replace(num_experts_per_tok=9)
    with pytest.raises(JmarlError, match="qwen3_moe only"):
        preset_config("qwen3-0.6b", num_experts=4)
    with pytest.raises(JmarlError, match="decoder_sparse_step"):
        config.replace(decoder_sparse_step=0)
    # num_experts 0: every layer dense, as in transformers
    dense = config.replace(num_experts=0)
    assert not dense.is_moe and "moe" not in param_shapes(dense)["layers"]


# ------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_logits_match_transformers_with_right_and_left_padding(tiny, impl):
    _, config, params, model, _ = tiny
    tokens, mask = _batch()
    with torch.no_grad():
        ref = _torch_forward(model, tokens, mask).logits.numpy()
    ours = np.asarray(jax.jit(apply, static_argnums=0)(config.replace(attention=impl), params, tokens, mask))
    assert np.abs(ref).max() > 1.0  # logits of a size where 1e-4 is tight
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)


def test_a_wrong_top_k_weighting_is_seen_in_the_logits(tiny):
    """The parity above would fail if the renormalisation were skipped (or done when it should
    not be): flipping norm_topk_prob moves the logits by far more than the tolerance."""
    _, config, params, model, _ = tiny
    tokens, mask = _batch()
    with torch.no_grad():
        ref = _torch_forward(model, tokens, mask).logits.numpy()
    flipped = np.asarray(apply(config.replace(norm_topk_prob=not config.norm_topk_prob), params, tokens, mask))
    assert np.abs(flipped - ref)[mask].max() > 1e-2


def test_route_renormalises_the_top_k_and_keeps_the_logits_dtype():
    logits = jnp.asarray([[0.0, 1.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]], jnp.bfloat16)
    probs, w, experts = moe.route(logits, 2, normalize=False)
    p = np.asarray(jax.nn.softmax(np.asarray(logits, np.float32)))
    np.testing.assert_array_equal(np.asarray(experts), [[2, 1], [0, 1]])
    assert probs.dtype == jnp.float32 and w.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(w, np.float32), np.take_along_axis(p, np.asarray(experts), 1), rtol=1e-2)
    _, w_norm, _ = moe.route(logits, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(w_norm, np.float32).sum(-1), 1.0, rtol=1e-2)


@pytest.mark.slow
def test_expert_ffn_equals_a_loop_over_tokens():
    rng = np.random.default_rng(0)
    n, d, f, e, k = 11, 6, 5, 4, 3
    x = rng.normal(size=(n, d)).astype(np.float32)
    gate, up = rng.normal(size=(e, d, f)).astype(np.float32), rng.normal(size=(e, d, f)).astype(np.float32)
    down = rng.normal(size=(e, f, d)).astype(np.float32)
    experts = np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32)
    experts[:4] = [0, 1, 2]  # an expert may get no token: expert 3 then serves fewer rows
    weights = rng.random((n, k)).astype(np.float32)
    got = np.asarray(moe.expert_ffn(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), gate, up, down))
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    want = np.stack([sum(weights[i, j] * (silu(x[i] @ gate[experts[i, j]]) * (x[i] @ up[experts[i, j]]))
                         @ down[experts[i, j]] for j in range(k)) for i in range(n)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _grads_by_hf_name(config, grads):
    out = {}
    for path, name, transposed, index in _tensor_specs(config):
        g = grads
        for key in path:
            g = g[key]
        g = np.asarray(g if index is None else g[index])
        out[name] = g.T if transposed else g
    return out


def _torch_grads(model):
    """{checkpoint name: grad} of a torch model, its fused experts split per expert."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.numpy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32)
        if name.endswith("mlp.experts.gate_up_proj"):
            f = g.shape[1] // 2
            for e in range(g.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = g[e, :f]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = g[e, f:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(g.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = g[e]
        else:
            out[name] = g
    return out


def _compare_grads(config, grads, model):
    ours, ref = _grads_by_hf_name(config, grads), _torch_grads(model)
    if config.tie_word_embeddings:
        ref.pop("lm_head.weight", None)  # tied: the embedding's gradient holds both
    assert set(ours) == set(ref)
    scale = max(np.abs(g).max() for g in ref.values())
    for name, g in ours.items():
        np.testing.assert_allclose(g, ref[name], atol=2e-5 * scale + 1e-6, rtol=2e-3, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("kind,remat", [("mixed", "none"), ("mixed", "full"), ("sparse", "none")])
def test_logprob_and_aux_loss_gradients_match_torch_autograd(kind, remat, tmp_path_factory):
    """The loss an update would form, sum(log-probs * w) + aux (the load-balancing loss from the
    same forward pass: only the sparse layers, only the real tokens), its value and gradient
    equal torch autograd's through transformers' output_router_logits aux_loss. remat full: the
    layer scan's custom backward pass carries the kind flag and the router stats."""
    _, config, params, model, _ = _built(kind, tmp_path_factory)
    config = config.replace(remat=remat)
    tokens, mask = _batch(1)
    weights = np.random.default_rng(2).normal(size=tokens.shape).astype(np.float32)

    def loss(p):
        lp, stats = token_logprobs(config, p, jnp.asarray(tokens), jnp.asarray(mask), with_router_stats=True)
        aux = moe.load_balancing_loss(stats)
        return jnp.sum(lp * weights) + aux, (jnp.sum(lp * weights), aux)

    (_, (value, aux)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    model.zero_grad()
    out = _torch_forward(model, tokens, mask, output_router_logits=True)
    assert len(out.router_logits) == sum(config.sparse_layers())
    logp = torch.log_softmax(out.logits, dim=-1)
    picked = torch.gather(logp[:, :-1], 2, torch.tensor(tokens[:, 1:])[..., None])[..., 0]
    has_context = torch.tensor((mask & (_positions(mask) > 0))[:, 1:])
    ref = torch.sum(torch.where(has_context, picked, 0.0) * torch.tensor(weights[:, 1:]))
    (ref + out.aux_loss).backward()
    np.testing.assert_allclose(float(value), float(ref.detach()), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(float(aux), float(out.aux_loss.detach()), rtol=1e-5)
    _compare_grads(config, grads, model)
    if kind == "mixed":  # the unused feed-forward slots get no gradient (they stay zeros under AdamW)
        sparse = np.array(config.sparse_layers())
        assert not np.any(np.asarray(grads["layers"]["mlp"]["up_proj"]["kernel"])[sparse])
        assert not np.any(np.asarray(grads["layers"]["moe"]["router"]["kernel"])[~sparse])


@pytest.mark.slow
def test_load_balancing_loss_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 2 * 7, 6)).astype(np.float32)  # 3 sparse layers, B=2 x T=7 tokens, 6 experts
    mask = np.ones((2, 7), bool)
    mask[1, 4:] = False
    for m in (None, mask):
        ref = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), 6, 2,
                                       None if m is None else torch.tensor(m.astype(np.int64)))
        got = moe.load_balancing_loss_from_logits(jnp.asarray(logits), 2, None if m is None else m.reshape(-1))
        np.testing.assert_allclose(float(got), float(ref), rtol=1e-6)
    # uniform probabilities: E * sum_e (counts_e / N) / E = top_k, whichever experts the ties pick
    uniform = moe.load_balancing_loss_from_logits(jnp.zeros((1, 4, 6)), 2)
    np.testing.assert_allclose(float(uniform), 2.0, rtol=1e-6)
    assert float(moe.load_balancing_loss(moe.RouterStats.zeros(0))) == 0.0


@pytest.mark.slow
def test_every_layout_returns_the_same_router_stats(tiny):
    """Each row with its own prompt: the shared-prefix and packed layouts count the same tokens
    as the plain forward, so their stats (and log-probs) equal token_logprobs', and so do
    apply's. A model without experts answers empty stats (a loss of 0)."""
    from jmarl.train.packing import pack, plain_samples

    _, config, params, _, _ = tiny
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 3, 6)]
    conts = [rng.integers(3, VOCAB, n).tolist() for n in (4, 6, 2)]
    n, t = len(prompts), 12
    joined, joined_mask = np.zeros((n, t), np.int32), np.zeros((n, t), bool)
    prefix, prefix_mask = np.zeros((n, 6), np.int32), np.zeros((n, 6), bool)
    cont, cont_mask = np.zeros((n, 6), np.int32), np.zeros((n, 6), bool)
    for i, (p, c) in enumerate(zip(prompts, conts)):
        joined[i, :len(p) + len(c)], joined_mask[i, :len(p) + len(c)] = p + c, True
        prefix[i, 6 - len(p):], prefix_mask[i, 6 - len(p):] = p, True
        cont[i, :len(c)], cont_mask[i, :len(c)] = c, True
    full, want = token_logprobs(config, params, joined, joined_mask, with_router_stats=True)
    lp, got = prefix_token_logprobs(config, params, prefix, prefix_mask, np.arange(n), cont, cont_mask,
                                    with_router_stats=True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)
    plain = {"tokens": joined, "attention_mask": joined_mask, "loss_mask": np.zeros((n, t), bool),
             "behavior_logprobs": np.zeros((n, t), np.float32), "reward": np.zeros((n,), np.float32)}
    for i, (p, c) in enumerate(zip(prompts, conts)):
        plain["loss_mask"][i, len(p):len(p) + len(c)] = True
    (packed,) = pack([plain_samples(plain)], parts=1, width=32)
    tokens = jnp.asarray(packed["packed_tokens"])
    _, got_packed = packed_token_logprobs(
        config, params, tokens, jnp.asarray(packed["packed_positions"]), jnp.asarray(packed["packed_segment"]),
        jnp.asarray(packed["packed_branch"]), jnp.asarray(packed["pred_source"]) % tokens.size,
        jnp.asarray(packed["pred_target"]), with_router_stats=True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got_packed, want)
    for i, (p, c) in enumerate(zip(prompts, conts)):
        np.testing.assert_allclose(np.asarray(lp)[i, :len(c)], np.asarray(full)[i, len(p):len(p) + len(c)],
                                   atol=2e-5)
    _, from_apply = apply(config, params, joined, joined_mask, with_router_stats=True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), from_apply, want)
    dense = preset_config("qwen3-0.6b").replace(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_layers=1,
                                                num_heads=2, num_kv_heads=1, head_dim=8)
    from jmarl.models import init
    _, empty = token_logprobs(dense, init(dense, jax.random.key(0)), joined, joined_mask, with_router_stats=True)
    assert empty.counts.shape == (0,) and float(moe.load_balancing_loss(empty)) == 0.0


# ------------------------------------------------------------------------------ generation


def _left_padded(lengths, width, seed=0):
    return left_padded(lengths, width, VOCAB, seed)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sparse", "mixed"])
def test_greedy_generation_matches_transformers(kind, tmp_path_factory):
    """16 greedy tokens through `jmarl.models.generate` (prefill + the KV-cache decode step, which
    does not pass a layer's kind: a mixed model runs both feed-forwards, the unused one zeros)
    equal transformers' `generate`; the sparse model's run past its YaRN original context."""
    _, config, params, model, _ = _built(kind, tmp_path_factory)
    tokens, mask = _left_padded([9, 4, 7], 9, seed=6)
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                             do_sample=False, max_new_tokens=N_NEW, pad_token_id=0)[:, tokens.shape[1]:].numpy()
    out = generate(config, params, tokens, mask, jax.random.key(0),
                   GenerationSpec(max_new_tokens=N_NEW, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    full = np.concatenate([tokens, np.asarray(out.tokens)], 1)
    full_mask = np.concatenate([mask, np.asarray(out.mask)], 1)
    rescored = np.asarray(token_logprobs(config, params, full, full_mask))[:, tokens.shape[1]:]
    np.testing.assert_allclose(np.asarray(out.logprobs), rescored, atol=1e-4)


# ------------------------------------------------------------------------------ HF interop


@pytest.mark.slow
def test_save_hf_round_trip_loads_in_transformers(tiny, tmp_path):
    kind, config, params, _, path = tiny
    params = jax.tree.map(lambda a: a + 0.01 * jnp.sin(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape)), params)
    if kind == "mixed":  # the unused slots stay zeros (the checkpoint has no tensor for them)
        from jmarl.models.model import unused_mlps_zeroed
        params = unused_mlps_zeroed(config, params)
    save_hf(tmp_path, config, params)
    hf = json.load(open(os.path.join(tmp_path, "config.json")))
    assert hf["model_type"] == "qwen3_moe" and hf["architectures"] == ["Qwen3MoeForCausalLM"]
    names = set(read_safetensors(os.path.join(tmp_path, "model.safetensors")))
    assert names == set(read_safetensors(os.path.join(path, "model.safetensors")))  # the released layout
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    tokens, mask = _batch(5)
    with torch.no_grad():
        ref = _torch_forward(model, tokens, mask).logits.numpy()
    ours = np.asarray(apply(config, params, jnp.asarray(tokens), jnp.asarray(mask)))
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)
    config2, params2 = load_hf(tmp_path)
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_fused_expert_tensors_load(tiny, tmp_path):
    """A checkpoint with transformers 5's in-memory names (mlp.experts.gate_up_proj [E, 2Fe, D],
    mlp.experts.down_proj [E, D, Fe]) loads to the same parameters."""
    _, config, params, model, path = tiny
    fused = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in fused)
    if config.tie_word_embeddings:
        fused.pop("lm_head.weight", None)
    os.makedirs(tmp_path / "fused")
    write_safetensors(str(tmp_path / "fused" / "model.safetensors"), fused)
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "fused" / "config.json").write_text(f.read())
    _, loaded = load_hf(tmp_path / "fused", "float32")
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_expert_axis_is_declared_and_split_over_fsdp(tiny):
    _, config, params, _, _ = tiny
    axes = param_axes(config)
    shapes = jax.tree.map(lambda a: a.shape, params)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(shapes, is_leaf=is_shape)
    jax.tree.map(lambda a, s: len(a) == len(s) or pytest.fail(f"{a} vs {s}"), axes, shapes, is_leaf=is_axes)
    experts = axes["layers"]["moe"]["experts"]
    assert experts["gate_proj"] == ("layers", "expert", "embed", "mlp")
    assert axes["layers"]["moe"]["router"]["kernel"] == ("layers", "embed", "expert")
    mesh = {"data": 1, "fsdp": 2, "tensor": 2}
    spec = DEFAULT_RULES.spec(experts["down_proj"], params["layers"]["moe"]["experts"]["down_proj"].shape, mesh)
    assert tuple(spec) == (None, "fsdp", "tensor")  # whole experts over fsdp (expert parallelism), Fe over tensor
    replicated = DEFAULT_RULES.replace(expert=())  # the layout before expert parallelism: D over fsdp
    spec = replicated.spec(experts["down_proj"], params["layers"]["moe"]["experts"]["down_proj"].shape, mesh)
    assert tuple(spec) == (None, None, "tensor", "fsdp")


@pytest.mark.slow
def test_sharded_update_equals_the_unsharded_one(tmp_path_factory, mesh):
    """Parameters placed by their declared axes on a data x fsdp x tensor = 2 x 2 x 2 mesh (the 4
    experts split over fsdp, tokens dispatched to them, Fe over tensor): the log-probs' value
    and gradient under the mesh equal the single-device ones (the all-sparse model: the
    released layout). tests/test_expert_parallel.py has the other expert-parallel checks."""
    from jmarl import sharding

    _, config, params, _, _ = _built("sparse", tmp_path_factory)
    tokens, mask = _batch(6)
    tokens, mask = np.concatenate([tokens, tokens[:1]]), np.concatenate([mask, mask[:1]])  # 4 rows: data x fsdp

    def value_and_grad(p):
        return jax.value_and_grad(lambda p: jnp.sum(token_logprobs(config, p, tokens, mask)))(p)

    want, want_g = jax.jit(value_and_grad)(params)
    mesh = mesh(data=2, fsdp=2, tensor=2)
    specs = sharding.param_specs(param_axes(config), params, mesh)
    placed = jax.device_put(params, jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs))
    with jax.set_mesh(mesh):
        got, got_g = jax.jit(value_and_grad)(placed)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    # sharded sums run in another order: one gradient element of ~6k differed by 1.25e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4), got_g, want_g)


# ------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("name,layers,hidden,heads,moe_f,billions", [
    ("qwen3-30b-a3b", 48, 2048, 32, 768, 30.53), ("qwen3-235b-a22b", 94, 4096, 64, 1536, 235.09)])
def test_presets_have_the_published_shapes_and_transformers_parameter_count(name, layers, hidden, heads, moe_f,
                                                                            billions):
    config = preset_config(name)
    assert (config.model_type, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim) == ("qwen3_moe", layers, hidden, heads, 4, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.vocab_size) == (
        128, 8, moe_f, 151936)
    assert config.norm_topk_prob and not config.tie_word_embeddings and config.rope_theta == 1e6
    assert all(config.sparse_layers()) and not config.has_mixed_mlps
    assert round(config.num_params() / 1e9, 2) == billions
    fields = {k: v for k, v in config_to_hf(config).items() if k not in ("architectures", "model_type")}
    hf = transformers.Qwen3MoeConfig(**fields)
    assert config_from_hf(hf.to_dict()) == config
    with torch.device("meta"):
        reference = transformers.Qwen3MoeForCausalLM(hf)
    assert config.num_params() == sum(p.numel() for p in reference.parameters())
    assert config.num_params() == sum(np.prod(s.shape) for s in jax.tree.leaves(param_shapes(config)))
