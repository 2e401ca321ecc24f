"""Model core parity with PyTorch `transformers` on tiny random Llama / Qwen2 / Qwen3 models."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from _tiny_models import VOCAB_SIZE, make_tiny_torch_model, padded_batch, tiny_qwen3
from benchmarks.shared_prefix_model import prefix_token_logprobs
from jmarl.errors import JmarlError
from jmarl.models import apply, init, init_cache, load_hf, param_shapes, prefill, save_hf, token_logprobs
from jmarl.models.model import bind
from jmarl.models.hf import read_safetensors, write_safetensors
from jmarl.models.hf_config import config_from_hf, config_to_hf
from jmarl.models.rope import inv_frequencies

VARIANTS = [
    ("llama", False),
    ("llama", True),
    ("qwen2", False),
    ("qwen2", True),
    ("qwen3", False),
    ("qwen3", True),
]
B, T = 3, 12


def _batch(seed: int = 0):
    """Tokens [B,T]; row 0 full, row 1 right-padded, row 2 left-padded."""
    return padded_batch(VOCAB_SIZE, seed, B, T)


def _positions(mask):
    return np.maximum(np.cumsum(mask, 1) - 1, 0)


def _torch_logits(model, tokens, mask):
    return model(
        input_ids=torch.tensor(tokens),
        attention_mask=torch.tensor(mask.astype(np.int64)),
        position_ids=torch.tensor(_positions(mask)),
    ).logits


def _torch_token_logprobs(logits, tokens, mask, temperature=1.0):
    """Reference out[:, t] = log softmax(logits[:, t-1] / T)[tokens[:, t]], 0 without context."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    picked = torch.gather(logp[:, :-1], 2, torch.tensor(tokens[:, 1:])[..., None])[..., 0]
    out = torch.cat([torch.zeros(tokens.shape[0], 1, dtype=picked.dtype), picked], dim=1)
    has_context = torch.tensor(mask & (_positions(mask) > 0))
    return torch.where(has_context, out, torch.zeros_like(out))


@pytest.fixture(scope="module", params=VARIANTS, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in VARIANTS])
def variant(request, tiny_hf_checkpoint):
    family, tied = request.param
    path = tiny_hf_checkpoint(family, tie_word_embeddings=tied)
    torch_model = make_tiny_torch_model(family, tie_word_embeddings=tied)
    config, params = load_hf(path)
    return dict(family=family, tied=tied, path=path, torch=torch_model, config=config, params=params)


def test_config_reads_family_features(variant):
    c = variant["config"]
    assert c.model_type == variant["family"]
    assert c.tie_word_embeddings == variant["tied"]
    assert ("lm_head" in variant["params"]) == (not variant["tied"])
    assert c.qkv_bias == (variant["family"] == "qwen2")
    assert c.qk_norm == (variant["family"] == "qwen3")
    assert c.rope_type == ("llama3" if variant["family"] == "llama" else "default")
    assert c.head_dim == (24 if variant["family"] == "qwen3" else 16)
    n_torch = sum(p.numel() for p in variant["torch"].parameters())
    assert c.num_params() == n_torch
    assert sum(x.size for x in jax.tree.leaves(variant["params"])) == n_torch


def test_apply_matches_pytorch_on_right_and_left_padding(variant):
    tokens, mask = _batch()
    with torch.no_grad():
        ref = _torch_logits(variant["torch"], tokens, mask).numpy()
    out = np.asarray(jax.jit(apply, static_argnums=0)(variant["config"], variant["params"], tokens, mask))
    assert out.shape == (B, T, VOCAB_SIZE) and out.dtype == np.float32
    assert np.abs(out - ref)[mask].max() < 1e-4


