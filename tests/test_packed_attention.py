"""`packed_attention`: prompts and their continuations packed into rows, each continuation
seeing its prompt and itself. Checked against plain causal attention on each sequence
(prompt + one continuation) run alone, in both forms, with ragged lengths, empty
continuations, prompt-only segments and a padded tail; the blockwise form's gradients against
the dense form's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmarl.models import attention as attention_lib
from jmarl.models import packed_tiles as packed_tiles_lib

H, KV, HD = 4, 2, 8


def _layout(rng: np.random.Generator, width: int) -> tuple[np.ndarray, np.ndarray, list]:
    """One packed row: (segment [T], branch [T], [(prompt slots, [continuation slots, ...]), ...])."""
    segment = np.zeros(width, np.int32)
    branch = np.zeros(width, np.int32)
    groups, at, seg = [], 0, 1
    while True:
        prompt = int(rng.integers(1, 7))
        conts = [int(rng.integers(0, 6)) for _ in range(int(rng.integers(0, 4)))]
        if at + prompt + sum(conts) > width - 3:
            break
        p_slots = list(range(at, at + prompt))
        segment[at:at + prompt] = seg
        at += prompt
        c_slots = []
        for b, n in enumerate(conts, start=1):
            segment[at:at + n] = seg
            branch[at:at + n] = b
            c_slots.append(list(range(at, at + n)))
            at += n
        groups.append((p_slots, c_slots))
        seg += 1
    return segment, branch, groups


def _inputs(seed: int, rows: int, width: int):
    rng = np.random.default_rng(seed)
    layouts = [_layout(rng, width) for _ in range(rows)]
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (rows, width, H, HD), jnp.float32)
    k = jax.random.normal(keys[1], (rows, width, KV, HD), jnp.float32)
    v = jax.random.normal(keys[2], (rows, width, KV, HD), jnp.float32)
    segment = jnp.asarray(np.stack([lay[0] for lay in layouts]))
    branch = jnp.asarray(np.stack([lay[1] for lay in layouts]))
    return q, k, v, segment, branch, [lay[2] for lay in layouts]


@pytest.mark.slow
@pytest.mark.parametrize("impl, blocks", [("dense", (512, 512)), ("blockwise", (4, 8)), ("blockwise", (8, 4)),
                                          ("blockwise", (16, 16))])
def test_each_continuation_sees_its_prompt_and_itself(impl, blocks):
    q, k, v, segment, branch, layouts = _inputs(0, 3, 45)
    out = attention_lib.packed_attention(q, k, v, segment, branch, impl=impl, block_q=blocks[0], block_k=blocks[1])
    checked = 0
    for r, groups in enumerate(layouts):
        for p_slots, c_slots in groups:
            for slots in [[]] + c_slots:
                seq = np.asarray(p_slots + slots)
                ref = attention_lib.attention(q[r:r + 1, seq], k[r:r + 1, seq], v[r:r + 1, seq],
                                              jnp.asarray([seq.size]), causal=True, impl="dense")
                np.testing.assert_allclose(out[r, seq], ref[0], atol=2e-6, rtol=2e-6)
                checked += seq.size
    assert checked > 60
    assert np.all(np.isfinite(np.asarray(out)))  # padding slots included


@pytest.mark.slow
def test_masks_of_the_two_forms_agree_with_a_hand_written_rule():
    _, _, _, segment, branch, _ = _inputs(1, 2, 30)
    seg, br = np.asarray(segment), np.asarray(branch)
    t = seg.shape[1]
    want = np.zeros((2, t, t), bool)
    for r in range(2):
        for i in range(t):
            for j in range(i + 1):
                want[r, i, j] = seg[r, i] == seg[r, j] != 0 and br[r, j] in (0, br[r, i])
    got = attention_lib._Packed().allowed((segment, branch), jnp.arange(t), jnp.arange(t))[:, 0, 0]
    np.testing.assert_array_equal(np.asarray(got), want)


def test_segment_bounds():
    segment = jnp.asarray([[1, 1, 2, 2, 2, 5, 0, 0]])
    start, end = packed_tiles_lib.segment_bounds(segment)
    np.testing.assert_array_equal(np.asarray(start), [[0, 0, 2, 2, 2, 5, 6, 7]])
    np.testing.assert_array_equal(np.asarray(end), [[2, 2, 5, 5, 5, 6, 7, 8]])


@pytest.mark.slow
def test_blockwise_gradients_equal_dense():
    q, k, v, segment, branch, _ = _inputs(2, 2, 40)
    weights = jax.random.normal(jax.random.key(9), q.shape)
    real = (segment > 0)[..., None, None]

    def loss(impl, q, k, v):
        out = attention_lib.packed_attention(q, k, v, segment, branch, impl=impl, block_q=8, block_k=4)
        return jnp.sum(jnp.where(real, out * weights, 0.0))

    dense = jax.grad(lambda *a: loss("dense", *a), argnums=(0, 1, 2))(q, k, v)
    blockwise = jax.grad(lambda *a: loss("blockwise", *a), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(dense, blockwise):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_the_blockwise_kernel_skips_a_continuations_siblings():
    """A prompt of 4 slots and 3 continuations of 4, in tiles of 4: each continuation's query
    tile reads the prompt's tile and its own (7 tiles of the causal 10), and each key tile is
    read to the end of its segment (the prompt) or of its branch."""
    segment = jnp.ones((1, 16), jnp.int32)
    branch = jnp.asarray([[0] * 4 + [1] * 4 + [2] * 4 + [3] * 4])
    prompt_lo, prompt_hi, own_lo, query_hi = packed_tiles_lib.packed_tiles(segment, branch, 4, 4, 4, 4)
    np.testing.assert_array_equal(np.asarray(prompt_lo), [0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(prompt_hi), [1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(own_lo), [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(query_hi), [4, 2, 3, 4])
    meta = (segment, branch, prompt_lo, prompt_hi, own_lo, query_hi)
    visited = set()
    for i in range(4):
        for start, stop in attention_lib._Packed().key_ranges(meta, i, 4, 4, 4):
            visited |= {(i, j) for j in range(int(start), int(stop))}
    assert visited == {(0, 0), (1, 0), (1, 1), (2, 0), (2, 2), (3, 0), (3, 3)}
