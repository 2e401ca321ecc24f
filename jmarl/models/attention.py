"""Attention: one entry point, exact, and never O(T x S) in memory for long sequences.

Every attention of the model over rows (scoring, prefill) goes through `attention`, the packed
learner's through `packed_attention`. The layout of `attention` is fixed: queries q [B, T, H, hd],
keys/values k, v [B, S, KV, hd] (grouped-query: H a multiple of KV), rows RIGHT-padded, so the
valid keys of row b are the slots s < lengths[b] (`jmarl.models.model` compacts any padding to
this layout first). With `causal`, query t also sees only keys s <= t. Scores, softmax and
log-sum-exps are float32.

Forms (`impl`, `ModelConfig.attention`):

    dense      [B, KV, H/KV, T, S] float32 scores in one piece: fastest for short sequences,
               O(T x S) memory ("xla").
    blockwise  online softmax over [block_q, block_k] tiles in plain JAX with its own
               FlashAttention-2 backward (`jax.custom_vjp`): memory O(B x H x block_q x block_k)
               besides the inputs, outputs and one float32 [B, T, H] log-sum-exp, forward and
               gradient. Key blocks past the longest row and, with `causal`, above the diagonal
               are skipped. Runs everywhere.
    cudnn      cuDNN flash attention through `jax.nn.dot_product_attention(implementation=
               "cudnn")` (right padding as sequence lengths), bf16/f16 and head_dim <= 128.
    splash     the Pallas splash-attention kernel of `jax.experimental.pallas.ops.tpu`
               (padding as segment ids), sequence lengths a multiple of 128.
    pallas     packed rows only: jmarl's fused Pallas kernel for CUDA GPUs
               (`jmarl.models.packed_pallas`, sliding windows included; blockwise on other
               platforms, or for a head_dim it refuses); `attention` takes it as auto.
    auto       dense when the scores are small (B x H x T x S <= DENSE_MAX_SCORES), otherwise
               chosen per platform WHEN THE PROGRAM IS LOWERED (`jax.lax.platform_dependent`):
               cudnn on CUDA GPUs, splash on TPU, blockwise elsewhere, and blockwise for any
               shape or dtype a kernel refuses. A program exported for another platform carries
               that platform's form.

The two kernel forms, and what each takes, are `jmarl.models.attention_kernels`.

Exactness: every form computes the same softmax(q k^T / sqrt(hd)) v over the same keys; they
differ only in float rounding (blockwise accumulates in float32 and normalises at the end).
A query with no valid key (a padding row) gets a finite average instead of NaN.

Sliding windows (Gemma 3's local layers): `window` W (an int or a traced int32 scalar: a
stacked layer scan passes NO_WINDOW on its full-attention layers) restricts query t to keys
t - W < s <= t (`attention`; slots are positions in the right-padded layout) or to keys less
than W positions before it (`packed_attention`, by the `positions` of each token). With a window
only the dense and blockwise forms run, and on packed rows the fused kernel (`pallas`), which
masks by position; the library kernels are not given the window. Blockwise skips the key tiles
wholly before a query tile's window as well as those above its diagonal.

Partial attentions (`partial_attention`: the dense or blockwise form with each query's
log-sum-exp) over disjoint key sets merge exactly into the attention over their union
(`merge_attentions`); with `rows` a query row reads its keys from a shared row of the key
array, block by block (the shared-prefix layout of `benchmarks.shared_prefix_model` reads a
group's prompt this way, without a copy per row).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jmarl.errors import JmarlError
from jmarl.models import packed_pallas, packed_split
from jmarl.models.attention_kernels import cudnn_or, splash_or
from jmarl.models.packed_tiles import packed_tiles
from jmarl.models.splash_kernel import packed_splash_or


IMPLS: tuple[str, ...] = ("auto", "xla", "dense", "cudnn", "splash", "blockwise", "pallas")
# auto: dense when B * H * T * S float32 scores take at most 256 MiB
DENSE_MAX_SCORES = 1 << 26
BLOCK_Q = 512
BLOCK_K = 512
# packed rows: auto takes the dense form up to this width, else tiles of PACKED_BLOCK, small
# enough that the tiles outside a segment (skipped) are most of a wide row's
# (`python -m benchmarks.packing`: on the quickstart's batches, 64 ran the update 1.2x faster
# than 128 and 1.15x faster than 32)
PACKED_DENSE_MAX = 256
PACKED_BLOCK = 64
# The window of a layer that has none, when windows are traced per layer: no key is that far back
# (and q_idx - NO_WINDOW, (j + 1) * bk + NO_WINDOW stay within int32).
NO_WINDOW = 1 << 30
# Large negative score for masked keys: finite, so a row with no valid key averages instead of NaN.
_MASKED = -0.7 * float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------------- entry points
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    causal: bool,
    impl: str = "auto",
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    window: int | jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(hd)) v over the valid keys. q [B,T,H,hd], k/v [B,S,KV,hd],
    lengths int[B] (keys s < lengths[b] are valid; rows right-padded) -> [B,T,H,hd] in q's dtype.
    causal: query t sees keys s <= t as well (queries and keys aligned at slot 0).
    window: query t sees only keys s > t - window (a sliding window of `window` keys, t's own
    included, with causal); an int or a traced int32 scalar; None: no window (dense or
    blockwise only when given, see the module docstring)."""
    _check(q, k, v, impl)
    impl = "auto" if impl == "pallas" else impl  # the fused kernel is the packed rows'
    lengths = jnp.maximum(lengths.astype(jnp.int32), 1)
    if window is not None:
        window = jnp.asarray(window, jnp.int32)
        if form_for(q.shape, k.shape, impl) == "dense":
            return _dense(q, k, v, lengths, None, causal, window)[0]
        return _blockwise(q, k, v, lengths, None, causal, block_q, block_k, window)[0]
    form = _static_form(q, k, impl)
    if form == "dense":
        return _dense(q, k, v, lengths, None, causal)[0]
    if form == "blockwise":
        return _blockwise(q, k, v, lengths, None, causal, block_q, block_k)[0]
    blockwise = functools.partial(_blockwise_out, causal=causal, block_q=block_q, block_k=block_k)
    if form == "cudnn":
        return cudnn_or(blockwise, q, k, v, lengths, causal)
    if form == "splash":
        return splash_or(blockwise, q, k, v, lengths, causal)
    # auto on long sequences: the platform's kernel, chosen when the program is lowered
    return jax.lax.platform_dependent(
        q, k, v, lengths,
        cuda=functools.partial(cudnn_or, blockwise, causal=causal),
        tpu=functools.partial(splash_or, blockwise, causal=causal),
        default=blockwise,
    )