@pytest.mark.slow
def test_prefill_runs_the_last_layer_for_the_last_slot_only(variant):
    """A prefill's last layer computes keys/values for every slot but its attention output and
    MLP for the last slot alone: the logits still equal PyTorch's at the last slot, and the cache
    holds the same keys/values as a full forward pass."""
    config, params = variant["config"], variant["params"]
    tokens, mask = _batch(2)
    tokens, mask = np.roll(tokens, -1, axis=1), np.roll(mask, -1, axis=1)  # row 1 right-padded
    mask[:, -1], tokens[:, -1] = True, 5  # ... now every row's last slot is a real token
    with torch.no_grad():
        ref = _torch_logits(variant["torch"], tokens, mask)[:, -1].numpy()
    one_layer = {**params, "layers": jax.tree.map(lambda a: a[:1], params["layers"])}
    for cfg, p in ((config, params), (config.replace(num_layers=1), one_layer), (config.replace(remat=True), params)):
        logits, cache = jax.jit(prefill, static_argnums=0)(cfg, p, tokens, mask, init_cache(cfg, B, T + 2))
        _, (keys, values) = bind(cfg, p).hidden(jnp.asarray(tokens), jnp.asarray(mask), return_kv=True)
        assert len(cache.keys) == cfg.num_layers
        for i in range(cfg.num_layers):
            np.testing.assert_allclose(cache.keys[i][..., :T], keys[i].transpose(0, 2, 3, 1), atol=1e-5)
            np.testing.assert_allclose(cache.values[i][:, :, :T], values[i].swapaxes(1, 2), atol=1e-5)
        if cfg.num_layers == config.num_layers:
            assert np.abs(np.asarray(logits) - ref).max() < 1e-4
    # Outside the scan over layers 0..L-2, the products that read the MLP's intermediate
    # activations (down, and o when H x hd = its width) have B rows (the last slot), not B x T.
    jaxpr = jax.make_jaxpr(lambda p: prefill(config, p, tokens, mask, init_cache(config, B, T + 2)))(params)
    rows = [e.outvars[0].aval.shape[0] for e in jaxpr.jaxpr.eqns
            if e.primitive.name == "dot_general" and e.invars[0].aval.shape[-1] == config.intermediate_size]
    assert rows and set(rows) == {B}


def test_token_logprobs_and_gradient_match_pytorch(variant):
    config, params, model = variant["config"], variant["params"], variant["torch"]
    tokens, mask = _batch(1)
    temperature = 0.7
    model.zero_grad()
    ref = _torch_token_logprobs(_torch_logits(model, tokens, mask), tokens, mask, temperature)
    ref.sum().backward()

    def total(p):
        lp = token_logprobs(config, p, tokens, mask, temperature, chunk_size=5)
        return lp.sum(), lp

    (_, lp), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(lp), ref.detach().numpy(), atol=1e-5)
    torch_params = dict(model.named_parameters())
    checks = [
        (grads["layers"]["attn"]["q_proj"]["kernel"][0].T, "model.layers.0.self_attn.q_proj.weight"),
        (grads["layers"]["mlp"]["down_proj"]["kernel"][1].T, "model.layers.1.mlp.down_proj.weight"),
        (grads["layers"]["attn_norm"]["scale"][1], "model.layers.1.input_layernorm.weight"),
        (grads["embed"]["embedding"], "model.embed_tokens.weight"),
        (grads["final_norm"]["scale"], "model.norm.weight"),
    ]
    if not variant["tied"]:
        checks.append((grads["lm_head"]["kernel"].T, "lm_head.weight"))
    if variant["family"] == "qwen2":
        checks.append((grads["layers"]["attn"]["k_proj"]["bias"][0], "model.layers.0.self_attn.k_proj.bias"))
    if variant["family"] == "qwen3":
        checks.append((grads["layers"]["attn"]["q_norm"]["scale"][0], "model.layers.0.self_attn.q_norm.weight"))
    for ours, name in checks:
        theirs = torch_params[name].grad.numpy()
        rel = np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max()
        assert rel < 1e-4, (name, rel)


