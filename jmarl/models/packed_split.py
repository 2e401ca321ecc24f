"""Packed shared-prefix attention split into two standard attentions, merged exactly.

The learner packs each GRPO group as [prompt once, continuation 1, continuation 2, ...] in one
row (`jmarl.models.attention.packed_attention`): segment int[R,T] (0 = padding, else a run id)
and branch int[R,T] (0 = the segment's shared prompt, b > 0 = its b-th continuation). Query t
sees key s iff s <= t, both lie in the same non-zero segment, and s is on branch 0 or on t's
branch. That mask is not a segment-id mask, so no standard kernel takes it. It is, however, the
disjoint union of two masks that are (the prefix/suffix decomposition of Hydragen and cascade
attention):

    own part     causal attention inside each run of equal (segment, branch): segment ids =
                 one run id per run (`own_ids`), plus causal. A prompt query (branch 0) sees
                 all its keys here; a continuation query sees its own branch's keys.
    prompt part  each continuation query (branch > 0) to its segment's prompt keys (branch 0,
                 same segment), no causal mask: in this layout every prompt slot precedes its
                 continuations. Segment ids (`prompt_ids`): a key's is its segment on a prompt
                 slot and NO_KEY elsewhere, a query's its segment on a continuation slot and
                 NO_QUERY elsewhere (prompt and padding queries see no key here).

Each part returns (out [R,T,H,hd] float32, lse [R,T,H] float32); a query with no key in a part
gets out 0 and lse MASKED_LSE (finite, large negative), so that it weighs exp(MASKED_LSE - L)
= 0 in the merge. `merge_lse` combines the two into the softmax over the union: exact, and,
written in plain differentiable operations, with the right gradient with respect to both
parts' outputs and log-sum-exps (d o_i = w_i dO, d l_i = w_i <dO, o_i - O>, w_i = exp(l_i - L)).
Grouped-query attention (H a multiple of KV) and `packed_attention`'s sliding window
(positions int[R,T]: query t sees key s only if positions[t] - positions[s] < window) are kept;
the window applies in both parts.

Ids follow ONE rule, plain equality: query t sees key s iff q_ids[t] == k_ids[s] (and s <= t
when causal, and the window). Queries and keys that see nothing carry different "none" ids
(NO_QUERY, NO_KEY), so the ids can be handed as they are to a kernel that takes separate query
and key segment ids.

The parts' inner attention is pluggable. Two interfaces:

    part(q, k, v, q_ids, k_ids, *, causal, positions, window) -> (out, lse)
        differentiable in q, k, v THROUGH lse as well: `split_attention(..., part=...)` merges by
        autodiff. `reference_part` (dense float32 scores with the id mask, in XLA) is one; it
        runs everywhere, O(R x H x T^2) memory like `packed_attention`'s dense form.
    PartKernel(forward, backward)
        forward as above, with no gradient needed (what a flash kernel gives: out and its
        softmax statistics); backward(q, k, v, q_ids, k_ids, *, causal, positions, window, out,
        lse, d_out) -> (dq, dk, dv): FlashAttention-2's backward of that part, run with the
        MERGED out and lse (`split_attention(..., kernel=...)`, a `jax.custom_vjp`). With the
        merged statistics p = exp(s - L) is the probability under the whole softmax and
        D = rowsum(dO * O) its correction, so each part's backward yields exactly its keys'
        share of the gradient, and no lse cotangent is needed at all. `reference_kernel` is the
        dense XLA pair.

Kernels and log-sum-exps in JAX 0.10.2 (read from the installed source):

    jax.nn.dot_product_attention(..., return_residual=True) returns (out, lse [B,T,N]) for both
        implementations, but neither is differentiable in lse: "xla" casts it to the keys'
        dtype and wraps it in lax.stop_gradient; "cudnn" casts cuDNN's float32 softmax
        statistics to the output dtype (bf16 in training: too coarse to merge by) and its
        custom VJP (`_dot_product_attention_bwd_rule`) keeps only grad_output[0], so an lse
        cotangent is silently dropped: merging its results by autodiff gives WRONG gradients.
        The internal `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` returns
        the float32 statistics uncast and takes the packed (THD) layout: q_offsets/kv_offsets
        and q_seqlen/kv_seqlen [B, M] (M sequences per row). Both parts fit it: own part one
        sequence per (segment, branch) run with a causal (PADDING_CAUSAL) mask and the same
        offsets for queries and keys; prompt part one sequence per segment, queries = its
        continuations (contiguous) and keys = its prompt, different offsets, no mask. Its
        backward primitive (`_dot_product_attention_bwd_p_wrapper`) takes the forward's
        output and softmax statistics as inputs: bound with the merged ones it is a
        PartKernel.backward. Slots outside every sequence (prompt queries of the prompt part)
        must be set to out 0 / lse MASKED_LSE afterwards.
    Pallas splash attention (TPU, jax.experimental.pallas.ops.tpu.splash_attention):
        save_residuals=True returns (out, (logsumexp,)) (natural log), but its VJP raises
        NotImplementedError ("Higher-order AD not supported"). It takes separate query and key
        segment ids (`SegmentIds(q, kv)`), so own part = CausalMask + `own_ids`, prompt part =
        FullMask + `prompt_ids`; it requires no fully masked query row (the prompt part's
        prompt and padding queries are one: the kernel averages such a row's values, so
        `jmarl.models.splash_kernel`, the PartKernel on it, overwrites their results). `_splash_attention_bwd(..., res=(q, k, v,
        segment_ids, sinks, o, logsumexp, dq_mask_info, dkv_mask_info), do)` reads o and
        logsumexp from its residuals: called with the merged ones it is a PartKernel.backward.
    Pallas GPU `mha` (jax.experimental.pallas.ops.gpu.attention): return_residuals=True gives
        an lse in base 2 (m + log2 l of log2(e)-scaled logits; multiply by ln 2 to merge) and
        its backward then raises NotImplementedError; it takes ONE segment-id array for queries
        and keys, so only the own part fits it. `_mha_backward(..., res=(q, k, v, segment_ids,
        out, lse), do)` likewise takes out/lse as residuals.
    The blockwise kernel of `jmarl.models.attention` (`_flash`) does return a differentiable
        lse (its backward takes the lse cotangent) and could serve as a `part` with a
        segment-id mask; it is not wired here.

No kernel in this JAX differentiates through its lse, which is why `PartKernel` exists. With a
sliding window the own part's window is a plain left window on slots (positions are
consecutive inside a run: cuDNN's sliding_window_length, a splash LocalMask); the prompt part's
(positions[t] - positions[s] < window with queries after the prompt) is a window aligned to
each continuation's start, which neither kernel's built-in masks express: there the dense
reference, a custom splash mask function, or skipping the prompt part on layers whose window
is shorter than every continuation's distance to its prompt.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# "none" ids (plain equality: a NO_QUERY query sees no key, a NO_KEY key is seen by no query)
NO_QUERY = -1
NO_KEY = -2
# log-sum-exp of a query with no key in a part (finite: merges and gradients stay NaN-free)
MASKED_LSE = -0.7 * float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------------- ids
def own_ids(segment: jax.Array, branch: jax.Array) -> tuple[jax.Array, jax.Array]:
    """segment/branch int[R,T] -> (q_ids, k_ids) int[R,T] of the own part: one id >= 1 per
    contiguous run of equal (segment, branch) (a prompt, or one continuation), NO_QUERY /
    NO_KEY on padding (segment 0). Used with causal: a slot sees the slots of its run up to
    itself."""
    segment, branch = jnp.asarray(segment, jnp.int32), jnp.asarray(branch, jnp.int32)
    r = segment.shape[0]
    change = (segment[:, 1:] != segment[:, :-1]) | (branch[:, 1:] != branch[:, :-1])
    run = jnp.cumsum(jnp.concatenate([jnp.ones((r, 1), bool), change], axis=1), axis=1, dtype=jnp.int32)
    pad = segment == 0
    return jnp.where(pad, NO_QUERY, run), jnp.where(pad, NO_KEY, run)


def prompt_ids(segment: jax.Array, branch: jax.Array) -> tuple[jax.Array, jax.Array]:
    """segment/branch int[R,T] -> (q_ids, k_ids) int[R,T] of the prompt part: a continuation
    slot's (branch > 0) query id is its segment, a prompt slot's (branch 0) key id is its
    segment; NO_QUERY / NO_KEY elsewhere. Used without causal: every prompt slot of a segment
    precedes its continuations (the packed layout), and segment ids are distinct in a row."""
    segment, branch = jnp.asarray(segment, jnp.int32), jnp.asarray(branch, jnp.int32)
    real = segment > 0
    return (jnp.where(real & (branch > 0), segment, NO_QUERY),
            jnp.where(real & (branch == 0), segment, NO_KEY))


def part_mask(q_ids: jax.Array, k_ids: jax.Array, *, causal: bool, positions: jax.Array | None = None,
              window: int | jax.Array | None = None) -> jax.Array:
    """bool[R,T,S]: query t sees key s iff q_ids[t] == k_ids[s], and s <= t with causal (queries
    and keys aligned at slot 0), and positions[t] - positions[s] < window when a window is
    given (positions int[R,T], T == S)."""
    t, s = q_ids.shape[1], k_ids.shape[1]
    ok = q_ids[:, :, None] == k_ids[:, None, :]
    if causal:
        ok = ok & (jnp.arange(s)[None, None, :] <= jnp.arange(t)[None, :, None])
    if window is not None:
        if positions is None:
            raise ValueError("a sliding window needs the tokens' positions")
        positions = jnp.asarray(positions, jnp.int32)
        ok = ok & (positions[:, :, None] - positions[:, None, :] < jnp.asarray(window, jnp.int32))
    return ok


# ---------------------------------------------------------------------------------- reference part
def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [R,T,H,hd], k [R,S,KV,hd] -> float32 scores [R,KV,G,T,S] (scaled by 1/sqrt(hd))."""
    r, t, h, hd = q.shape
    kvh = k.shape[2]
    qg = (q.astype(jnp.float32) * hd**-0.5).reshape(r, t, kvh, h // kvh, hd)
    return jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32))


