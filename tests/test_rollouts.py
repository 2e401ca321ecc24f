import numpy as np
import pytest

from jmarl import JmarlError
from jmarl.rollouts import concat, make_rollouts, pad_to, select
from jmarl.padding import bucket_length


def _two(n=3, t=4, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50, (n, t))
    attn = np.ones((n, t), bool)
    loss = np.zeros((n, t), bool)
    loss[:, 2:] = True
    lp = -rng.random((n, t)).astype(np.float32) * loss
    return make_rollouts(tokens, loss, attn, rng.random(n), np.arange(n), behavior_logprobs=lp)


def test_defaults_and_seq_logprob():
    r = _two()
    np.testing.assert_array_equal(r.source_policy, r.policy)
    expected = (np.asarray(r.behavior_logprobs) * np.asarray(r.loss_mask)).sum(1) / 2
    np.testing.assert_allclose(r.source_seq_logprob, expected, rtol=1e-6)


def test_pad_concat_select():
    a, b = _two(2, 4), _two(3, 6, seed=1)
    c = concat([a, b])
    assert c.tokens.shape == (5, 6)
    assert not np.asarray(c.attention_mask)[:2, 4:].any()
    p = pad_to(c, num_samples=8)
    assert p.tokens.shape == (8, 6) and (np.asarray(p.group)[5:] == -1).all()
    s = select(c, np.array([4, 0]))
    np.testing.assert_array_equal(s.tokens[1, :4], a.tokens[0])


def test_bad_shapes_raise():
    with pytest.raises(JmarlError, match="loss_mask"):
        make_rollouts(np.zeros((2, 3)), np.zeros((2, 2)), np.ones((2, 3)), np.zeros(2), np.zeros(2))
    with pytest.raises(JmarlError, match="padding"):
        make_rollouts(np.zeros((1, 2)), np.ones((1, 2)), np.zeros((1, 2)), np.zeros(1), np.zeros(1))


def test_bucket_length():
    assert bucket_length(1) == 32 and bucket_length(33) == 64 and bucket_length(64) == 64
    assert bucket_length(9000) == 16384


def test_row_bucket():
    from jmarl.padding import row_bucket

    # powers of two up to 8, then four buckets per doubling
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 11, 15, 17, 25, 33)] == [1, 2, 4, 8, 8, 10, 12, 16, 20, 28, 40]
    assert [row_bucket(n) for n in (72, 104, 120, 129)] == [80, 112, 128, 160]
    for n in range(9, 3000):
        b = row_bucket(n)
        assert n <= b <= 1.25 * n  # at most a quarter of padding rows
        assert b >> ((b - 1).bit_length() - 3) in (4, 5, 6, 7, 8)  # m x 2^k with m in 4..8
    for k in (2, 4, 8, 16):  # groups of K completions: a whole number of groups
        assert all(row_bucket(g * k) % k == 0 for g in range(1, 200))
    assert [row_bucket(n, 8) for n in (1, 9, 17, 41)] == [8, 16, 24, 48]  # split over 8 devices
    assert len({row_bucket(n) for n in range(65, 129)}) == 4  # programs per doubling
