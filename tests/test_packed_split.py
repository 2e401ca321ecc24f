"""`jmarl.models.packed_split`: packed shared-prefix attention as an own part (causal, by run
ids) and a prompt part (continuations to their prompt), merged by their log-sum-exps. Checked
against `packed_attention`'s dense form, forward and gradient, on ragged packed rows (several
segments a row, prompts of different lengths, 0-3 continuations, a padded tail, a row of one
segment, a row of padding only), with grouped-query heads, with and without a sliding window;
both the autodiff merge and the kernel form (backward fed the merged statistics). `merge_lse`
on a hand-worked case and against a one-piece softmax; and the checks are shown to catch a
missing part or a wrong log-sum-exp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmarl.errors import JmarlError
from jmarl.models import attention as attention_lib
from jmarl.models import packed_split as ps

H, KV, HD, T = 4, 2, 8, 26
# per row: segments (prompt length, [continuation lengths])
ROWS = [
    [(3, [2, 4]), (5, [1]), (2, [3, 1, 2])],  # 23 slots, 3 padding
    [(7, [4, 3, 5])],  # one segment, 7 padding
    [],  # padding only
    [(1, [1, 1, 1]), (4, []), (2, [5]), (6, [2, 2])],  # 25 slots, a prompt-only segment, 1 padding
]
WINDOWS = [None, 3, 6]


def packed_layout(rows, t: int):
    """segment, branch, positions int[R,T] of `rows`: per row, a list of (prompt length,
    [continuation lengths]) segments packed from slot 0, padding after."""
    seg, br, pos = (np.zeros((len(rows), t), np.int32) for _ in range(3))
    for r, segments in enumerate(rows):
        at = 0
        for s, (prompt, conts) in enumerate(segments, start=1):
            seg[r, at:at + prompt], pos[r, at:at + prompt] = s, np.arange(prompt)
            at += prompt
            for b, n in enumerate(conts, start=1):
                seg[r, at:at + n], br[r, at:at + n], pos[r, at:at + n] = s, b, prompt + np.arange(n)
                at += n
        assert at <= t
    return jnp.asarray(seg), jnp.asarray(br), jnp.asarray(pos)


def random_qkvw(seed: int, r: int, t: int, h: int, kv: int, hd: int):
    """q [R,T,H,hd], k/v [R,T,KV,hd] and a cotangent w [R,T,H,hd], float32 normals."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (r, t, h, hd), jnp.float32)
    k = jax.random.normal(keys[1], (r, t, kv, hd), jnp.float32)
    v = jax.random.normal(keys[2], (r, t, kv, hd), jnp.float32)
    w = jax.random.normal(keys[3], (r, t, h, hd), jnp.float32)
    return q, k, v, w


def _layout():
    """segment, branch, positions int[R,T] of ROWS."""
    return packed_layout(ROWS, T)


def _inputs(seed=0):
    return random_qkvw(seed, len(ROWS), T, H, KV, HD)


def _dense(q, k, v, seg, br, pos, window):
    return attention_lib.packed_attention(q, k, v, seg, br, impl="dense", window=window,
                                          positions=None if window is None else pos)


def _forms(seg, br, pos, window):
    """name -> f(q, k, v) of each split form."""
    p = None if window is None else pos
    return {
        "packed_attention(split)": jax.jit(lambda q, k, v, win: attention_lib.packed_attention(
            q, k, v, seg, br, impl="split", window=win, positions=p)),
        "split_attention(kernel)": jax.jit(lambda q, k, v, win: ps.split_attention(
            q, k, v, seg, br, positions=p, window=win, kernel=ps.reference_kernel)),
    }