def partial_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    *,
    causal: bool,
    form: str,
    rows: jax.Array | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> tuple[jax.Array, jax.Array]:
    """(out [B,T,H,hd] in q's dtype, lse float32 [B,T,H]): `attention` by the form "dense" or
    "blockwise" over the keys s < lengths[b] (taken as given: a row with none has only masked
    scores), with each query's log-sum-exp of its scores, so that attentions over disjoint key
    sets merge into one softmax (`merge_attentions`). rows int[B]: k/v [U,S,KV,hd] are shared,
    query row b reading key row rows[b]; the blockwise form reads them block by block (no
    [B, S] copy is made or kept for the backward pass) and their gradients sum over the rows
    that read them."""
    if form not in ("dense", "blockwise"):
        raise JmarlError(f"partial_attention: form must be 'dense' or 'blockwise', got {form!r}")
    _check(q, k, v, form)
    if form == "dense":
        return _dense(q, k, v, lengths, rows, causal)
    return _blockwise(q, k, v, lengths, rows, causal, block_q, block_k)


def packed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment: jax.Array,
    branch: jax.Array,
    *,
    impl: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    window: int | jax.Array | None = None,
    positions: jax.Array | None = None,
    kernel: packed_split.PartKernel | None = None,
) -> jax.Array:
    """Attention inside packed rows. q [R,T,H,hd], k/v [R,T,KV,hd] (one slot per token, keys and
    queries aligned); segment int[R,T]: 0 = padding, else the id of a contiguous run of slots
    (a prompt followed by its continuations); branch int[R,T]: 0 = the segment's shared prompt,
    b > 0 = its b-th continuation. Query t sees key s iff s <= t, both lie in the same non-zero
    segment, and s is on branch 0 or on t's branch: each continuation attends to its prompt
    and to itself, never to its siblings. -> [R,T,H,hd] in q's dtype; a padding query gets a
    finite average. Forms: dense when the scores are small (or impl dense/xla), otherwise the
    blockwise kernel, which skips every tile outside a segment and above the diagonal; on TPU
    (auto, chosen when lowered; traced where `traces_tpu_route`) and with impl "splash": the split on the splash kernels
    (`jmarl.models.splash_kernel`; head_dim a multiple of 64, else blockwise), a layer whose
    window is shorter than the row on blockwise; the split gives a padding query 0.
    window (with positions int[R,T], each token's position in its own sequence): query t also
    sees only keys less than `window` positions before its own (positions[t] - positions[s] <
    window), a sliding window over the sequence the continuation belongs to.
    impl "split" (opt-in, this argument only; not in IMPLS): the same softmax as two
    segment-id attentions merged by their log-sum-exps (`jmarl.models.packed_split`), each on
    `kernel` (a `packed_split.PartKernel`; None: the dense reference, merged by autodiff)."""
    _check(q, k, v, "dense" if impl == "split" else impl)
    if q.shape[1] != k.shape[1]:
        raise JmarlError(f"packed attention takes aligned queries and keys; got {q.shape} and {k.shape}")
    segment, branch = jnp.asarray(segment, jnp.int32), jnp.asarray(branch, jnp.int32)
    r, t, h, _ = q.shape
    windowed = window is not None
    if windowed and positions is None:
        raise JmarlError("packed attention with a sliding window needs the tokens' positions")
    # the window's extra meta: each slot's position and the window (last in meta; see _Packed)
    extra = (jnp.asarray(positions, jnp.int32), jnp.asarray(window, jnp.int32)) if windowed else ()
    if impl == "split":
        return packed_split.split_attention(q, k, v, segment, branch, positions=extra[0] if windowed else None,
                                            window=extra[1] if windowed else None, kernel=kernel).astype(q.dtype)
    if impl in ("xla", "dense") or (impl == "auto" and t <= PACKED_DENSE_MAX and r * h * t * t <= DENSE_MAX_SCORES):
        idx = jnp.arange(t)
        allowed = _Packed(windowed).allowed((segment, branch) + extra, idx, idx)
        return _dense_masked(q, k, v, allowed)[0]
    blockwise = functools.partial(_packed_blockwise, extra=extra, block_q=block_q, block_k=block_k)
    if impl == "splash":
        return packed_splash_or(blockwise, q, k, v, segment, branch, extra=extra)
    if impl == "auto" and traces_tpu_route():  # the platform's form, chosen when the program is lowered
        return jax.lax.platform_dependent(q, k, v, segment, branch, default=blockwise,
                                          tpu=functools.partial(packed_splash_or, blockwise, extra=extra))
    if impl == "pallas" and packed_pallas.supports(q.shape[-1]):
        fused = functools.partial(packed_pallas.packed_flash, positions=positions if windowed else None,
                                  window=window if windowed else None)
        if packed_pallas.interpreting():  # tests: the kernels in the Pallas interpreter, any platform
            return fused(q, k, v, segment, branch, interpret=True)
        return jax.lax.platform_dependent(q, k, v, segment, branch, default=blockwise, cuda=fused)
    return blockwise(q, k, v, segment, branch)