def reference_part(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array, k_ids: jax.Array, *,
                   causal: bool, positions: jax.Array | None = None,
                   window: int | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention over the keys `part_mask` allows, dense, in float32 XLA (runs everywhere).
    q [R,T,H,hd], k/v [R,S,KV,hd] (H a multiple of KV), q_ids int[R,T], k_ids int[R,S] ->
    (out [R,T,H,hd] float32, lse [R,T,H] float32), both differentiable (lse included). A
    query with no allowed key gets out 0 and lse MASKED_LSE."""
    r, t, h, hd = q.shape
    allowed = part_mask(q_ids, k_ids, causal=causal, positions=positions, window=window)[:, None, None]
    scores = jnp.where(allowed, _scores(q, k), MASKED_LSE)  # [R,KV,G,T,S]
    some = jnp.any(allowed, axis=-1)  # [R,1,1,T]
    lse = jnp.where(some, jax.nn.logsumexp(scores, axis=-1), MASKED_LSE)
    probs = jnp.where(allowed, jnp.exp(scores - lse[..., None]), 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32)).reshape(r, t, h, hd)
    return out, lse.transpose(0, 3, 1, 2).reshape(r, t, h)


def reference_part_backward(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: jax.Array, k_ids: jax.Array, *,
                            causal: bool, positions: jax.Array | None, window: int | jax.Array | None,
                            out: jax.Array, lse: jax.Array, d_out: jax.Array
                            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """FlashAttention-2's backward of one part given the out [R,T,H,hd] and lse [R,T,H] of the
    WHOLE softmax (the merged ones) and d_out [R,T,H,hd]: p = exp(s - lse) on the part's keys,
    dv = p^T dO, ds = p (dO v^T - rowsum(dO * out)), dq = ds k / sqrt(hd), dk = ds^T q /
    sqrt(hd) -> (dq, dk, dv) float32, this part's keys' share of the whole gradient."""
    r, t, h, hd = q.shape
    kvh = k.shape[2]
    g = h // kvh
    allowed = part_mask(q_ids, k_ids, causal=causal, positions=positions, window=window)[:, None, None]
    lse_g = lse.astype(jnp.float32).reshape(r, t, kvh, g).transpose(0, 2, 3, 1)  # [R,KV,G,T]
    probs = jnp.where(allowed, jnp.exp(_scores(q, k) - lse_g[..., None]), 0.0)
    do = d_out.astype(jnp.float32).reshape(r, t, kvh, g, hd)
    delta = jnp.einsum("btkgd,btkgd->bkgt", do, out.astype(jnp.float32).reshape(r, t, kvh, g, hd))
    dv = jnp.einsum("bkgts,btkgd->bskd", probs, do)
    dp = jnp.einsum("btkgd,bskd->bkgts", do, v.astype(jnp.float32))
    ds = probs * (dp - delta[..., None]) * hd**-0.5
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(jnp.float32)).reshape(r, t, h, hd)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, q.astype(jnp.float32).reshape(r, t, kvh, g, hd))
    return dq, dk, dv


@dataclass(frozen=True)
class PartKernel:
    """A part's attention as a kernel gives it: forward(q, k, v, q_ids, k_ids, *, causal,
    positions, window) -> (out [R,T,H,hd], lse [R,T,H]) float32 (not differentiated), and
    backward(q, k, v, q_ids, k_ids, *, causal, positions, window, out, lse, d_out) -> (dq, dk,
    dv), fed the MERGED out and lse (see `reference_part_backward`)."""

    forward: Callable
    backward: Callable


reference_kernel = PartKernel(reference_part, reference_part_backward)


# ---------------------------------------------------------------------------------- the two parts
def own_part(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, branch: jax.Array, *,
             positions: jax.Array | None = None, window: int | jax.Array | None = None,
             part: Callable = reference_part) -> tuple[jax.Array, jax.Array]:
    """q [R,T,H,hd], k/v [R,T,KV,hd], segment/branch int[R,T] -> (out [R,T,H,hd], lse [R,T,H])
    float32: each slot's causal attention to its own (segment, branch) run (the whole answer
    for a prompt query; a padding query gets out 0, lse MASKED_LSE)."""
    q_ids, k_ids = own_ids(segment, branch)
    return part(q, k, v, q_ids, k_ids, causal=True, positions=positions, window=window)


def prompt_part(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, branch: jax.Array, *,
                positions: jax.Array | None = None, window: int | jax.Array | None = None,
                part: Callable = reference_part) -> tuple[jax.Array, jax.Array]:
    """q [R,T,H,hd], k/v [R,T,KV,hd], segment/branch int[R,T] -> (out [R,T,H,hd], lse [R,T,H])
    float32: each continuation query's attention to its segment's prompt keys (no causal mask;
    prompt and padding queries get out 0, lse MASKED_LSE)."""
    q_ids, k_ids = prompt_ids(segment, branch)
    return part(q, k, v, q_ids, k_ids, causal=False, positions=positions, window=window)


def merge_lse(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Two attentions of the same queries over disjoint key sets, (out [...,hd], lse [...]) each
    -> (out, lse) float32 of the softmax over their union: L = log(e^l1 + e^l2), out = w1 o1 +
    w2 o2 with w_i = e^(l_i - L). Plain differentiable operations: autodiff gives d o_i = w_i dO
    and d l_i = w_i <dO, o_i - O> (+ w_i dL). lse values must be finite (MASKED_LSE for "no
    key", which weighs 0 beside any real part; two such parts give out o1 + o2, here 0)."""
    (o1, l1), (o2, l2) = a, b
    l1, l2 = l1.astype(jnp.float32), l2.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.maximum(l1, l2))  # cancels exactly: no gradient through it
    lse = m + jnp.log(jnp.exp(l1 - m) + jnp.exp(l2 - m))
    w1, w2 = jnp.exp(l1 - lse)[..., None], jnp.exp(l2 - lse)[..., None]
    return o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2, lse


