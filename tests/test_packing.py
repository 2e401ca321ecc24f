"""The learner's packed batch layout: exact fields on a hand-made batch, the same log-probs,
loss and gradients as the plain [N, T] layout through `make_update`'s micro-batches, in both
attention forms, with several rows per micro-batch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tiny_models import tiny_qwen3
from jmarl import algos, models
from jmarl.batch import LearnerBatch
from jmarl.errors import JmarlError
from jmarl.models import packed_pallas
from jmarl.train.optim import make_optimizer
from jmarl.train.packing import (ROW_TOKENS, PackShape, pack, packed_logprobs, plain_samples, shape_of, split_prompts, token_budget,
                                 token_utilization)
from jmarl.train.step import init_train_state, make_update, split_minibatches

TINY = tiny_qwen3(model_type="qwen2", qkv_bias=True, qk_norm=False, o_bias=False)  # tiny_qwen3's shape, Qwen2's biases


def _plain(rows: list[tuple[list[int], list[int]]], t: int) -> dict[str, np.ndarray]:
    """Right-padded [N, T] batch of (prompt, completion) rows, each sequence laid out whole (`plain_samples` reads them)."""
    n = len(rows)
    tokens = np.zeros((n, t), np.int32)
    attn = np.zeros((n, t), bool)
    loss = np.zeros((n, t), bool)
    for i, (p, c) in enumerate(rows):
        tokens[i, : len(p) + len(c)] = p + c
        attn[i, : len(p) + len(c)] = True
        loss[i, len(p): len(p) + len(c)] = True
    behavior = np.where(loss, -0.5 - np.arange(t, dtype=np.float32) / 10, 0.0).astype(np.float32)
    return {"tokens": tokens, "attention_mask": attn, "loss_mask": loss, "behavior_logprobs": behavior,
            "reward": np.arange(n, dtype=np.float32)}


def test_token_budgets():
    assert [token_budget(n) for n in (1, 64, 65, 72, 73, 128, 129, 200, 1000)] == [64, 64, 72, 72, 80, 128, 144, 208, 1024]
    assert token_budget(3, minimum=1) == 3
    assert all(n <= token_budget(n) <= max(64, n * 9 / 8) for n in range(1, 5000))


def test_layout_by_hand():
    plain = _plain([([5, 6, 7], [8, 9]), ([5, 6, 7], [10]), ([5, 6], [11, 12, 13]), ([], [])], t=6)
    (out,) = pack([plain_samples(plain)], parts=2, width=8, buckets=(4,))
    # micro-batch 0: prompt [5 6 7] then its two continuations; micro-batch 1: [5 6] and one
    # continuation (the padding row packs nothing). One row each of L = 64 (the smallest budget
    # holding the longest segment, above width 8); M = R x L = 64; C = 4.
    assert out["packed_tokens"].shape == (2, 64)
    np.testing.assert_array_equal(out["packed_tokens"][:, :8], [[5, 6, 7, 8, 9, 10, 0, 0], [5, 6, 11, 12, 13, 0, 0, 0]])
    np.testing.assert_array_equal(out["packed_positions"][:, :6], [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 4, 0]])
    np.testing.assert_array_equal(out["packed_segment"][:, :7], [[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(out["packed_branch"][:, :6], [[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 0]])
    # predictions: sample 0 token 8 from slot 2 (the prompt's last), 9 from slot 3; sample 1's
    # 10 from slot 2 again; sample 2's 11 from row 1's slot 1 (64 + 1), 12 from 66, 13 from 67
    assert out["pred_source"].shape == out["pred_target"].shape == (2 * 64,)
    np.testing.assert_array_equal(out["pred_source"].reshape(2, 64)[:, :4], [[2, 3, 2, 0], [65, 66, 67, 0]])
    np.testing.assert_array_equal(out["pred_target"].reshape(2, 64)[:, :4], [[8, 9, 10, 0], [11, 12, 13, 0]])
    np.testing.assert_array_equal(out["pred_slot"], [[0, 1, -1, -1], [2, -1, -1, -1], [64, 65, 66, -1], [-1] * 4])
    np.testing.assert_array_equal(out["tokens"], [[8, 9, 0, 0], [10, 0, 0, 0], [11, 12, 13, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["attention_mask"], out["loss_mask"])
    np.testing.assert_allclose(out["behavior_logprobs"][0, :2], [-0.8, -0.9])
    np.testing.assert_array_equal(out["reward"], plain["reward"])  # [N] fields pass through
    assert token_utilization(out) == (11, 128)
    assert shape_of(out, parts=2) == PackShape(rows=1, width=64, predictions=64, length=4)
    with pytest.raises(JmarlError, match="does not split into 3"):
        pack([plain_samples(plain)], parts=3)


def test_segments_go_whole_into_the_first_row_with_room():
    rows = [([1] * 30, [2] * 10)] * 2 + [([3] * 20, [4] * 5)] * 3 + [([5] * 8, [6] * 40)]
    (out,) = pack([plain_samples(_plain(rows, t=64))], parts=1, width=96)
    seg, br = out["packed_segment"], out["packed_branch"]
    # segments of 50, 35 and 48 tokens, longest first: 50 + 35 | 48
    assert out["packed_tokens"].shape == (2, 96)
    assert [int(np.count_nonzero(r)) for r in seg] == [85, 48]
    for r in range(2):
        for s in set(seg[r][seg[r] > 0].tolist()):
            slots = np.flatnonzero(seg[r] == s)
            assert np.all(np.diff(slots) == 1) and br[r, slots[0]] == 0
    (out,) = pack([plain_samples(_plain(rows, t=64))], parts=1, width=96, rows_per_part=4)  # one row per data shard at least
    assert out["packed_tokens"].shape == (4, 96) and np.count_nonzero(out["packed_segment"][2:]) == 0


def test_rows_are_full_but_the_last_and_a_long_segment_widens_them():
    rows = [([1 + i] * 50, [2] * 30) for i in range(60)]  # 60 segments of 80 tokens: 4800 in all
    (out,) = pack([plain_samples(_plain(rows, t=80))])
    # rows of 1024 would hold 12 segments (960 tokens) each: 5 x 1024 = 5120 slots; rows of 320
    # hold 4 (320 tokens) each, every slot real: 15 x 320 = 4800
    assert out["packed_tokens"].shape == (15, 320)
    assert [int(np.count_nonzero(r)) for r in out["packed_segment"]] == [320] * 15
    (out,) = pack([plain_samples(_plain(rows, t=80))], known={(5, ROW_TOKENS)})  # a compiled shape within the slack
    assert out["packed_tokens"].shape == (5, ROW_TOKENS)
    assert [int(np.count_nonzero(r)) for r in out["packed_segment"]] == [960] * 5
    long = [([7] * 600, [8] * 500)] * 2  # a segment of 1600 tokens
    (out,) = pack([plain_samples(_plain(rows[:3] + long, t=1100))])
    assert out["packed_tokens"].shape == (2, token_budget(1600))  # 1600 | 3 x 80


def test_first_fit_places_each_segment_as_first_fit_decreasing_does():
    """The vectorised first-fit equals the textbook loop (longest first, stable among equal
    sizes, the first row with room) on ragged sizes, and the fullest row is the rows' largest sum."""
    from jmarl.train.packing import _first_fit, _fullest_row

    def reference(sizes, width):
        load, where = [], [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            r = next((j for j, used in enumerate(load) if used + sizes[i] <= width), len(load))
            if r == len(load):
                load.append(0)
            where[i], load[r] = r, load[r] + sizes[i]
        return where

    rng = np.random.default_rng(0)
    for width in (64, 1024):
        for n in (0, 1, 7, 200):
            sizes = [int(x) for x in rng.integers(1, width + 1, n)]
            where = _first_fit(sizes, width)
            assert where == reference(sizes, width)
            sums = [sum(x for x, r in zip(sizes, where) if r == row) for row in set(where)]
            assert _fullest_row(sizes, where) == max(sums, default=0)
            assert max(sums, default=0) <= width
    assert _first_fit([3, 5, 2, 5], 8) == [0, 0, 1, 1]  # the first 5 and the 3 fill row 0; the other 5 and the 2 row 1


def test_row_shape_takes_the_fewest_slots_never_more_than_full_width_rows():
    """(R, L) over the candidate widths: fewest slots, ties to the wider; a known shape only when
    it holds the segments, costs within the slack and no more than the full-width baseline;
    widths stay above the dense-attention threshold."""
    from jmarl.models.attention import PACKED_DENSE_MAX
    from jmarl.train.packing import KNOWN_SHAPE_SLACK, row_shape

    sizes = [[100] * 25]  # 2500 tokens; full-width rows: 10 + 10 + 5 segments, 3 x 1024 = 3072 slots
    best = row_shape(sizes, ROW_TOKENS)
    assert best == (5, 512)  # 5 segments a row: 2560 slots (320-wide: 9 x 320 = 2880; 448: 7 x 448 = 3136)
    assert row_shape(sizes, ROW_TOKENS, known={(4, 704)}) == (4, 704)  # 7 a row; 2816 <= 1.1 x 2560
    assert row_shape(sizes, ROW_TOKENS, known={(3, 896)}) == best  # holds 24 segments, not 25
    assert row_shape(sizes, ROW_TOKENS, known={(3, 1024)}) == best  # 3072 > 1.1 x 2560
    assert row_shape([[100] * 30], ROW_TOKENS) == (3, 1024)  # 3000 tokens: no narrower width has fewer slots
    assert row_shape([[100] * 30], ROW_TOKENS, known={(4, 1024)}) == (3, 1024)  # more slots than the baseline
    assert all(w > PACKED_DENSE_MAX for _, w in (best, row_shape([[120] * 40], ROW_TOKENS)))
    assert row_shape(sizes, ROW_TOKENS, rows_per_part=4)[0] % 4 == 0
    assert row_shape([[300] * 2], ROW_TOKENS) == (1, 640)  # one row, narrowed to its fullest bucket
    assert KNOWN_SHAPE_SLACK >= 1.0


def test_prompt_is_everything_before_the_first_loss_token():
    tokens = np.array([[1, 2, 3, 4, 5, 6]])
    attn = np.array([[0, 1, 1, 1, 1, 0]], bool)
    loss = np.array([[0, 0, 0, 1, 0, 0]], bool)
    (prompt, cols), = split_prompts(tokens, attn, loss)
    np.testing.assert_array_equal(prompt, [2, 3])
    np.testing.assert_array_equal(cols, [3, 4])


def _random_rows(rng) -> list[tuple[list[int], list[int]]]:
    """Three GRPO groups (sizes 3, 3, 1) with prompts of different lengths, a sample with no
    prompt, a padding row."""
    rows = []
    for size, plen in ((3, 7), (3, 4), (1, 9)):
        prompt = rng.integers(3, 64, plen).tolist()
        rows += [(prompt, rng.integers(3, 64, int(rng.integers(1, 6))).tolist()) for _ in range(size)]
    return rows + [([], [7, 8, 9]), ([], [])]


@pytest.mark.slow
@pytest.mark.parametrize("attention, rows_per_part", [("xla", 1), ("blockwise", 2), ("pallas", 2)])
def test_same_logprobs_loss_and_gradients_as_the_plain_layout(attention, rows_per_part):
    """pallas: the fused kernel in the Pallas interpreter (head_dim 16, the least it takes)."""
    if attention != "pallas":
        return _same_as_plain(dataclasses.replace(TINY, attention=attention), rows_per_part)
    with packed_pallas.interpret_kernels():
        _same_as_plain(dataclasses.replace(TINY, attention=attention, head_dim=16), rows_per_part)


def _same_as_plain(config, rows_per_part):
    rng = np.random.default_rng(0)
    params = models.init(config, jax.random.key(0))
    plain = _plain(_random_rows(rng), t=16)
    plain["old_logprobs"] = plain.pop("behavior_logprobs")
    plain["advantages"] = rng.normal(size=9).astype(np.float32)
    plain = {k: np.concatenate([v, v[-1:] * 0]) for k, v in plain.items()}  # 10 rows: 2 micro-batches of 5
    (packed,) = pack([plain_samples(plain)], parts=2, rows_per_part=rows_per_part, buckets=(8, 16))

    full = np.asarray(models.token_logprobs(config, params, plain["tokens"], plain["attention_mask"], 0.8))
    split = split_prompts(plain["tokens"], plain["attention_mask"], plain["loss_mask"])
    lp = np.asarray(packed_logprobs(config, params, packed, 0.8))
    micro = split_minibatches(packed, 1, 2)
    lp_micro = np.concatenate([
        np.asarray(packed_logprobs(config, params, jax.tree.map(lambda x: x[0, m], micro), 0.8)) for m in range(2)
    ])
    for i, (_, cols) in enumerate(split):
        np.testing.assert_allclose(lp[i, : cols.size], full[i, cols], atol=1e-5)
        np.testing.assert_allclose(lp_micro[i, : cols.size], full[i, cols], atol=1e-5)
        assert np.all(lp[i, cols.size:] == 0)
    assert lp[7, 0] == 0 and lp[7, 1] != 0  # no prompt: the first token has nothing before it

    cfg = algos.grpo.GRPOConfig()
    optimizer = make_optimizer(1e-3, total_steps=10, grad_clip=1.0)

    def plain_loss(p, frozen, b):
        lp = models.token_logprobs(config, p, b["tokens"], b["attention_mask"])
        return algos.policy_loss(lp, b["old_logprobs"], b["advantages"], b["loss_mask"], aggregation=cfg.aggregation)

    def packed_loss(p, frozen, b):
        return algos.policy_loss(packed_logprobs(config, p, b), b["old_logprobs"], b["advantages"], b["loss_mask"],
                                 aggregation=cfg.aggregation)

    results = []
    for loss_fn, batch in ((plain_loss, plain), (packed_loss, packed)):
        update = jax.jit(make_update(loss_fn, optimizer, grad_accum=2))
        results.append(update(init_train_state(params, optimizer), None, jax.tree.map(jnp.asarray, batch)))
    (s_plain, m_plain), (s_packed, m_packed) = results
    assert float(m_plain["grad_norm"]) > 0
    np.testing.assert_allclose(m_packed["loss"], m_plain["loss"], rtol=1e-5)
    np.testing.assert_allclose(m_packed["grad_norm"], m_plain["grad_norm"], rtol=1e-5)
    # Adam moves every parameter by ~lr = 1e-3: a tiny gradient's float noise may show, a wrong gradient would not hide
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), s_packed.params, s_plain.params)


