"""`jmarl.models.splash_kernel`: the Pallas splash kernels (run by the Pallas interpreter on this
CPU, `interpret=True`) as the packed split's PartKernel, against the dense reference, float32:
each part's out and lse (own part causal and on LocalMask, prompt part), the raw kernel's
answer on a fully masked query row (why the module overwrites those), and the whole packed
attention, forward and gradient in q, k, v, on ragged rows (several segments a row,
continuations of different lengths, a prompt-only segment, a padded tail, a row of padding
only; T not a multiple of 128, two key blocks), grouped-query heads, with and without a
sliding window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmarl.models import attention as attention_lib
from jmarl.models import packed_split as ps
from jmarl.models import splash_kernel as sk

H, KV, HD, T, BLOCK, WINDOW = 4, 2, 64, 200, 128, 16
# per row: segments (prompt length, [continuation lengths])
ROWS = [
    [(30, [20, 45]), (12, [7]), (9, []), (25, [33, 11, 5])],  # 197 slots, a prompt-only segment
    [(70, [40, 60])],  # one segment, 30 padding
    [],  # padding only
]
ATOL = RTOL = 2e-5


def _layout():
    """segment, branch, positions int[R,T] of ROWS."""
    seg, br, pos = (np.zeros((len(ROWS), T), np.int32) for _ in range(3))
    for r, segments in enumerate(ROWS):
        at = 0
        for s, (prompt, conts) in enumerate(segments, start=1):
            seg[r, at:at + prompt], pos[r, at:at + prompt] = s, np.arange(prompt)
            at += prompt
            for b, n in enumerate(conts, start=1):
                seg[r, at:at + n], br[r, at:at + n], pos[r, at:at + n] = s, b, prompt + np.arange(n)
                at += n
        assert at <= T
    return jnp.asarray(seg), jnp.asarray(br), jnp.asarray(pos)


def _inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (len(ROWS), T, H, HD), jnp.float32)
    k = jax.random.normal(keys[1], (len(ROWS), T, KV, HD), jnp.float32)
    v = jax.random.normal(keys[2], (len(ROWS), T, KV, HD), jnp.float32)
    w = jax.random.normal(keys[3], (len(ROWS), T, H, HD), jnp.float32)
    return q, k, v, w


def test_has_key_matches_the_dense_mask():
    seg, br, _ = _layout()
    for (q_ids, k_ids), causal in ((ps.own_ids(seg, br), True), (ps.prompt_ids(seg, br), False)):
        want = np.asarray(jnp.any(ps.part_mask(q_ids, k_ids, causal=causal), axis=-1))
        np.testing.assert_array_equal(np.asarray(sk.has_key(q_ids, k_ids, causal=causal)), want)
    # causal: a key with the query's id only after it does not count (query 0's key is at slot 1)
    q_ids, k_ids = jnp.array([[1, 2, 2]]), jnp.array([[2, 1, 2]])
    assert sk.has_key(q_ids, k_ids, causal=True).tolist() == [[False, True, True]]
    assert sk.has_key(q_ids, k_ids, causal=False).tolist() == [[True, True, True]]


def test_raw_splash_averages_a_fully_masked_row():
    """What the module works around: a query whose segment id matches no key gets the mean of
    the values and an lse of mask_value + log(keys) from the kernel, not an error or NaN."""
    kernel_lib, _ = sk._splash()
    kernel = sk._kernel(128, 1, False, None, 128, True)
    q, k, v = (jax.random.normal(key, (1, 128, HD)) for key in jax.random.split(jax.random.key(1), 3))
    q_ids = jnp.zeros(128, jnp.int32).at[5].set(7)  # query 5 sees no key
    out, (lse,) = kernel(q, k, v, segment_ids=kernel_lib.SegmentIds(q=q_ids, kv=jnp.zeros(128, jnp.int32)))
    np.testing.assert_allclose(out[0, 5], v[0].mean(axis=0), atol=1e-5)
    np.testing.assert_allclose(lse[0, 5], ps.MASKED_LSE + np.log(128), rtol=1e-6)


def test_splash_parts_equal_the_reference_part():
    q, k, v, _ = _inputs()
    seg, br, pos = _layout()
    cases = {
        "own": (ps.own_ids(seg, br), True, None),
        "own, LocalMask": (ps.own_ids(seg, br), True, WINDOW),
        "prompt": (ps.prompt_ids(seg, br), False, None),
    }
    for name, ((q_ids, k_ids), causal, local) in cases.items():
        got = jax.jit(lambda q, k, v: sk.splash_part(q, k, v, q_ids, k_ids, causal=causal, local=local,
                                                     block=BLOCK, interpret=True))(q, k, v)
        want = ps.reference_part(q, k, v, q_ids, k_ids, causal=causal, positions=pos,
                                 window=None if local is None else jnp.int32(local))
        for g, w, what in zip(got, want, ("out", "lse")):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=ATOL, rtol=RTOL, err_msg=f"{name} {what}")
        # queries with no key in the part: out 0, lse MASKED_LSE (the prompt part's prompt and padding queries)
        none = ~np.asarray(sk.has_key(q_ids, k_ids, causal=causal))
        assert none.any() and np.all(np.asarray(got[0])[none] == 0) and np.all(np.asarray(got[1])[none] == ps.MASKED_LSE)


def _check_split_against_dense(window, local_window):
    q, k, v, w = _inputs()
    seg, br, pos = _layout()
    real = (seg != 0)[..., None, None]
    kernel = sk.splash_kernel(local_window=local_window, block=BLOCK, interpret=True)
    p = None if window is None else pos

    def split(q, k, v, win):
        return jnp.sum(ps.split_attention(q, k, v, seg, br, positions=p, window=win, kernel=kernel) * w)

    def dense(q, k, v, win):  # the dense form averages padding queries: count real ones only
        out = attention_lib.packed_attention(q, k, v, seg, br, impl="dense", positions=p, window=win)
        return jnp.sum(jnp.where(real, out, 0.0) * w)

    win = None if window is None else jnp.int32(window)  # traced, as the layer scan passes it
    got = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2)))(q, k, v, win)
    want = jax.jit(jax.value_and_grad(dense, argnums=(0, 1, 2)))(q, k, v, win)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=RTOL)
    for g, d, name in zip(got[1], want[1], "qkv"):
        assert float(jnp.abs(d).max()) > 0.1, name  # the gradient is not trivially 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(d), atol=ATOL, rtol=RTOL, err_msg=f"d{name}")
    out = jax.jit(lambda q, k, v, win: ps.split_attention(q, k, v, seg, br, positions=p, window=win,
                                                          kernel=kernel))(q, k, v, win)
    assert np.all(np.asarray(out)[np.asarray(seg) == 0] == 0)  # padding queries: 0 (and no NaN)


def test_splash_split_equals_dense_forward_and_gradient():
    _check_split_against_dense(None, None)


@pytest.mark.slow
@pytest.mark.parametrize("window,local_window", [(attention_lib.NO_WINDOW, WINDOW), (WINDOW, WINDOW), (WINDOW, None)],
                         ids=["full-layer", "LocalMask", "reference"])
def test_splash_split_with_a_window_equals_dense(window, local_window):
    """A layer scan's traced window: NO_WINDOW (splash unwindowed), the kernel's local_window
    (own part on LocalMask, prompt part dense), another window (both parts dense)."""
    _check_split_against_dense(window, local_window)
