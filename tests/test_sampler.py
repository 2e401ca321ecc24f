"""KV-cache sampler: parity with `transformers` generate, log-prob consistency, sampling law,
truncation, determinism, compile reuse across prompt lengths, stacked policies."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from _tiny_models import VOCAB_SIZE, left_padded, make_tiny_torch_model
from jmarl.errors import JmarlError
from jmarl.models import (
    GenerationSpec,
    apply,
    generate,
    generate_stacked,
    init,
    load_hf,
    num_compiled_programs,
    sample_token,
    token_logprobs,
)
from jmarl.models.generation import sampling, static
from jmarl.models.generation.sampling import inverse_cdf_sample
from jmarl.models.generation.static import contiguous_group_size, left_align, unique_prompts

N_NEW = 12


def _prompts(lengths, width, seed=0):
    """Left-padded prompts [B, width] with the given real lengths."""
    return left_padded(lengths, width, VOCAB_SIZE, seed)


_LOADED = {}


def _load(family, tiny_hf_checkpoint):
    if family not in _LOADED:
        config, params = load_hf(tiny_hf_checkpoint(family))
        _LOADED[family] = (family, config, params, make_tiny_torch_model(family))
    return _LOADED[family]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tiny_hf_checkpoint):
    """Both families: for the parity tests against transformers."""
    return _load(request.param, tiny_hf_checkpoint)


@pytest.fixture(scope="module")
def qwen2(tiny_hf_checkpoint):
    """One family: for the tests of sampler mechanics (the model code is shared)."""
    return _load("qwen2", tiny_hf_checkpoint)


def _hf_greedy(model, tokens, mask, n, stop=None):
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
            do_sample=False, max_new_tokens=n, pad_token_id=0,
            eos_token_id=stop, min_new_tokens=0 if stop is not None else n,
        )[:, tokens.shape[1]:].numpy()
    return np.pad(out, ((0, 0), (0, n - out.shape[1])))  # HF stops early when all rows ended


def test_greedy_matches_transformers_with_left_padding_and_stop_token(tiny):
    _, config, params, model = tiny
    tokens, mask = _prompts([9, 4, 7, 1], 9)
    free = generate(config, params, tokens, mask, jax.random.key(0),
                    GenerationSpec(max_new_tokens=N_NEW, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(free.tokens), _hf_greedy(model, tokens, mask, N_NEW))
    assert np.asarray(free.mask).all() and (np.asarray(free.lengths) == N_NEW).all()
    # Stop on the token row 0 emits at step 4 (other rows may or may not emit it).
    stop = int(free.tokens[0, 4])
    out = generate(config, params, tokens, mask, jax.random.key(0),
                   GenerationSpec(max_new_tokens=N_NEW, temperature=0.0, stop_tokens=(stop,), pad_id=0))
    ref = _hf_greedy(model, tokens, mask, N_NEW, stop=stop)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    got_tokens, got_mask, lengths = np.asarray(out.tokens), np.asarray(out.mask), np.asarray(out.lengths)
    assert lengths[0] <= 5 and got_tokens[0, lengths[0] - 1] == stop
    for row in range(len(tokens)):
        hits = np.flatnonzero(np.asarray(free.tokens)[row] == stop)
        expected = hits[0] + 1 if hits.size else N_NEW
        assert lengths[row] == expected
        assert got_mask[row].tolist() == [i < expected for i in range(N_NEW)]
        assert (got_tokens[row, expected:] == 0).all()
        assert (np.asarray(out.logprobs)[row, expected:] == 0).all()
    # Greedy log-probs are taken under temperature 1.
    full = np.concatenate([tokens, got_tokens], 1)
    full_mask = np.concatenate([mask, got_mask], 1)
    rescored = np.asarray(token_logprobs(config, params, full, full_mask, 1.0))[:, tokens.shape[1]:]
    np.testing.assert_allclose(np.asarray(out.logprobs), np.where(got_mask, rescored, 0), atol=1e-4)


def test_continuous_engine_greedy_matches_transformers(tiny):
    """The same parity through `jmarl.models.generation.engine` (2 slots for 4 prompts: refills happen)."""
    from jmarl.models.generation import engine

    _, config, params, model = tiny
    tokens, mask = _prompts([9, 4, 7, 1], 9)
    ref = _hf_greedy(model, tokens, mask, N_NEW)
    prompts = [row[m].tolist() for row, m in zip(tokens, mask)]
    res = engine.run(config, params, prompts, 1, jax.random.key(0),
                     GenerationSpec(max_new_tokens=N_NEW, temperature=0.0, num_slots=2, chunk_steps=4))
    assert res.stats.prefills > 1
    np.testing.assert_array_equal(np.stack([c[0][0] for c in res.completions]), ref)


@pytest.mark.slow
def test_repeated_prompts_share_one_prefill_and_match_transformers(tiny):
    _, config, params, model = tiny
    distinct, distinct_mask = _prompts([6, 3, 5], 6, seed=5)
    rows = np.array([0, 1, 2, 1, 0, 0, 2, 1, 1, 0])  # 3 distinct prompts in 10 rows -> 4-row prefill
    tokens, mask = distinct[rows], distinct_mask[rows]
    _, unique_mask, index = unique_prompts(*left_align(tokens, mask, 8, 0))
    assert unique_mask.shape == (4, 8) and index.shape == (10,)
    out = generate(config, params, tokens, mask, jax.random.key(0),
                   GenerationSpec(max_new_tokens=N_NEW, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(out.tokens), _hf_greedy(model, tokens, mask, N_NEW))
    sampled = generate(config, params, tokens, mask, jax.random.key(3),
                       GenerationSpec(max_new_tokens=N_NEW, temperature=1.0))
    full = np.concatenate([tokens, np.asarray(sampled.tokens)], 1)
    full_mask = np.concatenate([mask, np.asarray(sampled.mask)], 1)
    rescored = np.asarray(token_logprobs(config, params, full, full_mask, 1.0))[:, 6:]
    np.testing.assert_allclose(np.asarray(sampled.logprobs), rescored, atol=1e-4)
    assert len({tuple(r) for r in np.asarray(sampled.tokens)}) > 3  # rows of one prompt still differ


@pytest.mark.slow
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.8)])
def test_sampled_logprobs_equal_rescoring_and_truncation_is_respected(qwen2, top_k, top_p):
    _, config, params, _ = qwen2
    tokens, mask = _prompts([6, 3, 8, 8, 5, 2], 8, seed=1)
    temperature = 0.7
    out = generate(config, params, tokens, mask, jax.random.key(5),
                   GenerationSpec(max_new_tokens=N_NEW, temperature=temperature, top_k=top_k, top_p=top_p))
    full = np.concatenate([tokens, np.asarray(out.tokens)], 1)
    full_mask = np.concatenate([mask, np.asarray(out.mask)], 1)
    # Log-probs are under the untruncated softmax(logits / T): re-scoring reproduces them.
    rescored = np.asarray(token_logprobs(config, params, full, full_mask, temperature))[:, 8:]
    np.testing.assert_allclose(np.asarray(out.logprobs), rescored, atol=1e-4)
    if top_k:
        logits = np.asarray(apply(config, params, full, full_mask))[:, 7:-1] / temperature  # predicts new tokens
        sampled = np.asarray(out.tokens)
        ranks = (logits > np.take_along_axis(logits, sampled[..., None], -1)).sum(-1)
        assert (ranks < top_k).all()  # inside the top k
        order = np.sort(logits, axis=-1)[..., ::-1][..., :top_k]
        probs = np.exp(order - order.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        mass_before = np.cumsum(probs, -1) - probs
        assert (mass_before[np.arange(len(ranks))[:, None], np.arange(N_NEW)[None], ranks] < top_p).all()


def _chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.slow
def test_sampling_distribution_matches_softmax_and_truncation():
    logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3]])
    n = 40000
    batch = jnp.broadcast_to(logits, (n, 8))
    temperature = 0.8

    def draw(**kw):
        fn = jax.jit(lambda lg, key: sample_token(lg, key, jnp.float32(temperature), jnp.float32(kw.get("top_p", 1.0)),
                                                  greedy=False, top_k=kw.get("top_k", 0), use_top_p="top_p" in kw))
        tokens, logprob = fn(batch, jax.random.key(123))  # logits as an argument: no constant folding
        return np.asarray(tokens), np.asarray(logprob)

    p = np.asarray(jax.nn.softmax(logits[0] / temperature), np.float64)
    tokens, logprob = draw()
    counts = np.bincount(tokens, minlength=8)
    assert _chi_square(counts, p) < 24.32  # chi-square, 7 dof, p = 0.001
    np.testing.assert_allclose(logprob, np.log(p)[tokens], rtol=1e-5)
    # top-k = 3 keeps tokens {0, 1, 2}; the kept mass renormalized.
    tokens, logprob = draw(top_k=3)
    counts = np.bincount(tokens, minlength=8)
    assert set(np.flatnonzero(counts)) <= {0, 1, 2}
    kept = p[[0, 1, 2]] / p[[0, 1, 2]].sum()
    assert _chi_square(counts[[0, 1, 2]], kept) < 13.82  # 2 dof
    np.testing.assert_allclose(logprob, np.log(p)[tokens], rtol=1e-5)  # untruncated log-probs
    # top-p = 0.75: sorted probs of the first tokens -> the smallest prefix reaching 0.75.
    order = np.argsort(-p)
    prefix = order[: int(np.searchsorted(np.cumsum(p[order]), 0.75) + 1)]
    tokens, _ = draw(top_p=0.75)
    counts = np.bincount(tokens, minlength=8)
    assert set(np.flatnonzero(counts)) == set(prefix.tolist())
    kept = p[prefix] / p[prefix].sum()
    assert _chi_square(counts[prefix], kept) < 16.27 + 2 * (len(prefix) - 4)  # p = 0.001 for <= 3 dof
    # Inverse-CDF draws never pick a zero-weight entry, even at the ends of [0, 1).
    weights = jnp.asarray(np.tile([0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 1e-30, 0.0, 0.0], (6, 1)), jnp.float32)
    edges = jnp.asarray([0.0, 1e-9, 0.25, 0.5, 1 - 1e-7, np.nextafter(np.float32(1), np.float32(0))], jnp.float32)
    picked = np.asarray(inverse_cdf_sample(weights, edges, block=4))
    assert set(picked.tolist()) <= {2, 4, 7} and picked[0] == 2 and picked[3] == 4
    # Greedy.
    greedy_tokens, greedy_lp = sample_token(batch[:2], jax.random.key(0), jnp.float32(1), jnp.float32(1),
                                            greedy=True, top_k=0, use_top_p=False)
    assert np.asarray(greedy_tokens).tolist() == [0, 0]
    np.testing.assert_allclose(greedy_lp, np.log(np.asarray(jax.nn.softmax(logits[0])))[0], rtol=1e-6)


def _reference_keep(scaled: np.ndarray, weights: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """bool[B,V]: the entries top-k then top-p keep, by sorting the whole vocabulary (the
    sampler's definition before it took candidates with `lax.top_k`), in float64."""
    keep = np.ones(scaled.shape, bool)
    if 0 < top_k < scaled.shape[-1]:
        keep &= scaled >= np.sort(scaled, axis=-1)[:, -top_k][:, None]  # ties with the k-th stay
    if top_p < 1.0:
        w = np.where(keep, weights, 0.0).astype(np.float64)
        descending = -np.sort(-w, axis=-1)
        before = np.cumsum(descending, axis=-1) - descending
        kept = before < top_p * w.sum(-1, keepdims=True)
        threshold = np.where(kept, descending, np.inf).min(-1, keepdims=True)
        keep &= w >= threshold
    return keep


def _truncate(scaled: np.ndarray, top_k: int, top_p: float, candidates: int) -> tuple[np.ndarray, np.ndarray]:
    """(weights exp(scaled - max) float32[B,V], `truncated_weights` of them) from JAX."""
    x = jnp.asarray(scaled, jnp.float32)
    weights = jnp.exp(x - x.max(-1, keepdims=True))
    out = sampling.truncated_weights(x, weights, jnp.float32(top_p), top_k=top_k, use_top_p=top_p < 1.0,
                                        candidates=candidates)
    return np.asarray(weights), np.asarray(out)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.5), (5, 1.0), (5, 0.8), (12, 0.95), (40, 0.6)])
