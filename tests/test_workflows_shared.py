"""The `shared` plan (HACPO) and the capability window, with toy tokenizers and scripted policies.

`QuizEnv`: one agent ("solver"), one step; the prompt asks for seed + 1; reward (local) 1 for
the right number, else 0. Two toy tokenizers with different vocabularies, chat templates and
eos ids: `CharTok` (one token per character, any Unicode, lossless) and `PairTok` (one token
per pair of ASCII characters, non-ASCII becomes "?": lossy). `TokSampler` plays policy p with
tokenizer p: prompt tokens = encode(template(prompt)), completion tokens = encode(text) + eos
(no eos when the text is in `truncated`), log-prob of completion token t = -0.1 * (t + 1) - p / 2.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest

from jmarl import JmarlError
from jmarl.config import load_config
from jmarl.envs.base import StepResult
from jmarl.algos.hacpo import CapabilityWindow, capabilities, update_capabilities
from jmarl.workflows import (
    Completion,
    SharedOptions,
    SharedStats,
    TextTokenizer,
    PLANS,
    PlanContext,
    get_plan,
    input_fields,
    plan_metrics,
    run_plan,
    sample_shared,
)
from jmarl import workflows
from jmarl.workflows.shared import retokenize, seq_logprob
from jmarl.train.learner import policy_samples
from jmarl.train.packing import pack

KEY = jax.random.key(0)
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class QuizState:
    seed: int
    answer: str | None = None


@dataclass(frozen=True)
class QuizEnv:
    name: str = "quiz"
    agents: tuple[str, ...] = ("solver",)
    turn_order: tuple[str, ...] = ("solver",)
    parallel: bool = False
    max_turns: int = 1

    def reset(self, seed):
        return QuizState(seed)

    def observe(self, state, agent):
        return f"What is {state.seed} + 1?"

    def step(self, state, agent, text):
        correct = text.strip() == str(state.seed + 1)
        return QuizState(state.seed, text), StepResult(1.0 if correct else 0.0, 0.0, True)

    def end_turn(self, state):
        return state

    def done(self, state):
        return state.answer is not None

    def success(self, state):
        return state.answer is not None and state.answer.strip() == str(state.seed + 1)


class CharTok:
    eos_id = 1

    def encode(self, text):
        return [ord(c) + 3 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 3) for i in ids if i >= 3)

    def template(self, prompt):
        return f"<user>{prompt}<assistant>"


class PairTok:
    eos_id = 2

    def encode(self, text):
        text = "".join(c if ord(c) < 128 else "?" for c in text)
        ids = []
        for i in range(0, len(text), 2):
            pair = text[i : i + 2]
            ids.append(3 + ord(pair) if len(pair) == 1 else 200 + 128 * ord(pair[0]) + ord(pair[1]))
        return ids

    def decode(self, ids):
        out = []
        for i in ids:
            if 3 <= i < 200:
                out.append(chr(i - 3))
            elif i >= 200:
                out.append(chr((i - 200) // 128) + chr((i - 200) % 128))
        return "".join(out)

    def template(self, prompt):
        return f"Q: {prompt}\nA:"


class TokSampler:
    def __init__(self, tokenizers, fn, truncated=()):
        self.tokenizers, self.fn, self.truncated = tokenizers, fn, set(truncated)
        self.calls = []

    def sample(self, requests, n, rng):
        self.calls.append((list(requests), n))
        out = []
        for policy, prompt in requests:
            tok = self.tokenizers[policy]
            row = []
            for j in range(n):
                text = self.fn(policy, prompt, j)
                ids = tok.encode(text) + ([] if text in self.truncated else [tok.eos_id])
                row.append(
                    Completion(
                        text=text,
                        prompt_tokens=np.array(tok.encode(tok.template(prompt)), np.int32),
                        completion_tokens=np.array(ids, np.int32),
                        logprobs=(-0.1 * (np.arange(len(ids)) + 1) - policy / 2).astype(np.float32),
                    )
                )
            out.append(row)
        return out


def seed_of(prompt):
    return int(prompt.split()[2])


def quiz_fn(policy, prompt, j):
    """Policy 0 answers s+1, s+2, s+1 (2/3 right); policy 1 answers s+1, 0, 0 (1/3 right)."""
    s = seed_of(prompt)
    row = [s + 1, s + 2, s + 1] if policy == 0 else [s + 1, 0, 0]
    return str(row[j % 3])


TOKS = {0: CharTok(), 1: PairTok()}


# the paper's settings as options (G = 3): HACPO shares; GSPO does not, with G or 2G answers
SETTINGS = {"hacpo": {"share": True}, "gspo": {"share": False}, "gspo_2x": {"share": False, "samples_per_policy": 6}}


def run(mode, seeds=(4, 9), fn=quiz_fn, **kw):
    sampler = TokSampler(TOKS, fn, kw.pop("truncated", ()))
    opts = SharedOptions(group_size=3, num_policies=2, tokenizers=TOKS, **SETTINGS[mode], **kw)
    return sample_shared(QuizEnv(), list(seeds), (0,), sampler, KEY, opts), sampler


def test_toy_tokenizers_satisfy_protocol_and_round_trip():
    texts = ["", "7", "10", "abc xyz!", "The answer is \\boxed{42}.\n", "odd"]
    for tok in TOKS.values():
        assert isinstance(tok, TextTokenizer)
        for text in texts:
            assert tok.decode(tok.encode(text)) == text
    assert len(PairTok().encode("abcde")) == 3 and len(CharTok().encode("abcde")) == 5
    assert PairTok().decode(PairTok().encode("é5")) == "?5"  # lossy outside ASCII


def test_hacpo_self_and_cross_samples():
    out, sampler = run("hacpo")
    # one sampler call: every policy, every prompt, G each
    assert sampler.calls == [
        ([(0, "What is 4 + 1?"), (1, "What is 4 + 1?"), (0, "What is 9 + 1?"),
          (1, "What is 9 + 1?")], 3)
    ]
    recs = out.records
    assert len(recs) == 2 * 2 * 2 * 3  # tasks * learners * sources * G
    # order: task, learner, source, sample; one mixed group per (task, learner)
    expected = [(e, k, j) for e in range(2) for k in range(2) for j in range(2) for _ in range(3)]
    assert [(r.env, r.policy, r.source_policy) for r in recs] == expected
    assert [r.group for r in recs] == [e * 2 + k for e, k, _ in expected]
    # rewards follow the source: policy 0 right on samples 0 and 2, policy 1 on sample 0
    assert [r.reward for r in recs[:6]] == [1, 0, 1, 1, 0, 0]
    assert [r.completion.text for r in recs[:6]] == ["5", "6", "5", "5", "0", "0"]
    for r in recs:
        learner, source = TOKS[r.policy], TOKS[r.source_policy]
        c = r.completion
        # the learner's own prompt rendering, its tokenizer, its eos
        np.testing.assert_array_equal(c.prompt_tokens, learner.encode(learner.template(r.prompt)))
        assert learner.decode(c.completion_tokens[:-1]) == c.text
        assert c.completion_tokens[-1] == learner.eos_id
        if r.policy == r.source_policy:
            assert not r.info["cross"] and r.source_seq_logprob is None
            assert c.logprobs[0] == pytest.approx(-0.1 - r.policy / 2)
        else:
            assert r.info["cross"] and (c.logprobs == 0).all()
            n_source = len(source.encode(c.text)) + 1
            hand = np.mean(-0.1 * (np.arange(n_source) + 1) - r.source_policy / 2)
            assert r.source_seq_logprob == pytest.approx(hand)
    assert isinstance(out.stats, SharedStats)
    assert out.stats.num_generated == 12 and out.stats.num_records == 24
    assert out.stats.success_rate == pytest.approx((2 / 3, 1 / 3))
    # the trainer logs the numbers (not the share flag or the per-policy tuples) as plan/<name>
    assert plan_metrics(out.stats) == {"plan/num_generated": 12.0, "plan/samples_per_policy": 3.0,
                                       "plan/num_records": 24.0, "plan/num_lossy": 0.0}
    assert len(out.episodes) == 12 and sum(e.success for e in out.episodes) == 6


def test_hacpo_records_carry_source_logprob_and_unknown_behaviour():
    """A cross sample carries its source's mean completion log-prob and unknown (0) behaviour
    log-probs; the learner's batch places both (`policy_samples`); a learner's group shares one
    prompt."""
    out, _ = run("hacpo", seeds=(4,))
    recs = out.records
    assert [r.group for r in recs] == [0] * 6 + [1] * 6
    assert [r.policy for r in recs] == [0] * 6 + [1] * 6
    assert [r.source_policy for r in recs] == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]
    for k in range(2):
        mine = [r for r in recs if r.policy == k]
        (b,) = pack([policy_samples(mine, k, 8)])
        for i, r in enumerate(mine):
            source_lp = next(
                s.completion.logprobs for s in recs
                if s.policy == s.source_policy == r.source_policy
                and s.completion.text == r.completion.text
            )
            assert b["source_seq_logprob"][i] == pytest.approx(source_lp.mean())
            behaviour = b["behavior_logprobs"][i][b["loss_mask"][i]]
            assert (behaviour == 0).all() == (r.policy != r.source_policy)
        # the learner's group shares one prompt: identical prompt tokens in every sample of a group
        assert len({r.completion.prompt_tokens.tobytes() for r in mine}) == 1


def test_cross_tokens_truncation_same_tokenizer_and_lossy_text():
    tok = CharTok()
    src = Completion("12", np.array([5], np.int32), np.array(tok.encode("12"), np.int32),
                     np.array([-1.0, -2.0], np.float32))
    routed, ok = retokenize(src, np.array([9, 9], np.int32), tok, PairTok())
    # no eos: the source was truncated (last token is not CharTok's eos)
    assert ok and routed.completion_tokens.tolist() == PairTok().encode("12")
    assert routed.prompt_tokens.tolist() == [9, 9] and seq_logprob(src) == -1.5
    same, ok = retokenize(src, np.array([9], np.int32), tok, tok)
    assert ok and same.completion_tokens.tolist() == src.completion_tokens.tolist()

    def fn(policy, prompt, j):
        return "é5" if (policy, j) == (0, 1) else quiz_fn(policy, prompt, j)

    dropped, _ = run("hacpo", seeds=(4,), fn=fn, truncated=("0",))
    # policy 0's "é5" cannot be written by PairTok: dropped from learner 1's group only
    assert dropped.stats.num_lossy == 1 and len(dropped.records) == 11
    learner1 = [r for r in dropped.records if r.policy == 1]
    assert [r.completion.text for r in learner1] == ["5", "5", "5", "0", "0"]
    # truncated completions ("0" has no eos) stay without eos after re-tokenisation
    zero_cross = [r for r in dropped.records if r.policy == 0 and r.completion.text == "0"]
    assert [r.completion.completion_tokens.tolist() for r in zero_cross] == [[ord("0") + 3]] * 2
    kept, _ = run("hacpo", seeds=(4,), fn=fn, lossy="keep")
    assert len(kept.records) == 12 and kept.stats.num_lossy == 1
    lossy = [r for r in kept.records if not r.info["lossless"]]
    assert len(lossy) == 1 and lossy[0].policy == 1 and lossy[0].completion.text == "é5"


@pytest.mark.parametrize(
    "mode, generated, records, n_call",
    [("hacpo", 12, 24, 3), ("gspo", 12, 12, 3), ("gspo_2x", 24, 24, 6)],
)
def test_modes_rollout_counts(mode, generated, records, n_call):
    out, sampler = run(mode)
    assert out.stats.share == SETTINGS[mode]["share"] and out.stats.samples_per_policy == n_call
    assert out.stats.num_generated == generated == sum(len(r) * n for r, n in sampler.calls)
    assert len(out.records) == records and sampler.calls[0][1] == n_call
    groups = {}
    for r in out.records:
        groups.setdefault(r.group, []).append(r)
    assert len(groups) == 4 and all(len(g) == records // 4 for g in groups.values())
    if mode.startswith("gspo"):
        assert all(r.policy == r.source_policy for r in out.records)


def test_the_former_modes_are_refused_naming_the_options_that_replace_them():
    for mode, instead in (("hacpo", "share: true"), ("gspo", "share: false"), ("gspo_2x", "samples_per_policy")):
        with pytest.raises(JmarlError, match=re.escape(instead)):
            SharedOptions(mode=mode)
    with pytest.raises(JmarlError, match="samples_per_policy must be"):
        SharedOptions(samples_per_policy=-1)
    # naive sharing sampled exactly as hacpo: it is HACPO's three switches, not a plan option
    hint = "algo.options.capability_baseline/discrepancy/stepwise_clip: false"
    with pytest.raises(JmarlError, match=re.escape(hint)):
        SharedOptions(mode="naive")
    # through the config, where the hint names the setting's path
    with pytest.raises(JmarlError, match="workflow.options: .*" + re.escape(hint)):
        load_config(REPO / "configs/hacpo/math_tiny.yaml", ["workflow.options.mode=naive"])
    # the loss switches are the algorithm's (jmarl.algos.hacpo), not the plan's
    assert not hasattr(workflows, "mode_switches")


def test_shared_errors_and_registry():
    with pytest.raises(JmarlError, match="no tokenizer is given for policies \\[1\\]"):
        sample_shared(QuizEnv(), [4], (0,), TokSampler(TOKS, quiz_fn), KEY,
                      SharedOptions(group_size=2, tokenizers={0: CharTok()}))
    with pytest.raises(JmarlError, match="single-agent"):
        sample_shared(QuizEnv(agents=("a", "b"), turn_order=("a", "b")), [4], (0, 1),
                      TokSampler(TOKS, quiz_fn), KEY, SharedOptions(tokenizers=TOKS))
    with pytest.raises(JmarlError, match="shared.mode"):
        SharedOptions(mode="shared")
    with pytest.raises(JmarlError, match="share must be"):
        SharedOptions(share="yes")
    with pytest.raises(JmarlError, match="group_size"):
        SharedOptions(group_size=0)
    # gspo needs no tokenizers
    alone = sample_shared(QuizEnv(), [4], (0,), TokSampler(TOKS, quiz_fn), KEY,
                          SharedOptions(group_size=3, share=False))
    assert len(alone.records) == 6
    by_name = run_plan("shared", QuizEnv(), [4, 9], (0,), TokSampler(TOKS, quiz_fn), KEY,
                       group_size=3, tokenizers=TOKS)
    direct, _ = run("hacpo")
    assert [r.reward for r in by_name.records] == [r.reward for r in direct.records]


def test_shared_plan_value_binds_run_inputs_and_bounds_rows():
    plan = get_plan("shared")
    assert plan is PLANS["shared"] and plan.run is sample_shared and plan.options is SharedOptions
    assert plan.routes_by_agent is False
    # num_policies and tokenizers are run inputs, filled by bind from the run's tokenizers
    assert input_fields(SharedOptions) == ("num_policies", "tokenizers")
    bound = plan.bind(SharedOptions(group_size=3), PlanContext(tokenizers=TOKS))
    assert bound.num_policies == len(TOKS) and dict(bound.tokenizers) == dict(TOKS)
    assert bound.group_size == 3 and bound.share is True and bound.per_policy == 3
    by_plan = plan.run(QuizEnv(), [4, 9], (0,), TokSampler(TOKS, quiz_fn), KEY, bound)
    direct, _ = run("hacpo")
    assert [r.reward for r in by_plan.records] == [r.reward for r in direct.records]
    # rows per learner: tasks x sources x samples per policy (an upper bound when lossy drops)
    for mode, rows in (("hacpo", 5 * 2 * 3), ("gspo", 5 * 3), ("gspo_2x", 5 * 6)):
        opts = plan.bind(SharedOptions(group_size=3, **SETTINGS[mode]), PlanContext(tokenizers=TOKS))
        assert plan.rows_per_policy(opts, 5) == rows
    # with 2 tasks the hacpo plan gives each learner 2 x 2 x 3 = 12 records (nothing lossy here)
    per_learner = {k: sum(r.policy == k for r in direct.records) for k in range(2)}
    assert all(n <= plan.rows_per_policy(bound, 2) == 12 for n in per_learner.values())


# ---------------------------------------------------------------- capability window


def test_capability_window_three_steps_hand_computed():
    steps = [(2 / 3, 1 / 3), (1.0, 0.0), (0.5, 0.5)]
    w5, w2 = CapabilityWindow(), CapabilityWindow(size=2)
    hand5 = [(2 / 3, 1 / 3), (5 / 6, 1 / 6), (13 / 18, 5 / 18)]
    hand2 = [(2 / 3, 1 / 3), (5 / 6, 1 / 6), (0.75, 0.25)]
    for success, h5, h2 in zip(steps, hand5, hand2):
        w5, w2 = update_capabilities(w5, success), update_capabilities(w2, success)
        np.testing.assert_allclose(capabilities(w5), h5, rtol=1e-6)
        np.testing.assert_allclose(capabilities(w2), h2, rtol=1e-6)
    assert len(w2.history) == 2 and w2.history[0] == (1.0, 0.0)
    # immutable: updating returns a new window and leaves the old one alone
    w6 = update_capabilities(w5, (0.0, 0.0))
    assert len(w5.history) == 3 and len(w6.history) == 4
    # the plan's success rates feed the window directly
    out, _ = run("hacpo")
    np.testing.assert_allclose(
        capabilities(update_capabilities(CapabilityWindow(), out.stats.success_rate)),
        (2 / 3, 1 / 3), rtol=1e-6)


def test_capability_window_is_the_algorithms_alone():
    # HACPO's algorithm state lives in jmarl.algos.hacpo; the plan only reports success rates
    for name in ("CapabilityWindow", "update_capabilities", "capabilities"):
        assert not hasattr(workflows, name)
        assert not hasattr(workflows.shared, name)


def test_capability_window_json_and_errors():
    w = CapabilityWindow(size=3)
    for s in [(0.25, 1.0), (0.5, 0.0), (1.0, 0.5), (0.0, 0.25)]:
        w = update_capabilities(w, s)
    text = w.to_json()
    assert json.loads(text) == {"size": 3, "history": [[0.5, 0.0], [1.0, 0.5], [0.0, 0.25]]}
    back = CapabilityWindow.from_json(text)
    assert back == w
    np.testing.assert_array_equal(capabilities(back), capabilities(w))
    with pytest.raises(JmarlError, match="empty"):
        capabilities(CapabilityWindow())
    with pytest.raises(JmarlError, match="tracks 2"):
        update_capabilities(w, (0.5,))
    with pytest.raises(JmarlError, match="\\[0, 1\\]"):
        update_capabilities(w, (1.5, 0.0))
    with pytest.raises(JmarlError, match="malformed"):
        CapabilityWindow.from_json('{"size": 3}')
    with pytest.raises(JmarlError, match="size"):
        CapabilityWindow(size=0)