def _prefixed_batch(seed: int = 0):
    """3 shared prefixes [3, 8] (left-padded; lengths 5, 0, 8), rows [0, 0, 1, 2, 2], and 5
    continuations [5, 6] (right-padded; lengths 6, 3, 6, 1, 4); plus the concatenated [5, 14] rows."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, VOCAB_SIZE, (3, 8))
    prefix_mask = np.zeros((3, 8), bool)
    prefix_mask[0, 3:] = True
    prefix_mask[2, :] = True
    prefix[~prefix_mask] = 0
    rows = np.array([0, 0, 1, 2, 2], np.int32)
    cont = rng.integers(3, VOCAB_SIZE, (5, 6))
    cont_mask = np.arange(6)[None, :] < np.array([6, 3, 6, 1, 4])[:, None]
    cont[~cont_mask] = 0
    joined = np.concatenate([prefix[rows], cont], axis=1)
    joined_mask = np.concatenate([prefix_mask[rows], cont_mask], axis=1)
    return prefix, prefix_mask, rows, cont, cont_mask, joined, joined_mask


def test_prefix_token_logprobs_match_pytorch_on_joined_rows(variant):
    """Shared-prefix scoring gives, logit for logit, what transformers gives on each row's
    prefix + continuation (an empty prefix and padding on both sides included)."""
    config, params, model = variant["config"], variant["params"], variant["torch"]
    prefix, prefix_mask, rows, cont, cont_mask, joined, joined_mask = _prefixed_batch(2)
    with torch.no_grad():
        ref = _torch_token_logprobs(_torch_logits(model, joined, joined_mask), joined, joined_mask, 0.7)
    fn = jax.jit(prefix_token_logprobs, static_argnums=0)
    out = np.asarray(fn(config, params, prefix, prefix_mask, rows, cont, cont_mask, 0.7))
    assert out.shape == cont.shape
    np.testing.assert_allclose(out, ref.numpy()[:, 8:], atol=1e-5)
    assert out[2, 0] == 0.0 and np.all(out[~cont_mask] == 0.0)  # no context; padding
    assert np.all(out[cont_mask & (np.arange(6) > 0)] < 0)


@pytest.mark.slow
def test_prefix_token_logprobs_gradient_equals_joined_rows(tiny_hf_checkpoint):
    """Gradients of a weighted sum of log-probs: shared prefixes (computed once, keys/values
    gathered per row) equal the plain forward over the joined rows, remat and chunking included."""
    config, params = load_hf(tiny_hf_checkpoint("qwen3"))
    prefix, prefix_mask, rows, cont, cont_mask, joined, joined_mask = _prefixed_batch(3)
    weights = np.random.default_rng(0).normal(size=cont.shape).astype(np.float32)

    def shared(p, cfg):
        return jnp.sum(weights * prefix_token_logprobs(cfg, p, prefix, prefix_mask, rows, cont, cont_mask, chunk_size=4))

    def plain(p):
        return jnp.sum(weights * token_logprobs(config, p, joined, joined_mask)[:, 8:])

    g_plain = jax.jit(jax.grad(plain))(params)
    for cfg in (config, config.replace(remat=True)):
        g_shared = jax.jit(jax.grad(lambda p: shared(p, cfg)))(params)
        # two float32 summation orders: one element of ~6k differed by 1.3e-6 under the tests'
        # XLA:CPU emitters (tests/conftest.py)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6), g_shared, g_plain)


@pytest.mark.slow
def test_bfloat16_path_stays_close(variant):
    config, params = load_hf(variant["path"], dtype="bfloat16")
    assert config.param_dtype == config.compute_dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    tokens, mask = _batch()
    with torch.no_grad():
        logits = _torch_logits(variant["torch"], tokens, mask)
    ref_lp = _torch_token_logprobs(logits, tokens, mask).numpy()
    out = np.asarray(apply(config, params, tokens, mask))
    assert np.isfinite(out).all()
    assert np.abs(out - logits.numpy())[mask].max() < 2e-2
    lp = np.asarray(token_logprobs(config, params, tokens, mask))
    assert np.abs(lp - ref_lp).max() < 2e-2


def test_save_hf_loads_in_transformers_and_round_trips_bitwise(variant, tmp_path):
    config, params = variant["config"], variant["params"]
    save_hf(tmp_path, config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens, mask = _batch(2)
    with torch.no_grad():
        ref = _torch_logits(reloaded, tokens, mask).numpy()
    out = np.asarray(apply(config, params, tokens, mask))
    assert np.abs(out - ref)[mask].max() < 1e-4
    config2, params2 = load_hf(tmp_path)
    assert config2 == config
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), params, params2)
    assert all(jax.tree.leaves(same))


@pytest.mark.slow
def test_bfloat16_save_load_round_trip_is_bitwise(tiny_hf_checkpoint, tmp_path):
    config = config_from_hf(tiny_hf_checkpoint("qwen3"))
    config = config.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    params = init(config, jax.random.key(3))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    save_hf(tmp_path / "bf16", config, params)
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    config2, params2 = load_hf(tmp_path / "bf16")
    assert config2 == config
    bits = lambda x: np.asarray(x).view(np.uint16)  # noqa: E731
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(bits(a), bits(b)), params, params2)))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert hf_model.dtype == torch.bfloat16
    embed = hf_model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(embed, np.asarray(params["embed"]["embedding"], np.float32))


@pytest.mark.slow
def test_init_matches_param_shapes_and_is_loadable_by_transformers(tmp_path):
    config = tiny_qwen3(model_type="qwen2", vocab_size=VOCAB_SIZE, intermediate_size=48, num_layers=3, num_kv_heads=1,
                        qkv_bias=True, qk_norm=False, o_bias=False)
    params = init(config, jax.random.key(0))
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), params)
    assert shapes == jax.tree.map(lambda x: (x.shape, x.dtype), param_shapes(config))
    assert params["layers"]["attn"]["k_proj"]["kernel"].shape == (3, 32, 8)
    assert np.std(np.asarray(params["layers"]["mlp"]["up_proj"]["kernel"])) == pytest.approx(0.02, rel=0.1)
    save_hf(tmp_path, config, params)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens, mask = _batch(3)
    with torch.no_grad():
        ref = _torch_logits(hf_model, tokens, mask).numpy()
    assert np.abs(np.asarray(apply(config, params, tokens, mask)) - ref)[mask].max() < 1e-4


@pytest.mark.slow
def test_remat_vmap_and_chunking_agree(tiny_hf_checkpoint):
    config, params = load_hf(tiny_hf_checkpoint("qwen2"))
    tokens, mask = _batch(4)

    def loss(cfg, p, chunk):
        return token_logprobs(cfg, p, tokens, mask, chunk_size=chunk).sum()

    g_plain = jax.jit(jax.grad(lambda p: loss(config, p, None)))(params)
    g_remat = jax.jit(jax.grad(lambda p: loss(config.replace(remat=True), p, 3)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_plain, g_remat)
    # Two policies stacked on a leading axis, vmapped, equal two separate calls.
    other = init(config, jax.random.key(1))
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, other)
    both = jax.jit(jax.vmap(lambda p: apply(config, p, tokens, mask)))(stacked)
    np.testing.assert_allclose(both[0], apply(config, params, tokens, mask), atol=1e-6)
    np.testing.assert_allclose(both[1], apply(config, other, tokens, mask), atol=1e-6)


def _largest_vocab_block(jaxpr, vocab: int, hidden: int) -> int:
    """Size of the largest intermediate with a vocab axis (parameter-shaped [V, D] excluded)."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = tuple(getattr(var.aval, "shape", ()))
            if vocab in shape and hidden not in shape:
                biggest = max(biggest, int(np.prod(shape)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    biggest = max(biggest, _largest_vocab_block(getattr(inner, "jaxpr", inner), vocab, hidden))
    return biggest


def test_token_logprobs_never_holds_full_vocab_logits_for_all_positions():
    config = tiny_qwen3(vocab_size=4096, num_heads=2, num_kv_heads=1, head_dim=16, o_bias=False)
    params = init(config, jax.random.key(0))
    b, t = 2, 64
    tokens = jnp.zeros((b, t), jnp.int32)
    mask = jnp.ones((b, t), bool)
    grad_fn = jax.grad(lambda p: token_logprobs(config, p, tokens, mask, chunk_size=8).sum())
    v, d = config.vocab_size, config.hidden_size
    biggest = _largest_vocab_block(jax.make_jaxpr(grad_fn)(params).jaxpr, v, d)
    assert biggest <= b * 8 * v  # one chunk, not b * (t - 1) * vocab
    full = _largest_vocab_block(jax.make_jaxpr(lambda p: apply(config, p, tokens, mask))(params).jaxpr, v, d)
    assert full >= b * t * config.vocab_size  # the check above is able to see a full block


def test_config_from_hf_reads_legacy_and_transformers5_rope_styles():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                num_hidden_layers=1, num_attention_heads=2)
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    legacy = config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    older = config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
    new = config_from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert legacy == older == new
    assert new.rope_type == "llama3" and new.rope_theta == 5e5 and new.num_kv_heads == 2 and new.head_dim == 4
    hf_inv = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](
        transformers.LlamaConfig(**{**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}),
        "cpu",
    )[0]
    np.testing.assert_allclose(inv_frequencies(new), hf_inv.numpy(), rtol=1e-6)
    assert config_from_hf(config_to_hf(new)) == new