def test_candidate_truncation_equals_full_sort_reference(top_k, top_p):
    """Top-k/top-p from the `lax.top_k` candidates (8 of 64 here) keep exactly the entries the
    full sort keeps, with the kept weights unchanged: peaked rows (the cut inside the
    candidates), flat rows (top_p beyond the candidates' mass: the full-sort fallback) and a row
    with ties at the k-th largest value, in one batch."""
    rng = np.random.default_rng(top_k * 100 + int(top_p * 100))
    peaked = rng.standard_normal((3, 64)) * 4.0
    flat = rng.standard_normal((2, 64)) * 0.05
    ties = np.full((1, 64), -3.0)
    ties[0, :10] = [5.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 3.0, 3.0, 2.0]  # 6 entries tie with the 2nd..7th
    scaled = np.concatenate([peaked, flat, ties]).astype(np.float32)
    weights, got = _truncate(scaled, top_k, top_p, candidates=8)
    keep = _reference_keep(scaled, weights, top_k, top_p)
    np.testing.assert_array_equal(got > 0, keep)
    np.testing.assert_array_equal(got[keep], weights[keep])  # kept weights untouched, renormalized by the draw
    if top_k == 0:  # the flat rows keep more than the candidates: the fallback answered them
        assert (keep[3:5].sum(-1) > 8).all()
    if top_k == 5:  # the top 5 hold the largest and 4 of the 6 entries tied for 2nd: all 6 ties stay
        assert keep[5].sum() == 7 and keep[5, :7].all()


