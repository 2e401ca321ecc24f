"""The tokenizer a GGUF checkpoint describes, as a jmarl tokenizer.

`load_gguf_tokenizer(path)` builds the tokenizer described by the file's `tokenizer.*` metadata
(transformers' own GGUF tokenizer conversion, fed from the `gguf` reader, so no torch) behind
jmarl's `HFTokenizer`; `gguf_chat_template(path)` is the chat template the file carries. The
weights and config: `jmarl.models.gguf`.
"""

from __future__ import annotations

import os
from typing import Any

from jmarl.errors import JmarlError
from jmarl.models.gguf import open_gguf
from jmarl.models.tokenizer import HFTokenizer

# tokenizer.* metadata key -> transformers' tokenizer_dict key (as its GGUF tokenizer mapping has it)
_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.precompiled_charsmap": "precompiled_charsmap",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unk_token_id",
                "pad_token": "pad_token_id"}


def gguf_chat_template(path: str | os.PathLike) -> str | None:
    """The chat template (`tokenizer.chat_template`) a GGUF file carries, or None."""
    return open_gguf(path).value("tokenizer.chat_template", None)


def _convert_tokenizer(architecture: str, tokenizer_dict: dict) -> tuple[Any, dict]:
    """transformers' GGUF tokenizer conversion: `tokenizers.Tokenizer` + extra init kwargs."""
    try:  # transformers 5
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:  # transformers 4
        from transformers.integrations.ggml import convert_gguf_tokenizer
    return convert_gguf_tokenizer(architecture, tokenizer_dict)


def load_gguf_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer a GGUF file describes, with its chat template, as a jmarl `HFTokenizer`.

    Built by transformers' GGUF tokenizer conversion (the one `AutoTokenizer.from_pretrained(dir,
    gguf_file=...)` runs) from metadata read here with the `gguf` package, so no torch is needed.
    `tokenizer.hf.save_pretrained(dir)` writes it beside a `save_hf` export.
    """
    f = open_gguf(path)
    if f.value("tokenizer.ggml.tokens", None) is None:
        raise JmarlError(f"GGUF file {f.path} carries no tokenizer (no tokenizer.ggml.tokens)")
    tokenizer_dict = {}
    for key, name in _TOKENIZER_KEYS.items():
        value = f.value(key, None)
        if value is not None:
            tokenizer_dict[name] = value
    architecture = f.value("general.architecture")
    try:
        backend, extra = _convert_tokenizer(architecture, tokenizer_dict)
    except (KeyError, ValueError) as err:
        raise JmarlError(
            f"cannot build the tokenizer of GGUF file {f.path} (tokenizer.ggml.model "
            f"{tokenizer_dict.get('tokenizer_type')!r}): {err}"
        ) from None
    tokens = tokenizer_dict["tokens"]
    backend = _drop_foreign_tokens(backend, len(tokens))
    _fix_pre_tokenizer(backend, tokenizer_dict.get("pre_tokenizer_type"))
    from transformers import PreTrainedTokenizerFast

    specials = {}
    for kwarg, key in _SPECIAL_IDS.items():
        index = tokenizer_dict.get(key)
        if index is not None and 0 <= int(index) < len(tokens):
            specials[kwarg] = tokens[int(index)]
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **{**extra, **specials, "clean_up_tokenization_spaces": False})
    template = f.value("tokenizer.chat_template", None)
    if template:
        hf.chat_template = template
    return HFTokenizer(hf)


def _drop_foreign_tokens(backend: Any, vocab_size: int) -> Any:
    """`backend` without added tokens beyond the file's vocabulary: the conversion's GPT-2
    tokenizer adds its default `<|endoftext|>` when the vocabulary has none, an id the model
    does not embed."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    added = spec.get("added_tokens") or []
    kept = [t for t in added if int(t["id"]) < vocab_size]
    if len(kept) == len(added):
        return backend
    spec["added_tokens"] = kept
    return Tokenizer.from_str(json.dumps(spec))


def _fix_pre_tokenizer(backend: Any, pre: str | None) -> None:
    """llama.cpp pre-tokenizer types transformers' conversion leaves at GPT-2's default split.

    "smollm" (SmolLM/SmolLM2) splits every digit on its own before the GPT-2 split, as the
    model's own tokenizer.json does (`Digits(individual_digits=True)`, then `ByteLevel`)."""
    if pre != "smollm":
        return
    from tokenizers import pre_tokenizers

    current = backend.pre_tokenizer
    if current is not None and "Digits" in repr(current):
        return
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
