"""Helpers shared by the task envs: frozen maps, memory blocks, held-out splits, text clipping.

Held-out split: an item (a puzzle, a problem, a paragraph) is an evaluation item when the
blake2b hash of its canonical text is 0 mod 10. Training seeds only ever produce training
items and evaluation seeds only evaluation items (generation with rejection), so no held-out
item can occur in training, whatever the seeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from jmarl.envs.base import is_eval_seed
from jmarl.errors import JmarlError

T = TypeVar("T")

# Longest model text any env parses (characters). Longer texts keep their head and tail.
MAX_TEXT_CHARS = 16_000
# Rejection sampling gives up after this many draws (a generator bug, not bad luck: the
# expected number of draws is 1.1 for training items and 10 for evaluation items).
MAX_DRAWS = 10_000


class FrozenMap(Mapping):
    """An immutable, hashable mapping (used for per-agent fields of frozen states)."""

    __slots__ = ("_items", "_hash")

    def __init__(self, items: Mapping | None = None) -> None:
        pairs = tuple(sorted(dict(items or {}).items(), key=lambda kv: repr(kv[0])))
        object.__setattr__(self, "_items", dict(pairs))
        object.__setattr__(self, "_hash", None)

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(tuple(self._items.items())))
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenMap is immutable")

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"

    def __reduce__(self):
        return (FrozenMap, (dict(self._items),))

    def set(self, key: Any, value: Any) -> "FrozenMap":
        """A copy with `key` set to `value`."""
        return FrozenMap({**self._items, key: value})


def freeze_memory(value: Any) -> FrozenMap:
    """Normalises a `memory_context` value ({agent: strings}) to a FrozenMap of string tuples."""
    if isinstance(value, FrozenMap):
        return value
    if not isinstance(value, Mapping):
        return FrozenMap()
    return FrozenMap({str(k): tuple(str(e) for e in (v if isinstance(v, (list, tuple)) else (v,)))
                      for k, v in value.items()})


def memory_block(state: Any, agent: str) -> str:
    """The prompt block listing the memory entries the workflow put in `state` for `agent`.

    A workflow injects entries with `dataclasses.replace(state, memory_context={agent: (...)})`;
    the state's `__post_init__` freezes the mapping. Returns "" when there are none.
    """
    memory = getattr(state, "memory_context", None) or {}
    entries = memory.get(agent, ()) if isinstance(memory, Mapping) else ()
    if not entries:
        return ""
    lines = "\n".join(f"- {e}" for e in entries)
    return f"Relevant memory:\n{lines}\n"


def with_memory(state: Any, agent: str, prompt: str) -> str:
    """`prompt` with `agent`'s memory block (`memory_block`) ahead of it, or `prompt` alone.

    The memory goes first because the sampler cuts a prompt longer than its budget
    (sampling.max_prompt_len) from the front: the retrieved entries are lost before the task.
    """
    memory = memory_block(state, agent)
    return f"{memory}\n{prompt}" if memory else prompt


def clip_text(text: Any, limit: int = MAX_TEXT_CHARS) -> str:
    """`text` as a str of at most `limit` characters (head and tail kept); never raises."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        try:
            text = str(text)
        except Exception:  # noqa: BLE001 - hostile __str__
            text = ""
    if len(text) > limit:
        half = limit // 2
        text = text[:half] + "\n" + text[-half:]
    return text


def content_hash(content: str) -> int:
    """A stable (process-independent) 64-bit hash of an item's canonical text."""
    return int.from_bytes(hashlib.blake2b(content.encode("utf-8"), digest_size=8).digest(), "big")


def is_eval_item(content: str) -> bool:
    """True if the item with canonical text `content` belongs to the held-out split."""
    return content_hash(content) % 10 == 0


def draw_split_item(name: str, seed: int, draw: Callable[[random.Random], T],
                    key: Callable[[T], str]) -> T:
    """Draws items from a `seed`-keyed RNG until one falls in `seed`'s split.

    Args:
      name: the env's name (keys the RNG so envs do not share streams).
      seed: the episode seed; `is_eval_seed(seed)` picks the split.
      draw: makes one candidate item from the RNG.
      key: the item's canonical text (what is hashed).
    """
    rng = random.Random(f"{name}:{seed}")
    want_eval = is_eval_seed(seed)
    for _ in range(MAX_DRAWS):
        item = draw(rng)
        if is_eval_item(key(item)) == want_eval:
            return item
    raise RuntimeError(f"{name}: no item of the requested split after {MAX_DRAWS} draws")


def split_items(items: list[T], key: Callable[[T], str]) -> tuple[list[T], list[T]]:
    """Splits loaded items into (train, eval) by the content hash of `key(item)`."""
    train, held = [], []
    for item in items:
        (held if is_eval_item(key(item)) else train).append(item)
    return train, held


def file_stamp(path: str, env: str) -> tuple[str, float, int]:
    """(absolute path, mtime, size) of a data file: the cache key of its parsed contents."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise JmarlError(f"{env}: data file {path!r} not found; pass path= an existing JSONL file")
    st = os.stat(path)
    return os.path.abspath(path), st.st_mtime, st.st_size


def read_jsonl(path: str, env: str) -> Iterator[tuple[str, dict]]:
    """("file:line", object) for every non-blank line of a JSONL file.

    Raises JmarlError naming the file (and line) when it cannot be read, a line is not JSON,
    or a line is not a JSON object.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise JmarlError(f"{env}: cannot read {path!r} ({e.strerror}); pass path= an existing JSONL file") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise JmarlError(f"{env}: {where} is not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise JmarlError(f"{env}: {where} is not a JSON object")
        yield where, record