@pytest.mark.slow
def test_top_k_and_top_p_combine_as_before():
    """Top-p applies to the top-k entries' renormalized mass; either alone is what it was."""
    scaled = np.log(np.array([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04] + [0.0] * 58])[:, :64] + 1e-30).astype(np.float32)
    for top_k, top_p, kept in [(0, 0.7, 3), (3, 1.0, 3), (3, 0.7, 2), (4, 0.85, 3), (2, 0.99, 2), (0, 0.99, 6)]:
        _, got = _truncate(scaled, top_k, top_p, candidates=4)
        assert (got[0] > 0).sum() == kept, (top_k, top_p)
        assert (got[0, :kept] > 0).all()


def test_no_full_vocabulary_sort_per_token():
    """With top_k, no sort at all; with top-p alone, the only sort of the vocabulary sits in the
    fallback branch of a `cond`, also under `jax.vmap` over policies (the fallback decided once
    for all of them, not a select that runs both branches)."""
    x = jnp.zeros((4, 64), jnp.float32)

    def fn(top_k, axis_name=None):
        return lambda lg: sampling.truncated_weights(lg, jnp.exp(lg), jnp.float32(0.9), top_k=top_k,
                                                        use_top_p=True, candidates=8, axis_name=axis_name)

    def primitives(jaxpr):
        return [e.primitive.name for e in jaxpr.jaxpr.eqns]

    def sorts_anywhere(jaxpr) -> bool:  # in the program or any sub-program (a cond's branches)
        return re.search(r"\bsort\[", str(jaxpr)) is not None

    assert not sorts_anywhere(jax.make_jaxpr(fn(5))(x))
    top = primitives(jax.make_jaxpr(fn(0))(x))
    assert "sort" not in top and "cond" in top and sorts_anywhere(jax.make_jaxpr(fn(0))(x))
    stacked = primitives(jax.make_jaxpr(jax.vmap(fn(0, "policy"), axis_name="policy"))(jnp.stack([x, x])))
    assert "sort" not in stacked and "cond" in stacked
    # Compiled: XLA keeps `lax.top_k` as a top-k (the k-th value read as a slice [:, -1:] of its
    # values instead turned it into a sort of the whole vocabulary, 50x slower at V = 152k).
    for top_k, use_top_p in ((5, True), (5, False)):
        compiled = jax.jit(lambda lg: sampling.truncated_weights(
            lg, jnp.exp(lg), jnp.float32(0.9), top_k=top_k, use_top_p=use_top_p, candidates=8)).lower(x).compile()
        assert re.search(r"= \S+ sort\(", compiled.as_text()) is None, (top_k, use_top_p)


