"""Decoder-only LMs (Llama 3.x, Qwen2/2.5, Qwen3, Gemma 3 text) in Flax NNX with a pure functional
API, HF checkpoint interop, tokenizers and a KV-cache sampler."""

from jmarl.models.config import ModelConfig
from jmarl.models.gguf import load_gguf, load_gguf_config
from jmarl.models.gguf_tokenizer import gguf_chat_template, load_gguf_tokenizer
from jmarl.models.hf import load_hf, save_hf
from jmarl.models.decode import decode_step, prefill
from jmarl.models.kv_cache import KVCache, init_cache
from jmarl.models.logprobs import packed_token_logprobs, token_logprobs
from jmarl.models.model import Params, apply, init, param_axes, param_shapes, positions_from_mask
from jmarl.models.generation.sampling import sample_token
from jmarl.models.generation.spec import Generation, GenerationSpec
from jmarl.models.generation.static import generate, generate_stacked, num_compiled_programs
from jmarl.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def __getattr__(name: str):
    """`fetch` and `resolve_model` are imported on first use, so that `python -m
    jmarl.models.fetch` runs the module once (runpy warns about a module the package imported)."""
    if name in ("fetch", "resolve_model"):
        import importlib

        fetch = importlib.import_module("jmarl.models.fetch")
        return fetch if name == "fetch" else fetch.resolve
    raise AttributeError(f"module 'jmarl.models' has no attribute {name!r}")

__all__ = [
    "CharTokenizer",
    "Generation",
    "GenerationSpec",
    "HFTokenizer",
    "KVCache",
    "ModelConfig",
    "Params",
    "Tokenizer",
    "apply",
    "decode_step",
    "generate",
    "generate_stacked",
    "gguf_chat_template",
    "init",
    "init_cache",
    "load_gguf",
    "load_gguf_config",
    "load_gguf_tokenizer",
    "load_hf",
    "load_tokenizer",
    "num_compiled_programs",
    "param_axes",
    "param_shapes",
    "positions_from_mask",
    "prefill",
    "packed_token_logprobs",
    "resolve_model",
    "sample_token",
    "save_hf",
    "token_logprobs",
]
