"""The blocked LM head (`jmarl.models.logprobs.chunked_logprobs`): log-probs of given tokens, their
gradients (hidden states, head, adapter, temperature) equal to the full-vocabulary log-softmax's,
for every split of positions and vocabulary, and no [positions, vocabulary] block in the gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmarl.models.layers import LoraKernel
from jmarl.models.logprobs import chunked_logprobs

B, N, D, V = 2, 7, 16, 50


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(B, N, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, N)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(B, N)), jnp.float32)  # a loss that weighs each token differently
    return h, w, targets, weights


def _reference(h, w, targets, temperature):
    lp = jax.nn.log_softmax(jnp.dot(h, w, precision="highest") / temperature, axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size,vocab_chunk", [(None, None), (3, 16), (2, 7), (7, V), (1, 1), (4, 49)])
def test_values_and_gradients_equal_the_full_log_softmax(chunk_size, vocab_chunk):
    """Blocks that divide the vocabulary and blocks that do not (the last one shifted back and
    its overlap masked), one position at a time or all at once."""
    h, w, targets, weights = _inputs()

    def ours(h, w, temperature):
        return chunked_logprobs(w, h, targets, temperature, chunk_size=chunk_size, vocab_chunk=vocab_chunk)

    np.testing.assert_allclose(ours(h, w, 0.7), _reference(h, w, targets, 0.7), atol=2e-6)
    got = jax.grad(lambda *a: jnp.sum(weights * ours(*a)), argnums=(0, 1, 2))(h, w, 0.7)
    want = jax.grad(lambda *a: jnp.sum(weights * _reference(a[0], a[1], targets, a[2])), argnums=(0, 1, 2))(h, w, 0.7)
    for name, g, r in zip(("h", "kernel", "temperature"), got, want):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.slow
def test_adapted_head_gives_the_merged_heads_values_and_adapter_gradients():
    """A `LoraKernel` head: x W + s (x A) B, W frozen; the adapter's gradients equal those through
    the merged kernel W + s A B, and the base gets none."""
    h, w, targets, weights = _inputs(1)
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.normal(size=(D, 4)) * 0.3, jnp.float32)
    up = jnp.asarray(rng.normal(size=(4, V)) * 0.3, jnp.float32)

    def ours(h, w, a, up):
        return chunked_logprobs(LoraKernel(w, a, up, 0.5), h, targets, 1.3, chunk_size=3, vocab_chunk=16)

    def merged(h, w, a, up):
        return _reference(h, w + 0.5 * jnp.dot(a, up, precision="highest"), targets, 1.3)

    np.testing.assert_allclose(ours(h, w, a, up), merged(h, w, a, up), atol=2e-6)
    got = jax.grad(lambda *x: jnp.sum(weights * ours(*x)), argnums=(0, 1, 2, 3))(h, w, a, up)
    want = jax.grad(lambda *x: jnp.sum(weights * merged(*x)), argnums=(0, 2, 3))(h, w, a, up)
    for name, g, r in zip(("h", "a", "b"), (got[0], got[2], got[3]), want):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5, err_msg=name)
    assert not np.any(np.asarray(got[1])), "the frozen base kernel got a gradient"


def test_bfloat16_products_accumulate_in_float32():
    """compute_dtype bfloat16: the products' operands are rounded to bfloat16, sums stay float32:
    within bfloat16's rounding of the reference on the same rounded operands."""
    h, w, targets, _ = _inputs(3)
    got = chunked_logprobs(w, h, targets, 1.0, chunk_size=3, vocab_chunk=16, compute_dtype="bfloat16")
    rounded = _reference(h.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32),
                         targets, 1.0)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, rounded, atol=1e-5)
    g = jax.grad(lambda w: jnp.sum(chunked_logprobs(w, h, targets, compute_dtype="bfloat16", vocab_chunk=16)))(w)
    assert g.dtype == jnp.float32  # the float32 master's gradient


@pytest.mark.slow
def test_vmapped_over_stacked_heads_equals_each_alone():
    h, w, targets, weights = _inputs(4)
    heads, hs = jnp.stack([w, 0.5 * w]), jnp.stack([h, h + 1.0])

    def ours(heads):
        return jax.vmap(lambda k, x: chunked_logprobs(k, x, targets, 0.9, chunk_size=3, vocab_chunk=16))(heads, hs)

    def reference(heads):
        return jax.vmap(lambda k, x: _reference(x, k, targets, 0.9))(heads, hs)

    np.testing.assert_allclose(ours(heads), reference(heads), atol=2e-6)
    np.testing.assert_allclose(jax.grad(lambda k: jnp.sum(weights * ours(k)))(heads),
                               jax.grad(lambda k: jnp.sum(weights * reference(k)))(heads), atol=2e-5, rtol=1e-5)


def _shapes(jaxpr) -> list[tuple[int, ...]]:
    """Every intermediate's shape in a jaxpr and the jaxprs inside it (scan bodies, custom rules)."""
    out = []
    for eqn in jaxpr.eqns:
        out += [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    out += _shapes(getattr(inner, "jaxpr", inner))
    return out


def test_the_gradient_holds_one_block_of_logits_not_all_of_them():
    """Positions x vocabulary = 2 x 64 x 4096 logits; with chunks of 8 positions and 512 columns
    no intermediate of the gradient's program is larger than one [2 x 8, 512] block along the
    vocabulary (the kernel and its gradient, [D, V], aside)."""
    b, n, d, v = 2, 64, 8, 4096
    h = jnp.ones((b, n, d), jnp.float32)
    w = jnp.ones((d, v), jnp.float32)
    targets = jnp.zeros((b, n), jnp.int32)
    grad = jax.grad(lambda h, w: jnp.sum(chunked_logprobs(w, h, targets, chunk_size=8, vocab_chunk=512)),
                    argnums=(0, 1))
    sizes = [int(np.prod(s)) for s in _shapes(jax.make_jaxpr(grad)(h, w).jaxpr) if s and s[-1] in (v, 512)
             and d not in s]
    assert sizes and max(sizes) <= b * 8 * 512
    full = [int(np.prod(s)) for s in _shapes(jax.make_jaxpr(
        jax.grad(lambda w: jnp.sum(_reference(h, w, targets, 1.0))))(w).jaxpr)]
    assert max(full) >= b * n * v  # the check sees a full block where there is one