@pytest.mark.slow
def test_sample_token_with_a_large_vocabulary_draws_as_the_full_sort_did():
    """Above TOP_P_CANDIDATES entries, the same key draws the same token as inverse-CDF sampling
    of the full-sort reference weights (peaked and flat rows; top-p alone and with top-k)."""
    v = sampling.TOP_P_CANDIDATES * 2 + 3
    rng = np.random.default_rng(7)
    logits = np.concatenate([rng.standard_normal((6, v)) * 6.0, rng.standard_normal((2, v)) * 0.1]).astype(np.float32)
    temperature = 0.9
    for top_k, top_p in [(0, 0.9), (50, 0.9), (0, 0.999)]:
        key = jax.random.key(top_k + 1)
        fn = jax.jit(lambda lg, k: sample_token(lg, k, jnp.float32(temperature), jnp.float32(top_p), greedy=False,
                                                top_k=top_k, use_top_p=True))
        tokens, _ = fn(jnp.asarray(logits), key)
        scaled = jnp.asarray(logits) / temperature
        weights = np.asarray(jnp.exp(scaled - scaled.max(-1, keepdims=True)))
        keep = _reference_keep(np.asarray(scaled), weights, top_k, top_p)
        if top_k == 0:
            assert keep[6:].sum(-1).min() > sampling.TOP_P_CANDIDATES  # flat rows: the fallback's case
        want = inverse_cdf_sample(jnp.asarray(np.where(keep, weights, 0.0)), jax.random.uniform(key, (8,)))
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
        assert keep[np.arange(8), np.asarray(tokens)].all()


