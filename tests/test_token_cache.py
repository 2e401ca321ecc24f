"""Segment-cached batch encoding (`jmarl.models.token_cache`): equal to whole-text encoding."""

from __future__ import annotations

import random

import pytest

from jmarl.models.token_cache import SegmentCache, probe_cut_rule, split_segments

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "Board:\n#####\n#A..#\n#..G#\n\nTurn 1 of 4.\n\n\nActions: U R R D\n",
    "Problem: What is 3 + 4?\nThe answer is \\boxed{7}.\n\n  indented line\n\tTabbed\n",
    "def f(x):\n    return x + 1\n\n\nprint(f(2))\n",
    "Notes on the warehouse: boxes are heavy.\r\nWalls do not move.\n\nü é 12 345\n",
]


def _backend(style: str):
    """A trained byte-level BPE whose vocabulary has newline merges ("\\n\\n", "\\n\\n\\n"):
    `gpt2` (ByteLevel's own regex), `qwen` (Qwen2's split regex), or `prefix_space`
    (a Metaspace tokenizer that prepends a space to every text: never safe to cut)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif style == "qwen":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    alphabet = pre_tokenizers.ByteLevel.alphabet() if style != "prefix_space" else []
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=["<|user|>", "<|assistant|>"])
    tok.train_from_iterator(CORPUS * 50, trainer)
    return tok


def _encode_whole(tok):
    return lambda texts: [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def _random_text(rng: random.Random) -> str:
    lines = rng.choices(["Board:", "#####", "#A..#", "  indented", "\tTab", "Actions: U R", "x = 1.", "ü é",
                         "", "", "<|user|>hi", "The answer is \\boxed{7}.", "end ", " lead"], k=rng.randint(1, 12))
    seps = rng.choices(["\n", "\n\n", "\n\n\n", "\r\n", " \n"], k=len(lines))
    return "".join(a + b for a, b in zip(lines, seps))[: rng.randint(0, 400)]


def test_split_segments_cuts_only_between_non_whitespace():
    assert split_segments("a\n\nb\nc", "runs") == ["a\n\n", "b\n", "c"]
    assert split_segments("a\n\nb\nc", "single") == ["a\n\nb\n", "c"]
    assert split_segments("a \nb", "runs") == ["a \nb"]  # whitespace before the newline
    assert split_segments("a\n b\nc", "runs") == ["a\n b\n", "c"]  # whitespace after it
    assert split_segments("\n\nx\ny\n", "runs") == ["\n\nx\n", "y\n"]
    assert split_segments("", "runs") == [] and split_segments("abc", "single") == ["abc"]
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng)
        for rule in ("runs", "single"):
            assert "".join(split_segments(text, rule)) == text


@pytest.mark.parametrize("style,rule", [("gpt2", "single"), ("qwen", "runs"), ("prefix_space", None)])
def test_probe_finds_the_rule_the_pre_tokenizer_allows(style, rule):
    tok = _backend(style)
    encode = _encode_whole(tok)
    if style != "prefix_space":  # the vocabulary merges newline runs: gpt2's regex cannot be cut after "\n\n"
        assert len(encode(["\n\n"])[0]) == 1
    assert probe_cut_rule(encode) == rule


@pytest.mark.parametrize("style", ["gpt2", "qwen", "prefix_space"])
def test_cached_encoding_equals_whole_encoding(style):
    encode = _encode_whole(_backend(style))
    cache = SegmentCache(encode, probe_cut_rule(encode), capacity_tokens=3_000)
    rng = random.Random(1)
    heads = [_random_text(rng) + "Task.\n" for _ in range(6)]
    for turn in range(8):  # texts sharing heads, as a multi-turn plan's prompts do
        texts = [rng.choice(heads) + _random_text(rng) for _ in range(40)] + [""]
        assert [a.tolist() for a in cache(texts)] == encode(texts)
    if cache.rule is not None:
        assert cache.hits > 0  # segments of the shared heads were reused
        assert 0 < cache._tokens <= 3_000  # cleared when it would overflow, then refilled


def test_repo_tokenizer_reuses_a_shared_head():
    from jmarl.models import load_tokenizer

    tok = load_tokenizer("configs/hacpo/tokenizers/byte_bpe")
    head = "Problem: What is 3 + 4? " * 50 + "\n\n"
    texts = [head + f"Turn {t}.\nBoard:\n#A.G#\n" for t in range(4)]
    assert [a.tolist() for a in tok.encode_batch(texts)] == [tok.encode(t) for t in texts]
    misses = tok._segments.misses
    assert tok.encode_batch([head + "Turn 9.\n"])[0].tolist() == tok.encode(head + "Turn 9.\n")
    assert tok._segments.misses == misses + 1  # only "Turn 9.\n" was new