_TPU_ROUTE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("packed_tpu_route", default=None)


def traces_tpu_route() -> bool:
    """Whether "auto" packed attention traces its TPU route (the splash split, chosen per
    platform when lowered): in a process whose backend is a TPU, or inside `lowering_for_tpu`.
    Elsewhere only the blockwise form is traced (tracing the splash kernels costs about a second
    per program that a CPU or GPU would never run)."""
    forced = _TPU_ROUTE.get()
    return forced if forced is not None else jax.default_backend() == "tpu"


@contextlib.contextmanager
def lowering_for_tpu() -> Iterator[None]:
    """Trace "auto" packed attention's TPU route here too: for `jax.export` of a program to a TPU
    from a process with another backend."""
    token = _TPU_ROUTE.set(True)
    try:
        yield
    finally:
        _TPU_ROUTE.reset(token)


def _packed_blockwise(q, k, v, segment, branch, *, extra: tuple, block_q: int | None, block_k: int | None
                      ) -> jax.Array:
    """`packed_attention`'s blockwise form (extra: () or the window's (positions, window))."""
    r, t, h, _ = q.shape
    windowed = bool(extra)
    bq, bk = min(block_q or PACKED_BLOCK, t), min(block_k or PACKED_BLOCK, t)
    tp, sp = -(-t // bq) * bq, -(-t // bk) * bk
    width = max(tp, sp)
    pad = lambda x, fill: jnp.pad(x, ((0, 0), (0, width - t)), constant_values=fill)  # noqa: E731
    segment, branch = pad(segment, 0), pad(branch, 0)
    qg = _grouped(q, k.shape[2])
    qg = jnp.pad(qg, ((0, 0), (0, tp - t), (0, 0), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, sp - t), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, sp - t), (0, 0), (0, 0)))
    meta = (segment, branch) + packed_tiles(segment, branch, bq, bk, tp // bq, sp // bk)
    if windowed:
        meta = meta + (pad(extra[0], 0), extra[1])
    out, _ = _flash(qg, k, v, meta, _Packed(windowed), bq, bk)
    return out[:, :t].reshape(r, t, h, -1).astype(q.dtype)


def form_for(q_shape: tuple[int, ...], k_shape: tuple[int, ...], impl: str) -> str:
    """The form `attention` uses for these shapes: dense / blockwise / cudnn / splash, or
    'platform' (auto on long sequences: chosen when the program is lowered)."""
    b, t, h, _ = q_shape
    s = k_shape[1]
    if impl in ("xla", "dense"):
        return "dense"
    if impl == "auto":
        return "dense" if b * h * t * s <= DENSE_MAX_SCORES else "platform"
    return impl


def _static_form(q: jax.Array, k: jax.Array, impl: str) -> str:
    form = form_for(q.shape, k.shape, impl)
    return "auto" if form == "platform" else form


def _check(q: jax.Array, k: jax.Array, v: jax.Array, impl: str) -> None:
    if impl not in IMPLS:
        raise JmarlError(f"model.attention must be one of {', '.join(IMPLS)}, got {impl!r}")
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
        raise JmarlError(f"attention expects q [B,T,H,hd] and k/v [B,S,KV,hd] with KV dividing H; got {q.shape}, {k.shape}, {v.shape}")


def merge_attentions(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Two attentions over disjoint key sets (out [B,T,H,hd], lse [B,T,H]; `partial_attention`)
    -> the attention over their union, float32 [B,T,H,hd]. A part whose lse is -inf weighs 0."""
    (oa, la), (ob, lb) = a, b
    lse = jnp.logaddexp(la, lb)
    wa, wb = jnp.exp(la - lse)[..., None], jnp.exp(lb - lse)[..., None]
    return oa.astype(jnp.float32) * wa + ob.astype(jnp.float32) * wb


def _allowed(q_idx: jax.Array, k_idx: jax.Array, lengths: jax.Array, causal: bool,
             window: jax.Array | None = None) -> jax.Array:
    """bool[B, 1, 1, Tq, Sk]: key slot k_idx valid for row b and, with causal, <= query slot;
    with a window, also > query slot - window."""
    ok = k_idx[None, None, :] < lengths[:, None, None]  # [B, 1, Sk]
    if causal:
        ok = ok & (k_idx[None, None, :] <= q_idx[None, :, None])  # [B, Tq, Sk]
    if window is not None:
        ok = ok & (k_idx[None, None, :] > q_idx[None, :, None] - window)  # [B, Tq, Sk]
    return ok[:, None, None]


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """q [B,T,H,hd] -> scaled [B,T,KV,H/KV,hd] (the 1/sqrt(hd) goes on the queries)."""
    b, t, h, hd = q.shape
    return (q * jnp.asarray(hd**-0.5, q.dtype)).reshape(b, t, kv_heads, h // kv_heads, hd)


# ---------------------------------------------------------------------------------- dense
def _dense(q, k, v, lengths, rows, causal, window=None):
    """(out [B,T,H,hd] in q's dtype, lse float32 [B,T,H]); rows: k/v [U,..] read per row."""
    if rows is not None:
        k, v = k[rows], v[rows]
    return _dense_masked(q, k, v, _allowed(jnp.arange(q.shape[1]), jnp.arange(k.shape[1]), lengths, causal, window))


def _dense_masked(q, k, v, allowed):
    """(out [B,T,H,hd] in q's dtype, lse float32 [B,T,H]) over the keys `allowed`
    (bool [B,1,1,T,S])."""
    b, t, h, hd = q.shape
    kv = k.shape[2]
    qg = _grouped(q, kv).astype(k.dtype)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(allowed, scores, _MASKED)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [B,KV,G,T]
    probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, hd)
    return out.astype(q.dtype), lse.transpose(0, 3, 1, 2).reshape(b, t, h)


# ---------------------------------------------------------------------------------- blockwise
def _blockwise_out(q, k, v, lengths, *, causal, block_q, block_k):
    return _blockwise(q, k, v, lengths, None, causal, block_q, block_k)[0]


def _blockwise(q, k, v, lengths, rows, causal, block_q, block_k, window=None):
    """(out [B,T,H,hd], lse float32 [B,T,H]) by the blockwise kernel; pads T and S to whole
    blocks (padded keys lie past every length; padded queries are cut off). window: a traced
    int32 scalar (see `attention`), or None."""
    b, t, h, hd = q.shape
    s = k.shape[1]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    qg = _grouped(q, k.shape[2])
    if tp != t:
        qg = jnp.pad(qg, ((0, 0), (0, tp - t), (0, 0), (0, 0), (0, 0)))
    if sp != s:
        k = jnp.pad(k, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    rows_arg = jnp.zeros((0,), jnp.int32) if rows is None else rows
    meta = (lengths, rows_arg) if window is None else (lengths, rows_arg, window)
    out, lse = _flash(qg, k, v, meta, _RightPadded(causal, window is not None), bq, bk)
    out = out[:, :t].reshape(b, t, h, hd).astype(q.dtype)
    lse = lse[..., :t].transpose(0, 3, 1, 2).reshape(b, t, h)
    return out, lse


def _num_key_blocks(lengths: jax.Array, nk: int, bk: int) -> jax.Array:
    """Key blocks that hold any valid key of any row (at least 1)."""
    return jnp.clip((jnp.max(lengths) + bk - 1) // bk, 1, nk)


def _causal_key_blocks(i: jax.Array, bq: int, bk: int) -> jax.Array:
    """Key blocks at or below the diagonal of query block i."""
    return ((i + 1) * bq - 1) // bk + 1


class _Mask:
    """Which keys a query sees, and which tiles can hold any: the part of the blockwise kernel
    that differs between layouts. `meta` is a tuple of int arrays (traced), the rest static.
    may_skip_all: whether a query tile may visit no key tile at all (then its queries, which
    have no valid key, get 0 and a log-sum-exp of _MASKED instead of 0 / 0)."""

    may_skip_all = False

    def allowed(self, meta: tuple, q_idx: jax.Array, k_idx: jax.Array) -> jax.Array:
        """bool[B, 1, 1, Tq, Sk] for query slots q_idx [Tq] and key slots k_idx [Sk]."""
        raise NotImplementedError

    def key_ranges(self, meta: tuple, i: jax.Array, bq: int, bk: int, nk: int) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """Disjoint [start, stop) ranges of the key blocks query block i may see, in order."""
        raise NotImplementedError

    def query_blocks(self, meta: tuple, j: jax.Array, bq: int, bk: int, nq: int, nk: int) -> tuple[jax.Array, jax.Array]:
        """[first, last): the query blocks that may see key block j."""
        raise NotImplementedError

    def kv_block(self, meta: tuple, x: jax.Array, j: jax.Array, bk: int) -> jax.Array:
        """Key block j of x [Bk,S,KV,hd] for every query row: [B,bk,KV,hd]."""
        return jax.lax.dynamic_slice_in_dim(x, j * bk, bk, axis=1)

    def key_grad(self, meta: tuple, g: jax.Array, num_rows: int) -> jax.Array:
        """A key block's gradient for every query row [B,bk,KV,hd] -> for the keys' rows."""
        return g


@dataclass(frozen=True)
class _RightPadded(_Mask):
    """meta = (lengths int[B], rows int[B] or int[0]) (+ window int32[] when `windowed`): keys
    s < lengths[b] are valid (and, with causal, s <= t; windowed, s > t - window); non-empty
    rows read the keys of row rows[b] of a shared key array (`partial_attention`), whose
    gradients then sum over the rows that read them. Windowed, the key tiles wholly before a
    query tile's window (and the query tiles wholly past a key tile's) are skipped."""

    causal: bool
    windowed: bool = False

    @property
    def may_skip_all(self) -> bool:
        """Windowed, a query tile past the longest row may lie wholly after its keys' windows."""
        return self.windowed

    def allowed(self, meta, q_idx, k_idx):
        return _allowed(q_idx, k_idx, meta[0], self.causal, meta[2] if self.windowed else None)

    def key_ranges(self, meta, i, bq, bk, nk):
        n_valid = _num_key_blocks(meta[0], nk, bk)
        stop = jnp.minimum(n_valid, _causal_key_blocks(i, bq, bk)) if self.causal else n_valid
        if not self.windowed:
            return ((0, stop),)
        start = jnp.maximum(i * bq - meta[2] + 1, 0) // bk  # the tile of the first query's first key
        return ((jnp.minimum(start, stop), stop),)

    def query_blocks(self, meta, j, bq, bk, nq, nk):
        first = (j * bk) // bq if self.causal else 0
        last = jnp.where(j < _num_key_blocks(meta[0], nk, bk), nq, first)
        if not self.windowed:
            return first, last
        # the last query that sees key block j's last key is (j + 1) * bk - 1 + window - 1
        reach = ((j + 1) * bk + meta[2] - 2) // bq + 1
        return first, jnp.maximum(first, jnp.minimum(last, reach))

    def kv_block(self, meta, x, j, bk):
        block = super().kv_block(meta, x, j, bk)
        rows = meta[1]
        return block[rows] if rows.shape[0] else block

    def key_grad(self, meta, g, num_rows):
        rows = meta[1]
        if not rows.shape[0]:
            return g
        return jnp.zeros((num_rows,) + g.shape[1:], g.dtype).at[rows].add(g)


@dataclass(frozen=True)
class _Packed(_Mask):
    """meta = (segment, branch) int[B, L] (L >= the padded query and key lengths) and the tile
    bounds of `packed_tiles`: query t sees key s iff s <= t, both in the same non-zero segment,
    and key s is on branch 0 (the segment's shared prompt) or on the query's own branch.
    windowed: meta ends with (positions int[B, L], window int32[]) and query t also needs
    positions[t] - positions[s] < window (the tiles visited are the same)."""

    windowed: bool = False

    def allowed(self, meta, q_idx, k_idx):
        segment, branch = meta[0], meta[1]
        sq, sk = segment[:, q_idx], segment[:, k_idx]
        bq_, bk_ = branch[:, q_idx], branch[:, k_idx]
        ok = (sq[:, :, None] == sk[:, None, :]) & (sk > 0)[:, None, :]
        ok = ok & ((bk_ == 0)[:, None, :] | (bq_[:, :, None] == bk_[:, None, :]))
        ok = ok & (k_idx[None, None, :] <= q_idx[None, :, None])
        if self.windowed:
            positions, window = meta[-2], meta[-1]
            ok = ok & (positions[:, q_idx][:, :, None] - positions[:, k_idx][:, None, :] < window)
        return ok[:, None, None]

    def key_ranges(self, meta, i, bq, bk, nk):
        prompt_lo, prompt_hi, own_lo = meta[2][i], meta[3][i], meta[4][i]
        stop = jnp.minimum(nk, _causal_key_blocks(i, bq, bk))
        return (prompt_lo, jnp.minimum(jnp.minimum(prompt_hi, own_lo), stop)), (own_lo, stop)

    def query_blocks(self, meta, j, bq, bk, nq, nk):
        first = (j * bk) // bq
        return first, jnp.maximum(first, meta[5][j])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(qg, k, v, meta, mask, bq, bk):
    """qg [B,Tp,KV,G,hd] (scaled), k/v [Bk,Sp,KV,hd] -> (out f32 [B,Tp,KV,G,hd], lse f32 [B,KV,G,Tp])."""
    return _flash_forward(qg, k, v, meta, mask, bq, bk)


def _flash_forward(qg, k, v, meta, mask, bq, bk):
    b, tp, kvh, g, hd = qg.shape
    nq, nk = tp // bq, k.shape[1] // bk

    def query_block(i):
        qi = jax.lax.dynamic_slice_in_dim(qg, i * bq, bq, axis=1).astype(k.dtype)
        q_idx = i * bq + jnp.arange(bq)

        def body(j, carry):
            m, l, acc = carry
            kj, vj = mask.kv_block(meta, k, j, bk), mask.kv_block(meta, v, j, bk)
            s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32)
            s = jnp.where(mask.allowed(meta, q_idx, j * bk + jnp.arange(bk)), s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            scale = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            l = l * scale + p.sum(axis=-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
            return m_new, l, acc * scale[..., None] + pv

        init = (
            jnp.full((b, kvh, g, bq), _MASKED, jnp.float32),
            jnp.zeros((b, kvh, g, bq), jnp.float32),
            jnp.zeros((b, kvh, g, bq, hd), jnp.float32),
        )
        carry = init
        for start, stop in mask.key_ranges(meta, i, bq, bk, nk):
            carry = jax.lax.fori_loop(start, stop, body, carry)
        m, l, acc = carry
        if mask.may_skip_all:  # l = 0 where no tile was visited (no valid key): out 0, lse _MASKED
            some = l > 0
            safe = jnp.where(some, l, 1.0)
            return acc / safe[..., None], jnp.where(some, m + jnp.log(safe), _MASKED)
        return acc / l[..., None], m + jnp.log(l)

    out, lse = jax.lax.map(query_block, jnp.arange(nq))  # [nq,B,KV,G,bq,hd], [nq,B,KV,G,bq]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, tp, kvh, g, hd)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, kvh, g, tp)
    return out, lse


def _flash_fwd(qg, k, v, meta, mask, bq, bk):
    out, lse = _flash_forward(qg, k, v, meta, mask, bq, bk)
    return (out, lse), (qg, k, v, meta, out, lse)


def _flash_bwd(mask, bq, bk, residuals, cotangents):
    """FlashAttention-2's backward: per key block j, over the query blocks that saw it,
    recompute p = exp(s - lse), then dv_j += p^T do, ds = p (do v^T - D + dlse), dk_j += ds^T q,
    dq += ds k. D = rowsum(do * out). Memory: one [B,KV,G,bq,bk] tile and a float32 dq."""
    qg, k, v, meta, out, lse = residuals
    d_out, d_lse = cotangents
    b, tp, kvh, g, hd = qg.shape
    nq, nk = tp // bq, k.shape[1] // bk
    d_out = d_out.astype(jnp.float32)
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out, out) - d_lse  # [B,KV,G,Tp]
    qc = qg.astype(k.dtype)

    def key_block(dq, j):
        kj, vj = mask.kv_block(meta, k, j, bk), mask.kv_block(meta, v, j, bk)
        k_idx = j * bk + jnp.arange(bk)
        first, last = mask.query_blocks(meta, j, bq, bk, nq, nk)

        def body(i, carry):
            dq, dk_j, dv_j = carry
            qi = jax.lax.dynamic_slice_in_dim(qc, i * bq, bq, axis=1)
            doi = jax.lax.dynamic_slice_in_dim(d_out, i * bq, bq, axis=1)
            lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
            delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
            s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32)
            s = jnp.where(mask.allowed(meta, i * bq + jnp.arange(bq), k_idx), s, _MASKED)
            p = jnp.exp(s - lse_i[..., None])
            dv_j = dv_j + jnp.einsum("bkgqs,bqkgd->bskd", p, doi)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj.astype(jnp.float32))
            ds = p * (dp - delta_i[..., None])
            dk_j = dk_j + jnp.einsum("bkgqs,bqkgd->bskd", ds, qi.astype(jnp.float32))
            dq_i = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj.astype(jnp.float32))
            dq = jax.lax.dynamic_update_slice_in_dim(
                dq, jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=1) + dq_i, i * bq, axis=1)
            return dq, dk_j, dv_j

        zeros = jnp.zeros((b, bk, kvh, hd), jnp.float32)
        dq, dk_j, dv_j = jax.lax.fori_loop(first, last, body, (dq, zeros, zeros))
        return dq, (mask.key_grad(meta, dk_j, k.shape[0]), mask.key_grad(meta, dv_j, k.shape[0]))

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qg.shape, jnp.float32), jnp.arange(nk))
    dk = dk.transpose(1, 0, 2, 3, 4).reshape(k.shape)
    dv = dv.transpose(1, 0, 2, 3, 4).reshape(v.shape)
    # the forward scaled the queries in qg already: dq is with respect to qg
    return dq.astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)