def test_same_rng_same_output_and_padding_side_does_not_matter(qwen2):
    _, config, params, _ = qwen2
    tokens, mask = _prompts([5, 2, 7], 7, seed=2)
    kw = dict(max_new_tokens=N_NEW, temperature=1.0)
    a = generate(config, params, tokens, mask, jax.random.key(7), GenerationSpec(**kw))
    b = generate(config, params, tokens, mask, jax.random.key(7), GenerationSpec(**kw))
    c = generate(config, params, tokens, mask, jax.random.key(8), GenerationSpec(**kw))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    # The same prompts right-padded (and with extra pad columns) give the same result.
    right = np.zeros((3, 10), np.int64)
    right_mask = np.zeros((3, 10), bool)
    for i in range(3):
        n = mask[i].sum()
        right[i, :n] = tokens[i, mask[i]]
        right_mask[i, :n] = True
    d = generate(config, params, right, right_mask, jax.random.key(7), GenerationSpec(**kw))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(d.tokens))


def test_left_align():
    tokens = np.array([[5, 6, 0, 0], [0, 7, 8, 9], [1, 0, 2, 0]])
    mask = tokens > 0
    out, out_mask = left_align(tokens, mask, 5, pad_id=0)
    assert out.tolist() == [[0, 0, 0, 5, 6], [0, 0, 7, 8, 9], [0, 0, 0, 1, 2]]
    assert out_mask.tolist() == (out > 0).tolist()


@pytest.mark.slow
def test_varied_prompt_lengths_reuse_bucketed_programs(qwen2):
    _, config, params, _ = qwen2
    buckets = (8, 16, 32)
    rng = np.random.default_rng(0)
    before = num_compiled_programs()
    used = set()
    for i in range(20):
        lengths = rng.integers(1, 31, size=4)
        width = int(lengths.max()) + int(rng.integers(0, 3))
        tokens, mask = _prompts(lengths, width, seed=i)
        out = generate(config, params, tokens, mask, jax.random.key(i),
                       GenerationSpec(max_new_tokens=4, temperature=1.0, buckets=buckets))
        assert out.tokens.shape == (4, 4)
        used.add(min(b for b in buckets if b >= lengths.max()))
    assert num_compiled_programs() - before <= len(used) <= len(buckets)