@pytest.fixture(scope="module")
def method_inputs():
    """A batch with every field a method reads, plain [N, T] and packed, the log-probs of both
    layouts and their compiled pullbacks (params -> log-probs, cotangent -> parameter gradient)."""
    rng = np.random.default_rng(5)
    params = models.init(TINY, jax.random.key(1))
    plain = _plain(_random_rows(rng), t=16)
    n, t = plain["tokens"].shape
    old = np.where(plain["loss_mask"], rng.uniform(-4, -2, (n, t)), 0).astype(np.float32)
    plain.update(
        behavior_logprobs=old, old_logprobs=old,
        ref_logprobs=np.where(plain["loss_mask"], old + rng.uniform(-0.3, 0.3, (n, t)), 0).astype(np.float32),
        reward=np.array([1, 0, 0.5, 1, 1, 0, 1, 0, 0], np.float32),
        group=np.array([0, 0, 0, 1, 1, 1, 2, 3, -1], np.int32), agent=np.zeros(n, np.int32),
        learner=np.zeros(n, np.int32), source_policy=np.array([0, 1, 0, 0, 1, 1, 0, 1, 0], np.int32),
        source_seq_logprob=rng.uniform(-3, -1, n).astype(np.float32),
    )
    (packed,) = pack([plain_samples(plain)], parts=1)

    def pullback(fn):
        return jax.jit(lambda p, cot: jax.vjp(fn, p)[1](cot)[0])

    lp_plain = lambda p: models.token_logprobs(TINY, p, plain["tokens"], plain["attention_mask"])  # noqa: E731
    lp_packed = lambda p: packed_logprobs(TINY, p, packed)  # noqa: E731
    return dict(plain=plain, packed=packed, params=params, lp=(lp_plain(params), lp_packed(params)),
                pullback=(pullback(lp_plain), pullback(lp_packed)))


