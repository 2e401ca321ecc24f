"""Static shapes for host arrays: the buckets a length or a row count is padded up to, and the
id that marks "no recorded expert" in routing arrays (the fill of routing padding).

A leaf: it imports nothing of jmarl, so that the models, the samplers, the plans and the
learner all pad the same way without importing each other.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Sequence-length buckets: a batch is padded up to the smallest bucket that holds it, so that
# varied batches reuse a handful of compiled programs instead of recompiling per length.
DEFAULT_LENGTH_BUCKETS: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): batch sizes are rounded to these so that
    varied batches reuse a few compiled programs."""
    return 1 << max(0, (n - 1).bit_length())


def row_bucket(n: int, multiple: int = 1) -> int:
    """Rows of a sampler call rounded up to a bucket: powers of two up to 8, then four buckets per
    doubling (m x 2^k, m in 4..7: 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ...), so a call decodes
    at most 1.25x its rows (a power of two: up to 2x) and at most four compiled programs serve
    each doubling of the rows. Rows that are a multiple of a power of two K (a group of K
    completions per prompt) stay one. `multiple` (a power of two, e.g. the devices the rows are
    split over): the smallest such bucket that it divides."""
    n = max(int(n), 1)
    while True:
        if n <= 8:
            b = next_pow2(n)
        else:
            step = 1 << ((n - 1).bit_length() - 3)
            b = -(-n // step) * step
        if b % max(int(multiple), 1) == 0:
            return b
        n = b + 1


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS) -> int:
    """The smallest bucket >= length (a multiple of the largest bucket beyond it)."""
    for b in sorted(buckets):
        if length <= b:
            return int(b)
    top = max(buckets)
    return int(-(-length // top) * top)


def no_route(dtype: object) -> int:
    """The routing id that marks "no recorded expert" in a `dtype` array (routing replay): the
    dtype's largest value, never an expert id (`jmarl.models.moe.routing_dtype`)."""
    return int(np.iinfo(np.dtype(dtype)).max)


def as_routing(arrays: Sequence[np.ndarray | None], shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Routing id arrays [..., W_i] (None: nothing recorded, of leading shape shapes[i]) in one
    dtype (the widest) and width (the widest W), each marker (`no_route`) kept a marker and the
    new columns filled with it."""
    given = [a for a in arrays if a is not None]
    dtype = max((a.dtype for a in given), key=lambda d: d.itemsize)
    width = max(a.shape[-1] for a in given)
    out = []
    for a, shape in zip(arrays, shapes):
        wide = np.full(tuple(shape) + (width,), no_route(dtype), dtype)
        if a is not None:
            wide[..., :a.shape[-1]] = np.where(a == no_route(a.dtype), no_route(dtype), a)
        out.append(wide)
    return out
