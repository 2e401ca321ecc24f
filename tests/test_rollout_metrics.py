"""Per-step rollout metrics: completion lengths and truncation per policy (`rollout_length_metrics`
on hand-made sample records of known lengths) and the sampler's rollout/decode_utilization (static
sampler and continuous engine on a tiny model, against the positions their decode loops ran)."""

import types
import warnings

import jax
import numpy as np
import pytest

from _tiny_models import tiny_qwen3
from jmarl import models
from jmarl.train.metrics import figure_of, rollout_length_metrics
from jmarl.train.policies import PolicyGroup, PolicySet, stack
from jmarl.config import SamplingConfig
from jmarl.train.sampling import ModelSampler, PromptTruncatedWarning, encode_prompts_full
from jmarl.workflows.base import Completion, SampleRecord

PROMPT = [2, 40, 41]  # every sample's prompt (3 tokens)


def _records(samples):
    """Sample records of (policy, source_policy, completion tokens) samples, each prompted with PROMPT."""
    return [SampleRecord(prompt="", completion=Completion(text="", prompt_tokens=np.asarray(PROMPT, np.int32),
                                                          completion_tokens=np.asarray(comp, np.int32),
                                                          logprobs=np.zeros(len(comp), np.float32)),
                         reward=0.0, group=i, env=0, turn=0, agent=0, policy=p, source_policy=src)
            for i, (p, src, comp) in enumerate(samples)]


SOLVER_EOS, CRITIC_EOS = 1, 7
SAMPLES = [
    # solver (policy 0, stop token 1)
    (0, 0, [5, 6, 1]),  # 3, stopped
    (0, 0, [5, 6, 5, 6, 5, 6, 5, 6]),  # 8 = max_new_tokens, no stop token: truncated
    (0, 0, [5, 6, 5, 6, 5, 6, 5, 1]),  # 8, its stop token is the 8th: not truncated
    (0, 0, [1]),  # 1, stopped at once
    # critic (policy 1, stop token 7)
    (1, 1, [3, 7]),  # 2
    (1, 1, [3, 3, 3, 7]),  # 4
    (1, 1, [3, 3, 3, 3, 7]),  # 5
    (1, 1, [3, 3, 3, 3, 3, 3, 3, 1]),  # 8, ends in the solver's stop token, not its own: truncated
    # a cross sample (solver learns from a critic completion, re-tokenised): not a generation
    (0, 1, [9] * 11),
]


def test_lengths_and_truncation_per_policy_and_overall():
    r = _records(SAMPLES)
    got = rollout_length_metrics(r, ("solver", "critic"), max_new_tokens=8, eos_ids=(SOLVER_EOS, CRITIC_EOS))
    # all 8 generations: lengths 3 8 8 1 | 2 4 5 8 -> sorted 1 2 3 4 5 8 8 8; p90 at index 0.9 * 7 = 6.3: 8
    # solver 1 3 8 8: p90 at index 2.7 -> 8; critic 2 4 5 8: p90 at 2.7 -> 5 + 0.7 * (8 - 5) = 7.1
    expected = {
        "rollout/completion_length_mean": 39 / 8, "rollout/completion_length_p90": 8.0,
        "rollout/completion_length_max": 8.0, "rollout/truncated_fraction": 2 / 8,
        "rollout/solver/completion_length_mean": 5.0, "rollout/solver/completion_length_p90": 8.0,
        "rollout/solver/completion_length_max": 8.0, "rollout/solver/truncated_fraction": 1 / 4,
        "rollout/critic/completion_length_mean": 19 / 4, "rollout/critic/completion_length_p90": 7.1,
        "rollout/critic/completion_length_max": 8.0, "rollout/critic/truncated_fraction": 1 / 4,
    }
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=0), key
    assert all(isinstance(v, float) for v in got.values())
    # without stop tokens: the proxy length >= max_new_tokens (the solver's eos at the budget counts too)
    proxy = rollout_length_metrics(r, ("solver", "critic"), max_new_tokens=8)
    assert proxy["rollout/truncated_fraction"] == 3 / 8 and proxy["rollout/solver/truncated_fraction"] == 2 / 4
    assert proxy["rollout/critic/truncated_fraction"] == 1 / 4
    # a None stop token: that policy falls back to the proxy
    mixed = rollout_length_metrics(r, ("solver", "critic"), max_new_tokens=8, eos_ids=(None, CRITIC_EOS))
    assert mixed["rollout/solver/truncated_fraction"] == 2 / 4 and mixed["rollout/critic/truncated_fraction"] == 1 / 4
    # the new keys are drawn with the other rollout metrics (plots by family; *_fraction as %)
    assert {figure_of(k) for k in got} == {"rollout"}


def test_one_policy_interpolated_p90_and_no_per_policy_keys():
    lengths = [2, 4, 6, 8, 10, 16]  # p90 at index 0.9 * 5 = 4.5: (10 + 16) / 2 = 13
    r = _records([(0, 0, [5] * k) for k in lengths])
    got = rollout_length_metrics(r, ("policy",), max_new_tokens=16, eos_ids=(1,))
    assert got == {"rollout/completion_length_mean": 46 / 6, "rollout/completion_length_p90": 13.0,
                   "rollout/completion_length_max": 16.0, "rollout/truncated_fraction": 1 / 6}


def test_a_policy_without_generations_gets_no_keys_and_none_at_all_gives_empty():
    r = _records([(0, 0, [5, 1]), (0, 0, [5, 5, 1])])
    got = rollout_length_metrics(r, ("a", "b"), max_new_tokens=4, eos_ids=(1, 1))
    assert "rollout/b/completion_length_mean" not in got and got["rollout/a/completion_length_mean"] == 2.5
    assert got["rollout/truncated_fraction"] == 0.0
    only_cross = _records([(1, 0, [5, 1])])
    assert rollout_length_metrics(only_cross, ("a", "b"), max_new_tokens=4) == {}