def test_rope_tables_match_transformers_and_hold_no_cos_or_sin_in_the_program():
    """Gathered from trace-time tables (a static bound on the positions) or computed in the
    program (no bound, or tables past the size limit): both equal HF's rotary cos/sin."""
    from jmarl.models.rope import ROPE_TABLE_MAX_BYTES, rope_tables

    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    hf = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **scaling})
    config = config_from_hf(hf)
    positions = np.array([[0, 1, 2, 99], [7, 50, 98, 3]], np.int32)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(transformers.LlamaConfig(**hf))
    want = [t.numpy() for t in rotary(torch.zeros(1, dtype=torch.float32), torch.tensor(positions, dtype=torch.long))]
    too_many = ROPE_TABLE_MAX_BYTES // (4 * config.head_dim) + 1
    for bound in (100, None, too_many):
        got = jax.jit(lambda p, bound=bound: rope_tables(config, p, bound))(positions)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-6)
    gathered = jax.jit(lambda p: rope_tables(config, p, 100)).lower(positions).as_text()
    computed = jax.jit(lambda p: rope_tables(config, p, too_many)).lower(positions).as_text()
    assert "cosine" not in gathered and "sine" not in gathered
    assert "cosine" in computed and "sine" in computed


@pytest.fixture(scope="module")
def qwen2_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen2")  # read only: the bad checkpoints are edited copies


