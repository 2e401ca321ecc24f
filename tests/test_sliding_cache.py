"""The windowed KV cache of sliding-window layers (Gemma 3): on those layers the static sampler
and the continuous engine keep only the last W positions (rings of min(C, W) slots, prompt
blocks cut to their last min(S, W) slots), the full layers every position. Checked on a tiny
random Gemma 3 with a 4-token window: generation far past the window (one and two decode
phases, a GRPO group's shared prompt cache, stacked policies, the engine with its slots
refilled, on one device and on a mesh) gives the log-probs and greedy tokens of full
recomputation (`apply`: dense per-position attention with the window mask, itself checked
against transformers in test_gemma3.py, whose generation tests now run the windowed cache too),
for left-padded prompts shorter and longer than the window; the buffers have the window's
capacity; the engine's budget holds more slots."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tiny_models import left_padded
from jmarl.models import GenerationSpec, ModelConfig, apply, generate, generate_stacked, init
from jmarl.models.generation import budget, engine, engine_programs, static
from jmarl.models.kv_cache import empty_cache, layer_capacities

W = 4
VOCAB = 64
# sliding first and last (the prefill's last layer is a sliding one), one full layer between
CONFIG = ModelConfig(
    model_type="gemma3_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=2,
    num_kv_heads=1, head_dim=16, sliding_window=W,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=16, tie_word_embeddings=True)
LENGTHS = [9, 2, 6, 1, 4]  # prompts longer and shorter than the window, one of exactly W
WIDTH = 9
N_NEW = 12  # generated tokens: three windows past the prompt


@functools.lru_cache(maxsize=None)
def _params():
    """Random weights scaled up (x8) so attention is far from uniform: dropping the window moves
    the log-probs by over half a nat (checked below), so a wrong mask cannot pass unseen."""
    params = init(CONFIG, jax.random.key(0))
    return jax.tree.map(lambda a: a * 8 if a.ndim >= 2 else a, params)


REF_ROWS, REF_WIDTH = 12, WIDTH + 36  # every reference batch padded to one shape: one compile per config


@functools.partial(jax.jit, static_argnums=0)
def _reference(config, params, tokens, mask):
    """Full recomputation over tokens/mask [R, T] (`apply`: dense attention with each sliding
    layer's window mask): (float32 logits [R,T,V], log-prob of each token under the logits of
    the slot before it [R,T], column t for token t)."""
    logits = apply(config, params, tokens, mask)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return logits, jnp.pad(picked, ((0, 0), (1, 0)))


def _check(prompts, completions, logprobs, greedy: bool, config=CONFIG, params=None, check=True) -> np.ndarray:
    """Each completion's log-probs (completions[i], logprobs[i]: 1-D, after prompts[i]) equal full
    recomputation's; greedy: each token is the argmax of the recomputed logits before it
    (teacher-forced). Returns the recomputed log-probs [R, REF_WIDTH - WIDTH] of the completions
    (check False: only that)."""
    tokens = np.zeros((REF_ROWS, REF_WIDTH), np.int32)
    mask = np.zeros((REF_ROWS, REF_WIDTH), bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):  # prompt left-padded to WIDTH, completion after
        tokens[i, WIDTH - len(p):WIDTH + len(c)] = list(p) + list(c)
        mask[i, WIDTH - len(p):WIDTH + len(c)] = True
    logits, ref = (np.asarray(a) for a in _reference(config, _params() if params is None else params,
                                                      jnp.asarray(tokens), jnp.asarray(mask)))
    for i, (c, lp) in enumerate(zip(completions, logprobs) if check else ()):
        np.testing.assert_allclose(lp, ref[i, WIDTH:WIDTH + len(c)], atol=2e-5, err_msg=f"row {i}")
        if greedy:
            np.testing.assert_array_equal(c, logits[i, WIDTH - 1:WIDTH - 1 + len(c)].argmax(-1), err_msg=f"row {i}")
    return ref[:len(completions), WIDTH:]


def _check_static(out, tokens, mask, greedy: bool, **kwargs) -> np.ndarray:
    """`_check` of a static `Generation` for the left-padded prompts tokens/mask [B, WIDTH]."""
    n = np.asarray(out.lengths)
    prompts = [row[m] for row, m in zip(tokens, mask)]
    completions = [row[:k] for row, k in zip(np.asarray(out.tokens), n)]
    return _check(prompts, completions, [row[:k] for row, k in zip(np.asarray(out.logprobs), n)], greedy, **kwargs)


def test_buffers_hold_the_window_on_sliding_layers_only():
    assert layer_capacities(CONFIG, 20) == (20, 20, 20)
    assert layer_capacities(CONFIG, 20, windowed=True) == (W, 20, W)
    assert layer_capacities(CONFIG, 3, windowed=True) == (3, 3, 3)  # shorter than the window: all of it
    cache = jax.eval_shape(lambda: static._empty_cache(CONFIG, (5,), WIDTH + N_NEW - 1))
    assert [k.shape for k in cache.keys] == [(5, 1, 16, W), (5, 1, 16, 20), (5, 1, 16, W)]
    assert [v.shape for v in cache.values] == [(5, 1, W, 16), (5, 1, 20, 16), (5, 1, W, 16)]
    assert cache.capacity == 20 and cache.capacities == (W, 20, W)
    state = jax.eval_shape(lambda: engine_programs.empty_state(CONFIG, 4, 2, 16, N_NEW))
    assert state.cache.capacities == (W, N_NEW - 1, W)  # the slots' generated tokens
    assert state.pool.cache.capacities == (W, 16, W)  # the prompts' last W slots
    assert empty_cache(CONFIG, (2,), 20).capacities == (20, 20, 20)  # the default keeps every slot


@pytest.mark.slow
def test_static_sampler_equals_full_recomputation_past_the_window():
    tokens, mask = left_padded(LENGTHS, WIDTH, VOCAB, seed=1)
    # greedy, one decode phase
    out = generate(CONFIG, _params(), tokens, mask, jax.random.key(1),
                   GenerationSpec(max_new_tokens=N_NEW, temperature=0.0))
    assert np.asarray(out.lengths).min() == N_NEW
    _check_static(out, tokens, mask, greedy=True)
    # sampled, two decode phases (35 generated slots), repeated prompts in no group order: each
    # distinct prompt prefilled once and copied to its rows (`unique_prompts`' rows)
    rows = np.array([0, 1, 2, 3, 0, 1, 2, 3, 4, 0])
    assert static.unique_prompts(tokens[rows], mask[rows])[2] is not None
    out = generate(CONFIG, _params(), tokens[rows], mask[rows], jax.random.key(2),
                   GenerationSpec(max_new_tokens=36, temperature=1.0))
    rescored = _check_static(out, tokens[rows], mask[rows], greedy=False)
    # the window matters here: without it the same tokens score very differently
    wide = _check_static(out, tokens[rows], mask[rows], greedy=False, config=CONFIG.replace(sliding_window=64),
                         check=False)
    assert np.abs(wide - rescored).max() > 0.5


@pytest.mark.slow
def test_static_sampler_with_shared_prompt_caches_equals_full_recomputation():
    """Groups of consecutive rows read one prompt cache per group (its last W slots on the
    sliding layers) in both decode phases."""
    tokens, mask = left_padded(LENGTHS[:4], WIDTH, VOCAB, seed=2)
    rows = np.repeat(np.arange(4), 2)
    out = generate(CONFIG, _params(), tokens[rows], mask[rows], jax.random.key(3),
                   GenerationSpec(max_new_tokens=36, temperature=1.0))
    _check_static(out, tokens[rows], mask[rows], greedy=False)


@pytest.mark.slow
def test_stacked_policies_equal_full_recomputation():
    tokens, mask = left_padded(LENGTHS[:4], WIDTH, VOCAB, seed=3)
    other = jax.tree.map(lambda a: a * 1.1, _params())
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), _params(), other)
    out = generate_stacked(CONFIG, stacked, np.stack([tokens, tokens]), np.stack([mask, mask]), jax.random.key(4),
                           GenerationSpec(max_new_tokens=N_NEW, temperature=1.0))
    for p, params in enumerate((_params(), other)):
        _check_static(jax.tree.map(lambda a, p=p: a[p], out), tokens, mask, greedy=False, params=params)


def _check_engine(result, prompts, greedy: bool):
    """`_check` of every completion of an engine run."""
    rows = [(prompts[r], toks, lps) for r, comps in enumerate(result.completions) for toks, lps in comps]
    _check(*zip(*rows), greedy=greedy)


@pytest.mark.slow
def test_continuous_engine_equals_full_recomputation_with_slots_refilled():
    tokens, mask = left_padded(LENGTHS, WIDTH, VOCAB, seed=4)
    prompts = [row[m].tolist() for row, m in zip(tokens, mask)]
    limits = [N_NEW, 5, N_NEW, 9, N_NEW]  # completions end at different steps: slots refilled mid-run
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=1.0, num_slots=2, chunk_steps=3,
                          buckets=(WIDTH,))
    result = engine.run(CONFIG, _params(), prompts, 2, jax.random.key(5), spec, limits=limits)
    assert result.stats.fused == 0 and result.stats.chunks > 3 and result.stats.rows == 10
    assert [len(c[0][0]) for c in result.completions] == limits
    _check_engine(result, prompts, greedy=False)
    # every completion fits the slots at once: one fused program (the aligned drain), greedy
    greedy = GenerationSpec(max_new_tokens=N_NEW, temperature=0.0, buckets=(WIDTH,))
    result = engine.run(CONFIG, _params(), prompts, 2, jax.random.key(6), greedy)
    assert result.stats.fused == 1
    _check_engine(result, prompts, greedy=True)


@pytest.mark.slow
def test_continuous_engine_on_a_mesh_equals_full_recomputation(mesh):
    tokens, mask = left_padded(LENGTHS[:4], WIDTH, VOCAB, seed=5)
    prompts = [row[m].tolist() for row, m in zip(tokens, mask)]
    spec = GenerationSpec(max_new_tokens=N_NEW, temperature=0.0, num_slots=4, chunk_steps=4, buckets=(WIDTH,),
                          mesh=mesh(data=2), shrink=False)
    result = engine.run(CONFIG, _params(), prompts, 2, jax.random.key(7), spec, limits=[N_NEW, 6, N_NEW, 8])
    assert result.stats.slots_per_device == 2 and result.stats.fused == 0
    _check_engine(result, prompts, greedy=True)


def test_engine_budget_holds_more_slots_with_the_window():
    """A slot and a pool entry cost the window's bytes on the sliding layers, so the same budget
    holds more slots than a cache of every position would (that of the same model without a
    window), and the planned slots follow."""
    full = CONFIG.replace(sliding_window=None)  # the same shapes, every position on every layer
    p, n = 64, 257
    assert budget.slot_bytes(CONFIG, n) == budget.kv_bytes(CONFIG, n - 1, windowed=True)
    per_token = 2 * CONFIG.num_kv_heads * CONFIG.head_dim * 4  # keys and values, float32
    assert budget.slot_bytes(CONFIG, n) == per_token * (2 * W + (n - 1))
    assert budget.slot_bytes(full, n) == per_token * 3 * (n - 1)
    assert budget.entry_bytes(CONFIG, p) == per_token * (2 * W + p) + 4 * VOCAB
    kv_budget = budget.engine_bytes(full, 16, budget.entries_for(16, 4), p, n)
    before, _ = budget.slots_for_budget(full, p, n, kv_budget, rows=1024, share=4)
    after, _ = budget.slots_for_budget(CONFIG, p, n, kv_budget, rows=1024, share=4)
    assert before == 16 and after == 32
    spec = GenerationSpec(max_new_tokens=n, kv_budget_bytes=kv_budget)
    assert budget.planned_slots(CONFIG, p, 1024, 4, spec)[0] == after


@pytest.mark.slow
def test_a_window_of_one_token():
    """A sliding layer that sees only its own token: rings of one slot, the prompts' blocks
    never read."""
    config = CONFIG.replace(sliding_window=1)
    tokens, mask = left_padded([9, 1], WIDTH, VOCAB, seed=6)
    out = generate(config, _params(), tokens, mask, jax.random.key(8),
                   GenerationSpec(max_new_tokens=6, temperature=1.0))
    _check_static(out, tokens, mask, greedy=False, config=config)