@pytest.mark.parametrize("name", sorted(algos.METHODS))
@pytest.mark.slow
def test_every_method_gives_the_same_loss_and_gradients_packed_as_plain(name, method_inputs):
    """Each method's advantages, keep mask, loss (with its normaliser: token or sequence means,
    Dr.GRPO's constant length, GSPO's sequence ratio, HACPO's cross samples and per-sample
    weights, a KL term) and parameter gradient on the packed batch's [N, C] fields equal those
    on the plain [N, T] batch (gradient accumulation: `test_same_logprobs...` and
    tests/test_train_step.py)."""
    method = algos.METHODS[name]
    extra = {"norm_length": 8} if "norm_length" in method.config.__dataclass_fields__ else {}
    cfg = method.config(kl_coef=0.01, **extra)
    context = algos.method.MethodContext(num_policies=2, group_size=3)
    state = np.array([0.7, 0.4], np.float32) if name == "hacpo" else method.device_state(cfg, method.init_state(cfg, context))

    def prepared(fields):
        batch = LearnerBatch(**fields) if "packed_tokens" in fields else LearnerBatch.loss_only(**fields)
        batch = jax.tree.map(jnp.asarray, batch)
        adv = method.advantages(cfg, batch, state)
        return batch.replace(advantages=adv, loss_mask=batch.loss_mask & method.keep_mask(cfg, batch)[:, None])

    out = []
    for fields, lp, pullback in zip((method_inputs["plain"], method_inputs["packed"]), method_inputs["lp"],
                                    method_inputs["pullback"]):
        batch = prepared(fields)
        (loss, _), d_lp = jax.value_and_grad(lambda x: method.loss(cfg, x, batch), has_aux=True)(lp)
        out.append((batch.advantages, loss, pullback(method_inputs["params"], d_lp)))
    (adv_plain, loss_plain, g_plain), (adv_packed, loss_packed, g_packed) = out
    np.testing.assert_allclose(adv_packed, adv_plain, rtol=1e-6)
    np.testing.assert_allclose(loss_packed, loss_plain, rtol=1e-5, atol=1e-7)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_plain)) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_packed, g_plain)