def _copy_checkpoint(src, dst, edit_config=None, edit_tensors=None):
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if edit_config:
        edit_config(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = {k: np.array(v) for k, v in read_safetensors(os.path.join(src, "model.safetensors")).items()}
    if edit_tensors:
        edit_tensors(tensors)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    return dst


def test_bad_checkpoints_raise_jmarl_error_naming_the_problem(qwen2_dir, tmp_path):
    with pytest.raises(JmarlError, match="not found"):
        load_hf(tmp_path / "nowhere")
    bad_type = _copy_checkpoint(qwen2_dir, tmp_path / "t", edit_config=lambda c: c.update(model_type="gpt2"))
    with pytest.raises(JmarlError, match="unsupported model_type 'gpt2'"):
        load_hf(bad_type)
    missing = _copy_checkpoint(qwen2_dir, tmp_path / "m",
                               edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(JmarlError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(missing)

    def shrink(t):
        t["model.layers.0.self_attn.v_proj.weight"] = t["model.layers.0.self_attn.v_proj.weight"][:-1]

    wrong = _copy_checkpoint(qwen2_dir, tmp_path / "w", edit_tensors=shrink)
    with pytest.raises(JmarlError, match=r"model\.layers\.0\.self_attn\.v_proj\.weight in .* has shape \[31, 64\], expected \[32, 64\]"):
        load_hf(wrong)
    no_weights = _copy_checkpoint(qwen2_dir, tmp_path / "n")
    os.remove(os.path.join(no_weights, "model.safetensors"))
    with pytest.raises(JmarlError, match="model.safetensors"):
        load_hf(no_weights)
    with pytest.raises(JmarlError, match="config.json"):
        config_from_hf(tmp_path / "empty_dir_that_does_not_exist")


def test_sharded_index_checkpoint_loads(qwen2_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen2_dir)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    _, sharded = load_hf(tmp_path)
    _, single = load_hf(qwen2_dir)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, b), sharded, single)))