# ---------------------------------------------------------------------------------- entry point
def split_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment: jax.Array, branch: jax.Array, *,
                    positions: jax.Array | None = None, window: int | jax.Array | None = None,
                    part: Callable = reference_part, kernel: PartKernel | None = None) -> jax.Array:
    """`packed_attention`'s softmax as own part + prompt part merged by their log-sum-exps.
    q [R,T,H,hd], k/v [R,T,KV,hd], segment/branch int[R,T] (positions int[R,T] with a window)
    -> out [R,T,H,hd] float32; padding queries get 0. part: a differentiable (out, lse)
    attention, merged by autodiff; kernel (instead): a PartKernel, whose backward gets the
    merged statistics (a custom VJP; no lse gradient needed)."""
    if window is not None and positions is None:
        raise ValueError("packed attention with a sliding window needs the tokens' positions")
    if kernel is None:
        own = own_part(q, k, v, segment, branch, positions=positions, window=window, part=part)
        pre = prompt_part(q, k, v, segment, branch, positions=positions, window=window, part=part)
        return merge_lse(own, pre)[0]
    ids = own_ids(segment, branch) + prompt_ids(segment, branch)
    win = () if window is None else (jnp.asarray(positions, jnp.int32), jnp.asarray(window, jnp.int32))
    return _split_kernel(q, k, v, ids, win, kernel)


