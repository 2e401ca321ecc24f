"""Segment-cached batch encoding: a multi-turn run tokenises each repeated line block once.

In a multi-turn plan the prompts of one task share long blocks (the task statement, the
history so far): turn t's prompt repeats turn t-1's text and adds a little. Tokenising every
prompt in full costs ~5 ms per 4k-token prompt with a byte-level BPE; a step of 8,192 such
prompts spends ~25 s there. `SegmentCache` cuts each text into segments at line breaks where
the tokenizer provably cannot merge across the cut, looks each segment up in a cache, and
encodes only the segments not seen before (all of them in one batch call). The ids of a text
are the concatenation of its segments' ids, equal to encoding the text whole. (A text of one
segment returns the cached array itself, which is read-only.)

Where a text may be cut (a "safe cut"): after a run of newlines that follows a non-whitespace
character and precedes one ("...x\\nY..." or, where the tokenizer allows it, "...x\\n\\nY...").
Byte-level BPE pre-tokenizers (GPT-2, Llama 3, Qwen2/3) never put the newline run and the
next line in one pre-token there, and BPE merges never cross pre-tokens. Whether runs of more
than one newline are safe depends on the pre-tokenizer's regex (GPT-2 splits "\\n\\n" before
a letter into two pre-tokens, Qwen's keeps it whole), so `probe_cut_rule` checks the
tokenizer itself on probe strings once and picks "runs", "single" (one newline only) or
None (never cut: the cache is bypassed).

The cache holds at most `capacity_tokens` ids and is cleared when a batch would overflow it
(the next batch re-tokenises what it needs). Not thread-safe: one sampler thread uses it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

EncodeBatch = Callable[[list[str]], list[list[int]]]
CUT_RULES = ("runs", "single")

_PROBE_LEFT = ("abc", "x = 1.", "Hello, world", "f(a)", "#", "Step 3:", "ü", "12", "<|user|>hi")
_PROBE_RIGHT = ("Board:", "#", "1 2", "(x)", "The end", "ü", "-", "<|assistant|>", "'s")
_PROBE_SEPS = {"single": ("\n",), "runs": ("\n", "\n\n", "\n\n\n", "\n\n\n\n")}


def probe_cut_rule(encode_batch: EncodeBatch) -> str | None:
    """The cut rule `encode_batch` satisfies on every probe: "runs" when texts may be cut after
    any newline run between non-whitespace characters, "single" when only after a lone newline,
    None when not even that holds (e.g. a tokenizer that prepends a space to every text)."""
    for rule in CUT_RULES:
        pairs = [(left + sep, right) for left in _PROBE_LEFT for sep in _PROBE_SEPS[rule] for right in _PROBE_RIGHT]
        whole = encode_batch([a + b for a, b in pairs])
        parts = encode_batch([p for pair in pairs for p in pair])
        if all(list(w) == list(parts[2 * i]) + list(parts[2 * i + 1]) for i, w in enumerate(whole)):
            return rule
    return None


def split_segments(text: str, rule: str) -> list[str]:
    """`text` cut at its safe cuts under `rule` ("runs" or "single"); "".join(result) == text."""
    lines = text.split("\n")
    out: list[str] = []
    start = 0  # index in `lines` where the current segment begins
    for i in range(len(lines) - 1):
        after = lines[i + 1]
        if not after or after[0].isspace():
            continue
        # the newline run ending before lines[i + 1] starts after the last non-empty line
        j = i
        while j >= start and not lines[j]:
            j -= 1
        run = i - j + 1  # newlines in the run
        if j < start or lines[j][-1].isspace() or (rule == "single" and run > 1):
            continue
        out.append("\n".join(lines[start:i + 1]) + "\n")
        start = i + 1
    out.append("\n".join(lines[start:]))
    return [s for s in out if s]


def _frozen(ids: Sequence[int]) -> np.ndarray:
    """int32 ids as a read-only array (a cached segment may be handed out as it is)."""
    out = np.asarray(ids, np.int32)
    out.setflags(write=False)
    return out


class SegmentCache:
    """Encodes texts segment by segment through a cache (see the module docstring).

    encode_batch: the tokenizer's whole-text batch encode. rule: a cut rule from
    `probe_cut_rule` (None: every call goes straight to `encode_batch`)."""

    def __init__(self, encode_batch: EncodeBatch, rule: str | None, capacity_tokens: int = 1 << 24) -> None:
        if rule is not None and rule not in CUT_RULES:
            raise ValueError(f"cut rule must be one of {CUT_RULES} or None, got {rule!r}")
        self._encode_batch = encode_batch
        self.rule = rule
        self.capacity_tokens = int(capacity_tokens)
        self._ids: dict[str, np.ndarray] = {}
        self._tokens = 0
        self.hits = self.misses = 0

    def __call__(self, texts: Sequence[str]) -> list[np.ndarray]:
        """int32 ids of each text, equal to `encode_batch(texts)`."""
        texts = list(texts)
        if self.rule is None or not texts:
            return [np.asarray(ids, np.int32) for ids in self._encode_batch(texts)]
        pieces = [split_segments(t, self.rule) for t in texts]
        new = list(dict.fromkeys(s for segs in pieces for s in segs if s not in self._ids))
        self.misses += len(new)
        self.hits += sum(map(len, pieces)) - len(new)
        fresh = dict(zip(new, map(_frozen, self._encode_batch(new)))) if new else {}
        out = []
        for segs in pieces:
            arrays = [fresh[s] if s in fresh else self._ids[s] for s in segs]
            out.append(np.concatenate(arrays) if len(arrays) > 1 else arrays[0] if arrays else np.zeros(0, np.int32))
        added = sum(a.size for a in fresh.values())
        if self._tokens + added > self.capacity_tokens:
            self._ids, self._tokens = {}, 0
        self._ids.update(fresh)
        self._tokens += added
        return out