@pytest.mark.slow
def test_stacked_policies_equal_separate_calls(qwen2):
    _, config, params, _ = qwen2
    other = init(config, jax.random.key(11))
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, other)
    t0, m0 = _prompts([4, 6, 2], 6, seed=3)
    t1, m1 = _prompts([6, 1, 5], 6, seed=4)
    tokens, mask = np.stack([t0, t1]), np.stack([m0, m1])
    # Each policy sees two prompts, each twice (the prefill is shared across repeats).
    tokens = np.stack([t0[[0, 2, 2, 0]], t1[[0, 1, 0, 1]]])
    mask = np.stack([m0[[0, 2, 2, 0]], m1[[0, 1, 0, 1]]])
    assert unique_prompts(*left_align(tokens, mask, 8, 0))[2].shape == (2, 4)  # shared prefill in use
    rng = jax.random.key(21)
    kw = dict(max_new_tokens=N_NEW, temperature=0.9, stop_tokens=(5, 6, 7))
    both = generate_stacked(config, stacked, tokens, mask, rng, GenerationSpec(**kw))
    assert both.tokens.shape == (2, 4, N_NEW) and both.lengths.shape == (2, 4)
    for p, single_params in enumerate([params, other]):
        alone = generate(config, single_params, tokens[p], mask[p], jax.random.fold_in(rng, p), GenerationSpec(**kw))
        for field in ("tokens", "mask", "lengths"):
            np.testing.assert_array_equal(np.asarray(getattr(both, field)[p]), np.asarray(getattr(alone, field)))
        np.testing.assert_allclose(np.asarray(both.logprobs[p]), np.asarray(alone.logprobs), atol=1e-5)


@pytest.mark.slow
def test_stacked_policy_that_finishes_first_waits_correctly(qwen2):
    """One loop condition for all policies: a policy whose rows all stopped keeps padding while
    the other decodes on, and each still equals its separate call."""
    _, config, params, _ = qwen2
    other = init(config, jax.random.key(12))
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, other)
    t0, m0 = _prompts([4, 6, 2, 5], 6, seed=5)
    tokens, mask = np.stack([t0, t0]), np.stack([m0, m0])
    first = generate(config, params, t0, m0, jax.random.key(0), GenerationSpec(max_new_tokens=1, temperature=0.0))
    stops = tuple(sorted({int(t) for t in np.asarray(first.tokens)[:, 0]}))  # policy 0 stops at once
    kw = dict(max_new_tokens=N_NEW, temperature=0.0, stop_tokens=stops)
    both = generate_stacked(config, stacked, tokens, mask, jax.random.key(1), GenerationSpec(**kw))
    lengths = np.asarray(both.lengths)
    assert lengths[0].max() == 1 and lengths[1].max() > 1
    for p, single_params in enumerate([params, other]):
        alone = generate(config, single_params, tokens[p], mask[p], jax.random.fold_in(jax.random.key(1), p),
                         GenerationSpec(**kw))
        for field in ("tokens", "mask", "lengths"):
            np.testing.assert_array_equal(np.asarray(getattr(both, field)[p]), np.asarray(getattr(alone, field)))


@pytest.mark.slow
def test_one_policy_of_a_stack_equals_its_stacked_rows(qwen2):
    """generate(stacked params, policy=p) decodes only policy p's rows, with the key the stacked
    call gives it: the same tokens and log-probs as policy p's rows of generate_stacked."""
    _, config, params, _ = qwen2
    other = init(config, jax.random.key(13))
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, other)
    t0, m0 = _prompts([4, 6, 2, 5], 6, seed=6)
    t1, m1 = _prompts([3, 6, 6, 1], 6, seed=7)
    tokens, mask = np.stack([t0, t1]), np.stack([m0, m1])
    kw = dict(max_new_tokens=N_NEW, temperature=0.8, stop_tokens=(5, 6))
    both = generate_stacked(config, stacked, tokens, mask, jax.random.key(2), GenerationSpec(**kw))
    for p in (0, 1):
        one = generate(config, stacked, tokens[p], mask[p], jax.random.key(2), GenerationSpec(**kw), policy=p)
        for field in ("tokens", "mask", "lengths"):
            np.testing.assert_array_equal(np.asarray(getattr(one, field)), np.asarray(getattr(both, field)[p]))
        np.testing.assert_allclose(np.asarray(one.logprobs), np.asarray(both.logprobs[p]), atol=1e-5)


