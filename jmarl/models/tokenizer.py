"""Tokenizers behind one small interface: HF tokenizers from a local directory, and a built-in
character tokenizer for offline tasks and tests.

Interface (both classes): `encode(text) -> list[int]` (no special tokens added),
`encode_batch(texts) -> list[np.ndarray]` (the same ids as int32 arrays, for many texts at once:
the `tokenizers` library's batch encode behind a segment cache, or one vectorised lookup per text
for the character tokenizer),
`decode(ids, skip_special_tokens=True) -> str`, `apply_chat_template(messages,
add_generation_prompt=True, tokenize=False)`, `pad_id`, `eos_id`, `bos_id`, `vocab_size`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np

from jmarl.errors import JmarlError
from jmarl.models.token_cache import SegmentCache, probe_cut_rule

# A plain-text chat template: "role: content" per line, then "assistant: " to prompt a reply.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# Gemma's turns, for a Gemma checkpoint that carries no template (the base models): <bos>, then
# "<start_of_turn>{user|model}\n{content}<end_of_turn>\n" per message (a system message is
# prepended to the first user turn, as Gemma has no system role), then "<start_of_turn>model\n".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set system = namespace(text='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set system.text = message['content'] + '\n\n' %}{% else %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['role'] == 'user' %}{{ system.text }}{% set system.text = '' %}{% endif %}"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# model.chat_template names: (Jinja template, the tokens besides EOS that end a reply)
CHAT_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "plain": (PLAIN_CHAT_TEMPLATE, ()),
    "gemma": (GEMMA_CHAT_TEMPLATE, ("<end_of_turn>",)),
}


def is_chat_template(value: str) -> bool:
    """Whether `value` is a template name of `CHAT_TEMPLATES` or Jinja text (holds {{ or {%)."""
    return value in CHAT_TEMPLATES or "{{" in value or "{%" in value


def use_chat_template(tokenizer: "HFTokenizer", value: str) -> "HFTokenizer":
    """`tokenizer` with its prompts rendered by `value` (a `CHAT_TEMPLATES` name or Jinja text)
    instead of its own chat template; a named template's end-of-reply tokens join its stop ids.
    Only an HF tokenizer takes one (the character tokenizer has its fixed plain format)."""
    if not isinstance(tokenizer, HFTokenizer):
        raise JmarlError(f"model.chat_template: {type(tokenizer).__name__} has a fixed prompt format; remove "
                         "model.chat_template or use a Hugging Face / GGUF tokenizer")
    template, stops = CHAT_TEMPLATES.get(value, (value, ()))
    ids = []
    for piece in stops:
        token_id = tokenizer.hf.convert_tokens_to_ids(piece)
        if token_id is None or token_id == tokenizer.hf.unk_token_id:
            raise JmarlError(f"model.chat_template: {value!r} ends replies with {piece!r}, which this tokenizer "
                             "does not have; use a template written for this model")
        ids.append(int(token_id))
    tokenizer.hf.chat_template = template
    tokenizer.turn_end_ids = tuple(ids)
    return tokenizer


class Tokenizer(Protocol):
    """What the rest of jmarl needs from a tokenizer."""

    pad_id: int
    eos_id: int
    bos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]: ...


class CharTokenizer:
    """One token per character: pad 0, eos 1, bos 2, then the 95 printable ASCII characters
    (space to '~') and newline. Other characters encode as '?'. `save(path)` writes an
    equivalent HF `PreTrainedTokenizerFast` so transformers/TRL load the same tokenizer."""

    PAD, EOS, BOS = "<pad>", "</s>", "<s>"
    UNKNOWN_CHAR = "?"

    def __init__(self) -> None:
        chars = [chr(c) for c in range(32, 127)] + ["\n"]
        self.specials = [self.PAD, self.EOS, self.BOS]
        self.id_to_piece = self.specials + chars
        self.piece_to_id = {p: i for i, p in enumerate(self.id_to_piece)}
        self.pad_id, self.eos_id, self.bos_id = 0, 1, 2
        self.vocab_size = len(self.id_to_piece)
        self.chat_template = PLAIN_CHAT_TEMPLATE

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a reply: EOS."""
        return (self.eos_id,)

    def encode(self, text: str) -> list[int]:
        """Character ids; no special tokens are added."""
        return self._ids(text).tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode(t)` of each text as int32[len(t)]: one vectorised table lookup per text
        (measured faster than one lookup over the joined texts, whose split costs more than it saves)."""
        return [self._ids(t) for t in texts]

    def _ids(self, text: str) -> np.ndarray:
        """int32[len(text)]: the id of every character (code points through a lookup table)."""
        table = getattr(self, "_table", None)
        if table is None:
            unknown = self.piece_to_id[self.UNKNOWN_CHAR]
            table = np.full(129, unknown, np.int32)  # code points >= 128 share the last slot
            for piece, i in self.piece_to_id.items():
                if len(piece) == 1 and ord(piece) < 128:
                    table[ord(piece)] = i
            self._table = table
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
        return table[np.minimum(points, 128)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Concatenated characters; special tokens dropped unless `skip_special_tokens=False`."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise JmarlError(f"token id {bad[0]} is outside CharTokenizer's vocabulary of {self.vocab_size}")
        pieces, first = self.id_to_piece, len(self.specials) if skip_special_tokens else 0
        return "".join([pieces[i] for i in ids if i >= first])

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]:
        """`role: content` lines (+ `assistant: `), the same text as `PLAIN_CHAT_TEMPLATE`."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text) if tokenize else text

    def save(self, path: str | os.PathLike) -> None:
        """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json (HF format)."""
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
        from transformers import PreTrainedTokenizerFast

        vocab = dict(self.piece_to_id)
        backend = HFTokenizer(models.WordLevel(vocab, unk_token=self.UNKNOWN_CHAR))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = decoders.Fuse()
        hf = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            pad_token=self.PAD,
            eos_token=self.EOS,
            bos_token=self.BOS,
        )  # no unk_token here: '?' must stay an ordinary (non-special) character
        hf.chat_template = self.chat_template
        os.makedirs(path, exist_ok=True)
        hf.save_pretrained(os.fspath(path))


class HFTokenizer:
    """A transformers tokenizer (and its chat template) behind the jmarl interface."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        if eos is None and pad is None:
            raise JmarlError("the tokenizer defines neither an eos nor a pad token; set one in tokenizer_config.json")
        self.eos_id = int(eos if eos is not None else pad)
        self.pad_id = int(pad if pad is not None else self.eos_id)
        self.bos_id = None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)
        self.turn_end_ids: tuple[int, ...] = ()  # ids besides EOS that end a reply (`use_chat_template`)
        self.vocab_size = len(tokenizer)
        self._segments: SegmentCache | None = None  # built on the first encode_batch

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a reply: EOS, then the chat template's end-of-turn ids."""
        return tuple(dict.fromkeys((self.eos_id, *self.turn_end_ids)))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no special tokens are added."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode(t)` of each text as an int32 array, in one call. Texts are cut at line breaks the tokenizer
        cannot merge across and each repeated segment is tokenised once
        (`jmarl.models.token_cache`: the prompts of a multi-turn task share their long head);
        the new segments go through the fast tokenizer's Rust batch encode."""
        if self._segments is None:
            self._segments = SegmentCache(self._encode_whole, probe_cut_rule(self._encode_whole))
        return self._segments(texts)

    def _encode_whole(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text encoded whole: the fast tokenizer's batch encode (parallel over texts, no
        offsets computed); a slow tokenizer encodes one by one."""
        texts = list(texts)
        if not texts:
            return []
        backend = getattr(self.hf, "backend_tokenizer", None) if getattr(self.hf, "is_fast", False) else None
        if backend is None:
            return [self.encode(t) for t in texts]
        encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        return [e.ids for e in encode(texts, add_special_tokens=False)]  # each a fresh list

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]:
        """The tokenizer's own chat template applied to `messages`."""
        if not getattr(self.hf, "chat_template", None):
            raise JmarlError("this tokenizer has no chat_template; add one to tokenizer_config.json")
        text = self.hf.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.encode(text) if tokenize else text


_GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _declared_class(path: str) -> str | None:
    """The `tokenizer_class` in a directory's tokenizer_config.json, if any."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The HF tokenizer (with its chat template) saved in a local directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise JmarlError(f"tokenizer directory not found: {path}")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise JmarlError(f"no tokenizer.json or tokenizer_config.json in {path}")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        # A tokenizer saved as the generic fast class (CharTokenizer.save, or any tokenizer.json
        # without a model-specific class) is loaded as exactly that: AutoTokenizer would
        # otherwise pick the class of config.json's model_type (e.g. Qwen2Tokenizer) when the
        # tokenizer sits beside a model, and re-tokenise differently.
        if _declared_class(path) in _GENERIC_FAST_CLASSES and os.path.isfile(os.path.join(path, "tokenizer.json")):
            return HFTokenizer(PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True))
        return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError, json.JSONDecodeError) as err:
        raise JmarlError(f"could not load the tokenizer in {path}: {err}") from None