# ---- rollout/decode_utilization from the sampler's own counters ------------------------------------

TINY = tiny_qwen3(vocab_size=99)  # the CharTokenizer's vocabulary
N_NEW = 8


def _policies(eos_id: int) -> PolicySet:
    tok = models.CharTokenizer()
    tok.eos_id = eos_id
    params = stack([models.init(TINY, jax.random.key(0)), models.init(TINY, jax.random.key(1))])
    group = PolicyGroup(name="g", model_config=TINY, tokenizer=tok, policy_ids=(0, 1), stacked=True, lora_rank=None,
                        lora_alpha=1.0, base=None, state=types.SimpleNamespace(params=params), ref=None)
    return PolicySet(policy_names=("a", "b"), agent_policy=(0, 1), groups=[group])


@pytest.mark.slow
def test_decode_utilization_counts_token_positions_of_both_engines():
    """Greedy, two requests of policy 0 with a stop token that ends one completion early and not
    the other: both engines decode 2 rows until the longest one (N_NEW) ends, so both report
    (L1 + L2) / (2 x N_NEW); the static sampler with 3 requests pads to 4 rows, all decoding
    N_NEW positions. The engine's row_utilization stays 1.0."""
    prompts = ["hi", "hello there"]
    settings = dict(max_new_tokens=N_NEW, temperature=0.0)
    free = ModelSampler(_policies(eos_id=0), SamplingConfig(**settings))  # pad: never sampled greedily here
    long_a, long_b = (c[0].completion_tokens for c in free.sample([(0, p) for p in prompts], 1, jax.random.key(0)))
    assert len(long_a) == len(long_b) == N_NEW
    # a stop token that ends the first completion early but never occurs in the second
    stop = next(int(t) for t in long_a[1:N_NEW - 1] if int(t) not in long_b.tolist())
    policies = _policies(eos_id=stop)
    static = ModelSampler(policies, SamplingConfig(**settings))
    cont = ModelSampler(policies, SamplingConfig(**settings, engine="continuous", kv_budget_bytes=1 << 20,
                                                 engine_chunk_steps=3))
    lengths = []
    for sampler in (static, cont):
        got = sampler.sample([(0, p) for p in prompts], 1, jax.random.key(0))
        lengths.append([len(c[0].completion_tokens) for c in got])
    assert lengths[0] == lengths[1] and lengths[0][0] < N_NEW == lengths[0][1]
    s, c = static.take_stats(), cont.take_stats()
    assert s["rollout/decode_utilization"] == sum(lengths[0]) / (2 * N_NEW)
    assert c["rollout/decode_utilization"] == sum(lengths[1]) / (2 * N_NEW)  # 2 slots x (N_NEW - 1) steps + 2 firsts
    assert c["rollout/row_utilization"] == 1.0 and c["rollout/decode_utilization"] < 1.0
    # 3 requests: the static call decodes 4 rows (one of padding), each N_NEW positions (a real row is truncated)
    got = static.sample([(0, p) for p in prompts + ["abc"]], 1, jax.random.key(0))
    made = [len(r[0].completion_tokens) for r in got]
    assert max(made) == N_NEW
    stats = static.take_stats()
    assert stats["rollout/row_utilization"] == 3 / 4 and stats["rollout/decode_utilization"] == sum(made) / (4 * N_NEW)
    # ignore_eos: the same EOS no longer ends the first completion, in either engine
    for engine in ("static", "continuous"):
        extra = dict(kv_budget_bytes=1 << 20, engine_chunk_steps=3) if engine == "continuous" else {}
        sampler = ModelSampler(policies, SamplingConfig(**settings, engine=engine, ignore_eos=True, **extra))
        got = sampler.sample([(0, p) for p in prompts], 1, jax.random.key(0))
        assert [c[0].completion_tokens.tolist() for c in got] == [long_a.tolist(), long_b.tolist()]


def test_prompt_figures_count_the_prompts_cut_at_max_prompt_len_and_warn_once():
    """Two prompts, one longer than max_prompt_len: the figures give the uncut lengths and a cut
    share of 1/2; the long prompt keeps its last max_prompt_len ids; the first cut warns, the
    next call does not."""
    prompts = ["short", "a prompt well over the budget"]
    policies = _policies(eos_id=0)
    full = encode_prompts_full(policies.groups[0].tokenizer, prompts)  # chat-templated
    limit = len(full[0]) + 2
    assert len(full[1]) > limit
    sampler = ModelSampler(policies, SamplingConfig(max_new_tokens=2, temperature=0.0, max_prompt_len=limit))
    with pytest.warns(PromptTruncatedWarning, match=f"max_prompt_len={limit} "):
        got = sampler.sample([(0, p) for p in prompts], 1, jax.random.key(0))
    assert got[0][0].prompt_tokens.tolist() == list(full[0])
    assert got[1][0].prompt_tokens.tolist() == list(full[1])[-limit:]
    stats = sampler.take_stats()
    assert stats["rollout/prompt_truncated_fraction"] == 0.5
    assert stats["rollout/prompt_length_max"] == len(full[1])
    assert stats["rollout/prompt_length_mean"] == (len(full[0]) + len(full[1])) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", PromptTruncatedWarning)
        sampler.sample([(0, prompts[1])], 1, jax.random.key(1))
    assert sampler.take_stats()["rollout/prompt_truncated_fraction"] == 1.0