def test_contiguous_group_size():
    t = np.array([[1, 2], [1, 2], [3, 4], [3, 4]])
    m = np.ones_like(t, bool)
    assert contiguous_group_size(t, m) == 2
    assert contiguous_group_size(t[[0, 2, 1, 3]], m) == 1  # repeated, but not consecutive
    assert contiguous_group_size(t[:3], m[:3]) == 1  # 3 rows do not split into blocks of 2
    assert contiguous_group_size(np.stack([t, t]), np.stack([m, m])) == 2  # [P, B, S]
    other = t.copy()
    other[3] = [5, 6]
    assert contiguous_group_size(np.stack([t, other]), np.stack([m, m])) == 1  # one policy breaks it
    masked = m.copy()
    masked[1, 0] = False  # same ids, different mask: not the same prompt
    assert contiguous_group_size(t, masked) == 1
    assert contiguous_group_size(t[:1], m[:1]) == 1
    idle = np.zeros_like(t)  # a stacked policy with no requests: all padding rows
    assert contiguous_group_size(np.stack([idle, t]), np.stack([np.zeros_like(m), m])) == 2


@pytest.mark.slow
def test_grouped_prompt_cache_equals_per_row_cache(qwen2, monkeypatch):
    """Groups of consecutive identical prompts keep one prompt cache per group; sampling gives
    the same tokens and log-probs as the per-row cache (same randomness per row), and greedy
    decoding equals the interleaved batch that cannot use groups."""
    _, config, params, _ = qwen2
    t, m = _prompts([5, 2, 7], 8, seed=6)
    tokens, mask = np.repeat(t, 4, axis=0), np.repeat(m, 4, axis=0)  # B = 12, G = 4
    kw = dict(max_new_tokens=N_NEW, temperature=0.9, stop_tokens=tuple(range(5, 25)))
    grouped = generate(config, params, tokens, mask, jax.random.key(3), GenerationSpec(**kw))
    calls = []
    monkeypatch.setattr(static, "contiguous_group_size", lambda *a: calls.append(1) or 1)
    per_row = generate(config, params, tokens, mask, jax.random.key(3), GenerationSpec(**kw))
    assert calls  # the second call really took the per-row path
    for field in ("tokens", "mask", "lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(grouped, field)), np.asarray(getattr(per_row, field)))
    np.testing.assert_allclose(np.asarray(grouped.logprobs), np.asarray(per_row.logprobs), atol=1e-5)
    assert len(set(np.asarray(grouped.lengths).tolist())) > 1  # some rows stopped early
    monkeypatch.undo()
    order = np.arange(12).reshape(3, 4).T.reshape(-1)  # interleaved: p0 p1 p2 p0 ...
    greedy = dict(max_new_tokens=N_NEW, temperature=0.0)
    a = generate(config, params, tokens, mask, jax.random.key(0), GenerationSpec(**greedy))
    b = generate(config, params, tokens[order], mask[order], jax.random.key(0), GenerationSpec(**greedy))
    np.testing.assert_array_equal(np.asarray(a.tokens)[order], np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs)[order], np.asarray(b.logprobs), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("n_new", [N_NEW, N_NEW + 1])  # blocks of 6 + 5 and 6 + 6 generated slots
def test_two_phase_decode_equals_one_phase(qwen2, monkeypatch, n_new):
    """The decode loop in two phases over two cache blocks gives the same tokens and log-probs
    as one phase over one cache: grouped prompts (shared prompt cache) and distinct prompts, with
    rows that stop in the first phase, and stacked policies."""
    _, config, params, _ = qwen2
    t, m = _prompts([5, 2, 7], 8, seed=6)
    grouped = (np.repeat(t, 4, axis=0), np.repeat(m, 4, axis=0))
    kw = dict(max_new_tokens=n_new, temperature=0.9, stop_tokens=tuple(range(5, 25)))

    def run(two_phases_from):
        monkeypatch.setattr(static, "TWO_PHASES_FROM", two_phases_from)
        out = [generate(config, params, tokens, mask, jax.random.key(3),
                        GenerationSpec(**kw)) for tokens, mask in (grouped, (t, m))]
        stacked_params = jax.tree.map(lambda a: jnp.stack([a, a * 1.01]), params)
        out.append(generate_stacked(config, stacked_params, np.stack([t, t]), np.stack([m, m]), jax.random.key(4),
                                    GenerationSpec(**kw)))
        return out

    assert static.first_phase_slots(n_new - 1) == 0  # the default: one phase at these lengths
    one, two = run(10**9), run(4)
    assert static.first_phase_slots(n_new - 1) == 6
    for a, b in zip(one, two):
        for field in ("tokens", "mask", "lengths"):
            np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)))
        np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)
    lengths = np.asarray(one[0].lengths)
    assert lengths.min() <= 6 < lengths.max()  # some rows stop in the first phase, some run into the second