@pytest.mark.parametrize("window", WINDOWS)
def test_split_equals_dense_forward(window):
    q, k, v, _ = _inputs()
    seg, br, pos = _layout()
    want = np.asarray(jax.jit(_dense, static_argnums=6)(q, k, v, seg, br, pos, window))
    real = np.asarray(seg) != 0
    for name, fn in _forms(seg, br, pos, window).items():
        win = None if window is None else jnp.int32(window)  # traced, as a layer scan passes it
        got = np.asarray(fn(q, k, v, win))
        np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=1e-5, err_msg=name)
        # a padding query sees no key in either part: 0 (the dense form averages instead)
        assert np.all(got[~real] == 0), name
    # the parts themselves: a prompt query's answer is its own part alone
    parts = jax.jit(lambda q, k, v: (ps.own_part(q, k, v, seg, br, positions=pos, window=window),
                                     ps.prompt_part(q, k, v, seg, br, positions=pos, window=window)))
    (own_out, own_lse), (pre_out, pre_lse) = parts(q, k, v)
    prompt_q = real & (np.asarray(br) == 0)
    np.testing.assert_allclose(np.asarray(own_out)[prompt_q], want[prompt_q], atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(pre_out)[~real | prompt_q] == 0)
    assert np.all(np.asarray(pre_lse)[~real | prompt_q] == ps.MASKED_LSE)
    assert np.all(np.asarray(own_lse)[~real] == ps.MASKED_LSE)


@pytest.mark.parametrize("window", WINDOWS)
def test_split_gradients_equal_dense(window):
    q, k, v, w = _inputs(1)
    seg, br, pos = _layout()
    real = (seg != 0)[:, :, None, None]  # padding queries' outputs are never used

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(real, w * fn(q, k, v), 0.0))

    win = None if window is None else jnp.int32(window)
    want = jax.jit(jax.grad(loss(lambda q, k, v: _dense(q, k, v, seg, br, pos, window)), argnums=(0, 1, 2)))(q, k, v)
    assert max(float(jnp.abs(g).max()) for g in want) > 0.1
    for name, fn in _forms(seg, br, pos, window).items():
        got = jax.jit(lambda q, k, v, win, fn=fn: jax.grad(loss(lambda q, k, v: fn(q, k, v, win)), argnums=(0, 1, 2))(
            q, k, v))(q, k, v, win)
        for which, a, b in zip("qkv", got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5, err_msg=f"{name} d{which}")


@pytest.mark.slow
def test_the_two_parts_partition_the_packed_mask():
    seg, br, pos = _layout()
    idx = jnp.arange(T)
    for window in WINDOWS:
        extra = () if window is None else (pos, jnp.int32(window))
        want = np.asarray(attention_lib._Packed(window is not None).allowed((seg, br) + extra, idx, idx)[:, 0, 0])
        p = None if window is None else pos
        own = np.asarray(ps.part_mask(*ps.own_ids(seg, br), causal=True, positions=p, window=window))
        pre = np.asarray(ps.part_mask(*ps.prompt_ids(seg, br), causal=False, positions=p, window=window))
        assert not np.any(own & pre)
        np.testing.assert_array_equal(own | pre, want)
        assert pre.sum() > 20 and own.sum() > 20


@pytest.mark.slow
def test_merge_lse_hand_worked():
    # part 1: out [1, 0], its keys' exp-sum 1; part 2: out [0, 2], exp-sum 3 -> weights 1/4, 3/4
    o1, l1 = jnp.array([1.0, 0.0]), jnp.array(0.0)
    o2, l2 = jnp.array([0.0, 2.0]), jnp.log(jnp.array(3.0))
    out, lse = ps.merge_lse((o1, l1), (o2, l2))
    np.testing.assert_allclose(out, [0.25, 1.5], rtol=1e-6)
    np.testing.assert_allclose(lse, np.log(4.0), rtol=1e-6)
    # gradient of <[1, 1], out>: d o_i = w_i, d l_i = w_i <dO, o_i - out>
    g = jax.grad(lambda *a: jnp.sum(ps.merge_lse((a[0], a[1]), (a[2], a[3]))[0]), argnums=(0, 1, 2, 3))(o1, l1, o2, l2)
    np.testing.assert_allclose(g[0], [0.25, 0.25], rtol=1e-6)
    np.testing.assert_allclose(g[1], 0.25 * (0.75 - 1.5), rtol=1e-6)
    np.testing.assert_allclose(g[2], [0.75, 0.75], rtol=1e-6)
    np.testing.assert_allclose(g[3], 0.75 * (-0.25 + 0.5), rtol=1e-6)
    # a part with no key weighs nothing; two such give 0, finite, with finite gradients
    out, lse = ps.merge_lse((o1, l1), (jnp.zeros(2), jnp.array(ps.MASKED_LSE)))
    np.testing.assert_allclose(out, o1)
    np.testing.assert_allclose(lse, 0.0, atol=1e-7)
    none = (jnp.zeros(2), jnp.array(ps.MASKED_LSE))
    out, lse = ps.merge_lse(none, none)
    assert np.all(np.asarray(out) == 0) and np.isfinite(lse)
    g = jax.grad(lambda l: jnp.sum(ps.merge_lse((o1, l), none)[0]))(jnp.array(ps.MASKED_LSE))
    assert np.isfinite(g)