def _unpack(win: tuple) -> tuple[jax.Array | None, jax.Array | None]:
    return (win[0], win[1]) if win else (None, None)


def _split_kernel_forward(q, k, v, ids, win, kernel):
    positions, window = _unpack(win)
    own = kernel.forward(q, k, v, ids[0], ids[1], causal=True, positions=positions, window=window)
    pre = kernel.forward(q, k, v, ids[2], ids[3], causal=False, positions=positions, window=window)
    return merge_lse(own, pre)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _split_kernel(q, k, v, ids, win, kernel):
    return _split_kernel_forward(q, k, v, ids, win, kernel)[0]


def _split_kernel_fwd(q, k, v, ids, win, kernel):
    out, lse = _split_kernel_forward(q, k, v, ids, win, kernel)
    return out, (q, k, v, ids, win, out, lse)


def _split_kernel_bwd(kernel, residuals, d_out):
    q, k, v, ids, win, out, lse = residuals
    positions, window = _unpack(win)
    grads = [kernel.backward(q, k, v, q_ids, k_ids, causal=causal, positions=positions, window=window,
                             out=out, lse=lse, d_out=d_out)
             for q_ids, k_ids, causal in ((ids[0], ids[1], True), (ids[2], ids[3], False))]
    dq, dk, dv = (a + b for a, b in zip(*grads))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_split_kernel.defvjp(_split_kernel_fwd, _split_kernel_bwd)