@pytest.mark.parametrize("use_dot", [True, False])
def test_prefixed_cached_attention_equals_one_softmax_over_prompt_and_own_keys(use_dot):
    """Both implementations (matrix products; CPU multiply-sum) equal a NumPy softmax over the
    concatenated [prompt keys, own keys] of each row, with masked slots in both blocks and one
    row whose own cache is entirely masked."""
    from jmarl.models.cached_attention import prefixed_cached_attention

    rng = np.random.default_rng(0)
    u, g, h, kv, hd, s, c = 3, 2, 4, 2, 8, 5, 6
    b = u * g
    q = rng.standard_normal((b, 1, h, hd)).astype(np.float32)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    pk, pv = normal(u, kv, hd, s), normal(u, kv, s, hd)
    k, v = normal(b, kv, hd, c), normal(b, kv, c, hd)
    pmask = np.ones((u, s), bool)
    pmask[1, :2] = False  # a left-padded prompt
    kmask = np.arange(c)[None, :] < np.array([3, 1, 6, 2, 0, 4])[:, None]  # row 4: no own keys yet
    got = np.asarray(prefixed_cached_attention(q, pk, pv, pmask, k, v, kmask, use_dot=use_dot))
    want = np.zeros_like(got)
    for row in range(b):
        for head in range(h):
            j, p = head // (h // kv), row // g
            keys = np.concatenate([pk[p, j].T, k[row, j].T])  # [S + C, hd]
            vals = np.concatenate([pv[p, j], v[row, j]])
            scores = keys @ q[row, 0, head] / np.sqrt(hd)
            scores = np.where(np.concatenate([pmask[p], kmask[row]]), scores, -np.inf)
            weights = np.exp(scores - scores.max())
            want[row, 0, head] = weights @ vals / weights.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_options_raise(qwen2):
    _, config, params, _ = qwen2
    tokens, mask = _prompts([3], 3)
    key = jax.random.key(0)
    with pytest.raises(JmarlError, match="max_new_tokens"):
        generate(config, params, tokens, mask, key, GenerationSpec(max_new_tokens=0))
    with pytest.raises(JmarlError, match="top_p"):
        generate(config, params, tokens, mask, key, GenerationSpec(max_new_tokens=2, top_p=0.0))
    with pytest.raises(JmarlError, match="temperature"):
        generate(config, params, tokens, mask, key, GenerationSpec(max_new_tokens=2, temperature=-1.0))
    with pytest.raises(JmarlError, match=r"\[B, S\]"):
        generate(config, params, tokens[0], mask[0], key, GenerationSpec(max_new_tokens=2))
    with pytest.raises(JmarlError, match="vocabulary"):
        generate(config, params, tokens + VOCAB_SIZE, mask, key, GenerationSpec(max_new_tokens=2))