@pytest.mark.slow
def test_merge_lse_gradient_equals_one_piece_softmax():
    keys = jax.random.split(jax.random.key(3), 6)
    r, t, s1, s2 = 2, 5, 3, 4
    q = jax.random.normal(keys[0], (r, t, H, HD))
    k1, v1 = jax.random.normal(keys[1], (r, s1, KV, HD)), jax.random.normal(keys[2], (r, s1, KV, HD))
    k2, v2 = jax.random.normal(keys[3], (r, s2, KV, HD)), jax.random.normal(keys[4], (r, s2, KV, HD))
    w = jax.random.normal(keys[5], (r, t, H, HD))
    ones = lambda n: jnp.ones((r, n), jnp.int32)  # noqa: E731  every query sees every key

    def split(q, k1, v1, k2, v2):
        a = ps.reference_part(q, k1, v1, ones(t), ones(s1), causal=False)
        b = ps.reference_part(q, k2, v2, ones(t), ones(s2), causal=False)
        return jnp.sum(w * ps.merge_lse(a, b)[0])

    def one_piece(q, k1, v1, k2, v2):  # softmax over the concatenated keys, GQA by repeating k/v
        k, v = (jnp.repeat(jnp.concatenate(x, axis=1), H // KV, axis=2) for x in ((k1, k2), (v1, v2)))
        p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(HD), axis=-1)
        return jnp.sum(w * jnp.einsum("bhts,bshd->bthd", p, v))

    args = (q, k1, v1, k2, v2)
    np.testing.assert_allclose(jax.jit(split)(*args), jax.jit(one_piece)(*args), rtol=1e-5)
    grad = lambda f: jax.jit(jax.grad(f, argnums=tuple(range(5))))(*args)  # noqa: E731
    for a, b in zip(grad(split), grad(one_piece)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_missing_part_or_a_wrong_lse_is_caught():
    q, k, v, w = _inputs(2)
    seg, br, pos = _layout()
    want = _dense(q, k, v, seg, br, pos, None)
    cont = np.asarray((seg != 0) & (br > 0))
    own, pre = jax.jit(lambda q, k, v: (ps.own_part(q, k, v, seg, br), ps.prompt_part(q, k, v, seg, br)))(q, k, v)
    gap = lambda out: float(np.abs(np.asarray(out) - np.asarray(want))[cont].max())  # noqa: E731
    assert gap(ps.merge_lse(own, pre)[0]) < 1e-5
    assert gap(own[0]) > 0.1  # without the prompt part
    assert gap(ps.merge_lse(own, (pre[0], pre[1] + 1.0))[0]) > 0.1  # a wrong lse
    # an lse that carries no gradient (what kernels return) merges to the right values and WRONG
    # gradients: why the kernel form's backward takes the merged statistics instead
    real = (seg != 0)[:, :, None, None]

    def loss(stop):
        def fn(q, k, v):
            cut = jax.lax.stop_gradient if stop else (lambda x: x)
            a, b = ps.own_part(q, k, v, seg, br), ps.prompt_part(q, k, v, seg, br)
            return jnp.sum(jnp.where(real, w * ps.merge_lse((a[0], cut(a[1])), (b[0], cut(b[1])))[0], 0.0))
        return fn

    good = jax.jit(jax.grad(loss(False), argnums=(0, 1)))(q, k, v)
    bad = jax.jit(jax.grad(loss(True), argnums=(0, 1)))(q, k, v)
    assert float(jnp.abs(loss(True)(q, k, v) - loss(False)(q, k, v))) < 1e-4
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(good, bad)) > 0.05


def test_split_is_reachable_only_through_packed_attention():
    assert "split" not in attention_lib.IMPLS
    q, k, v, _ = _inputs()
    with pytest.raises(JmarlError):
        attention_lib.attention(q, k, v, jnp.full((len(ROWS),), T), causal=True, impl="split")
    seg, br, _ = _layout()
    with pytest.raises(JmarlError):
        attention_lib.packed_attention(q, k, v, seg, br, impl="split", window=3)  # no positions
