"""HACPO (shared plan, heterogeneous policies) and JoyAgents-R1 (node_wise plan, memory) in the
trainer: the tiny configs train on CPU, metrics move, and a resumed run restores the capability
window and the memory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jmarl import envs, models
from jmarl.algos import hacpo, joyagents
from jmarl.config import load_config
from jmarl.errors import JmarlError
from jmarl.train import trainer as trainer_mod
from jmarl.algos import MethodContext
from jmarl.algos.joyagents import memory_options
from jmarl.train import build as build_mod
from jmarl.train import learner as learner_mod
from jmarl.workflows import memory as memory_store

REPO = Path(__file__).resolve().parents[1]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _train_steps(lines: list[dict]) -> list[dict]:
    return [x for x in lines if "rollout/generated" in x]


@pytest.mark.slow
def test_hacpo_tiny_heterogeneous_pair_trains_and_resumes_its_capability_window(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the config's data and tokenizer paths are relative to the repo
    out = tmp_path / "hacpo"
    common = [
        f"output_dir={out}", "train.steps=3", "train.warm_start.steps=12", "workflow.num_tasks=2",
        "eval.num_episodes=8", "eval.greedy=false", "checkpoint.every=1", "logging.progress=false",
        "algo.options.capability_window=2",
    ]
    config = load_config(REPO / "configs/hacpo/math_tiny.yaml", common)
    trainer = trainer_mod.Trainer(config)

    # two learners with different architectures AND vocabularies
    qwen, llama = (trainer.policies.group_of(p) for p in (0, 1))
    assert trainer.policies.policy_names == ("qwen", "llama")
    assert (qwen.model_config.model_type, llama.model_config.model_type) == ("qwen3", "llama")
    assert qwen.model_config.qk_norm and not llama.model_config.qk_norm
    assert qwen.model_config.hidden_size != llama.model_config.hidden_size
    assert isinstance(qwen.tokenizer, models.CharTokenizer) and not isinstance(llama.tokenizer, models.CharTokenizer)
    assert qwen.model_config.vocab_size != llama.model_config.vocab_size
    text = "The answer is \\boxed{7}."
    assert qwen.tokenizer.encode(text) != llama.tokenizer.encode(text)
    assert len(qwen.tokenizer.encode(text)) != len(llama.tokenizer.encode(text))
    assert trainer.plan_opts.num_policies == 2 and trainer.plan_opts.tokenizers[1] is llama.tokenizer
    # the warm start teaches both policies (the shared plan has one agent, played by each)
    assert sorted({pid for pid, *_ in trainer.demonstrations([envs.train_seed(0)])}) == [0, 1]

    summary = trainer.run()
    steps = _train_steps(_metrics(out))
    assert [x["step"] for x in steps] == [1, 2, 3]
    # rollout cost: 2 tasks x 2 policies x G=4 per step, counted
    assert [x["rollout/generated"] for x in steps] == [16.0] * 3
    assert steps[-1]["rollout/generated_total"] == 48.0 == summary["rollouts_generated"]
    # the rewards are not constant (some but not all answers right in some step) and both
    # learners get a non-zero loss and gradient
    assert any(0.0 < x["rollout/reward_mean"] < 1.0 for x in steps)
    for name in ("qwen", "llama"):
        assert any(abs(x[f"train/{name}/loss"]) > 0 and x[f"train/{name}/grad_norm"] > 0 for x in steps), name
    # cross samples reach the learners (re-tokenised), with the stepwise-clipped ratio
    assert any(x["train/llama/cross_fraction"] > 0 for x in steps)
    # capability P^j = mean success of the last K=2 steps, the current one included
    for i, x in enumerate(steps):
        for p in (0, 1):
            window = [steps[j][f"hacpo/success_{p}"] for j in range(max(0, i - 1), i + 1)]
            assert x[f"hacpo/capability_{p}"] == pytest.approx(np.mean(window), abs=1e-6)
    # both policies evaluated, each on its own
    final = _metrics(out)[-1]
    assert {"eval/qwen/success_rate", "eval/llama/success_rate", "eval/success_rate"} <= set(final)
    assert (out / "export" / "llama" / "tokenizer.json").exists()

    # stop, then resume: the window (and rollout count) come back from the checkpoint metadata
    saved = trainer.method_state
    assert len(saved.window.history) == 2 and saved.window.size == 2 and saved.num_policies == 2
    resumed = trainer_mod.Trainer(load_config(REPO / "configs/hacpo/math_tiny.yaml", common + ["resume=true", "train.steps=4"]))
    assert resumed.method_state.window.history == ()
    assert resumed.maybe_resume() and resumed.step == 3
    assert resumed.method_state == saved and resumed.rollouts_generated == trainer.rollouts_generated
    np.testing.assert_array_equal(hacpo.capabilities(resumed.method_state.window), hacpo.capabilities(saved.window))


@pytest.mark.slow
def test_joyagents_tiny_router_trains_and_resumes_its_memory(tmp_path):
    out = tmp_path / "joy"
    common = [
        f"output_dir={out}", "train.steps=3", "train.warm_start.steps=0", "workflow.num_tasks=1",
        "sampling.max_new_tokens=16", "sampling.max_prompt_len=160",
        "eval.num_episodes=1", "eval.greedy=false", "checkpoint.every=1", "logging.progress=false",
    ]
    config = load_config(REPO / "configs/joyagents/router_tiny.yaml", common)
    trainer = trainer_mod.Trainer(config)
    assert trainer.policies.policy_names == ("master", "math", "tool", "qa")
    trainer.run()
    steps = _train_steps(_metrics(out))
    assert [x["step"] for x in steps] == [1, 2, 3]
    # node-wise: per task B base nodes + G alternatives each (+ re-runs); top-2 groups x G records
    assert all(x["rollout/samples"] <= 2 * 8 for x in steps)
    assert all(x["rollout/generated"] >= 2 + 2 * 8 for x in steps)
    # rewards (accuracy + format - cost) are not constant, and the selected groups give gradients
    rewards = [x["rollout/reward_mean"] for x in steps]
    assert max(rewards) > min(rewards)
    assert any(x["train/grad_norm"] > 0 for x in steps)

    # the memory learned something, is injected into the next step's prompts and was saved
    memory = trainer.method_state
    assert memory is not None and memory.options == memory_options(trainer.algo_cfg)
    assert steps[-1]["memory/entries"] == sum(len(es) for _, es in memory.banks) > 0
    assert trainer.step_plan_options().memory is memory
    assert memory_store.load(out / "memory.json") == memory

    resumed = trainer_mod.Trainer(load_config(REPO / "configs/joyagents/router_tiny.yaml", common + ["resume=true", "train.steps=4"]))
    assert resumed.method_state == memory_store.Memory(memory.options)
    assert resumed.maybe_resume() and resumed.step == 3
    assert resumed.method_state == trainer.method_state
    assert resumed.rollouts_generated == sum(x["rollout/generated"] for x in steps)


def test_method_states_round_trip_through_json_meta():
    window = hacpo.CapabilityWindow(size=3)
    for row in [(0.5, 0.25), (1.0, 0.0)]:
        window = hacpo.update_capabilities(window, row)
    state = hacpo.HACPOState(window, 2)
    meta = json.loads(json.dumps(hacpo.METHOD.state_to_json(state)))  # what the checkpoint stores
    assert hacpo.METHOD.state_from_json(hacpo.Config(), meta) == state
    with pytest.raises(JmarlError, match="malformed"):
        hacpo.METHOD.state_from_json(hacpo.Config(), {"window": '{"size": 2}'})
    mem = memory_store.admit(memory_store.Memory(), "master", "q", "ROUTE: math", reward=1.0, baseline=0.2, step=4)
    meta = json.loads(json.dumps(joyagents.METHOD.state_to_json(mem)))
    assert joyagents.METHOD.state_from_json(joyagents.Config(), meta) == mem


def test_method_states_start_from_the_run():
    from jmarl.workflows import IndependentOptions, NodeWiseOptions

    ctx = lambda opts: MethodContext(num_policies=2, group_size=8, plan_options=opts)  # noqa: E731
    state = hacpo.METHOD.init_state(hacpo.HACPOConfig(capability_window=4), ctx(None))
    assert state.window.size == 4 and state.num_policies == 2
    np.testing.assert_array_equal(hacpo.METHOD.device_state(hacpo.Config(), state), [1.0, 1.0])  # empty: equal
    joy = joyagents.JoyAgentsConfig()
    assert joyagents.METHOD.init_state(joy, ctx(NodeWiseOptions())) == memory_store.Memory(memory_options(joy))
    assert joyagents.METHOD.init_state(joy, ctx(IndependentOptions())) is None  # no node groups to learn from
    assert joyagents.METHOD.init_state(dataclasses.replace(joy, use_memory=False), ctx(NodeWiseOptions())) is None


def test_shared_plan_needs_two_heterogeneous_policies(tmp_path):
    config = load_config(REPO / "configs/hacpo/math_tiny.yaml", [f"output_dir={tmp_path}"])
    names, agent_policy = build_mod._policy_map(config, ("solver",), False)
    assert names == ("qwen", "llama") and agent_policy == (0,)  # the shared plan does not route by agent
    only_qwen = dataclasses.replace(config.policies, models={"qwen": config.policies.models["qwen"]})
    with pytest.raises(JmarlError, match="two or more"):
        build_mod._policy_map(dataclasses.replace(config, policies=only_qwen), ("solver",), False)


# ---------------------------------------------------------------- HACPO over three scripted steps

# step -> policy -> which of its G=2 answers are right (QuizEnv: reward 1 for seed + 1)
SCRIPT = [
    {0: (1, 1), 1: (0, 0)},  # success (1, 0)
    {0: (1, 1), 1: (1, 0)},  # success (1, 0.5)
    {0: (0, 1), 1: (0, 0)},  # success (0.5, 0)
]
# hand-worked with K = 2. Mixed group of learner k: sources (0, 0, 1, 1).
# step 1: P = (1, 0). omega^{0,1} = 1/0 -> 10, omega^{1,0} = clip(0) = 0.1; r = (1, 1, 0, 0), std .57735
#   learner 0: mu = (1 + 1) / 4 = .5; learner 1: mu = (.1 + .1) / 4 = .05
# step 2: P = (1, .25). omega^{0,1} = 4, omega^{1,0} = .25; r = (1, 1, 1, 0), std .5
#   learner 0: mu = (1 + 1 + 4) / 4 = 1.5 > max reward 1 -> fallback to its own mean 1
#   learner 1: mu = (.25 + .25 + 1) / 4 = .375
# step 3 (step 1 leaves the window): P = (.75, .25). omega^{0,1} = 3, omega^{1,0} = 1/3; r = (0, 1, 0, 0), std .5
#   learner 0: mu = 1 / 4 = .25; learner 1: mu = (1/3) / 4 = 1/12
HAND = [
    dict(P=(1.0, 0.0), base=(0.5, 0.05), std=1 / np.sqrt(3), w=(0.1, 10.0), r=(1, 1, 0, 0)),
    dict(P=(1.0, 0.25), base=(1.0, 0.375), std=0.5, w=(0.25, 4.0), r=(1, 1, 1, 0)),
    dict(P=(0.75, 0.25), base=(0.25, 1 / 12), std=0.5, w=(1 / 3, 3.0), r=(0, 1, 0, 0)),
]


@pytest.mark.slow
def test_hacpo_three_scripted_steps_match_hand_computed_values():
    from test_workflows_shared import TOKS, QuizEnv, TokSampler, seed_of

    from jmarl.train.packing import pack
    from jmarl.workflows import SharedOptions, sample_shared

    method, cfg = hacpo.METHOD, hacpo.HACPOConfig(capability_window=2)
    state = method.init_state(cfg, MethodContext(num_policies=2, group_size=2))
    for step, (script, hand) in enumerate(zip(SCRIPT, HAND)):
        def answer(policy, prompt, j, script=script):
            s = seed_of(prompt)
            return str(s + 1 if script[policy][j] else s + 7)

        opts = SharedOptions(group_size=2, num_policies=2, tokenizers=TOKS)
        result = sample_shared(QuizEnv(), [3 + step], (0,), TokSampler(TOKS, answer), jax.random.key(step), opts)
        state, metrics = method.after_plan(cfg, state, result, step)
        np.testing.assert_allclose(hacpo.capabilities(state.window), hand["P"], rtol=1e-6)
        assert metrics["hacpo/capability_0"] == pytest.approx(hand["P"][0])
        for k in (0, 1):
            mine = [r for r in result.records if r.policy == k]
            batch = learner_mod.LearnerBatch(**pack([learner_mod.policy_samples(mine, k, 8)])[0])
            adv = method.advantages(cfg, batch, method.device_state(cfg, state))
            keep = method.keep_mask(cfg, batch)
            np.testing.assert_array_equal(batch.source_policy[:4], [0, 0, 1, 1])
            np.testing.assert_array_equal(batch.reward[:4], hand["r"])
            own = np.array([0, 0, 1, 1]) == k
            # the method's advantage is A times the discrepancy weight omega^{source, k} (1 on own samples)
            weight = np.where(own, 1.0, hand["w"][k])
            expected = (np.asarray(hand["r"]) - hand["base"][k]) / (hand["std"] + cfg.eps) * weight
            np.testing.assert_allclose(np.asarray(adv)[:4], expected, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(adv)[4:], 0.0)  # padding rows
            np.testing.assert_array_equal(np.asarray(batch.is_cross())[:4], ~own)
            np.testing.assert_array_equal(np.asarray(keep), [True] * 4 + [False] * 4)


@pytest.mark.slow
def test_stepwise_clip_bounds_follow_the_minibatch_index_inside_the_update():
    """Three mini-batches of one update see m = 0, 1, 2: bounds [0.8, 1], [0.825, 1], [0.85, 1]."""
    import jax.numpy as jnp
    import optax

    from jmarl.train.step import init_train_state, make_update

    cfg = hacpo.HACPOConfig()
    for m, low in enumerate((0.8, 0.825, 0.85)):
        assert tuple(map(float, hacpo.stepwise_clip_bounds(m, delta=0.2, delta_step=0.025))) == pytest.approx((low, 1.0))
    # a cross sample whose ratio s = exp(-0.19) = 0.827 lies inside the bounds at m = 0 and 1 only
    lp0 = np.log(0.827)

    def loss_fn(params, frozen, batch):
        lp = params["lp"] + jnp.zeros(batch.loss_mask.shape)
        return hacpo.METHOD.loss(cfg, lp, batch.replace(old_logprobs=lp))

    n = 3
    batch = learner_mod.LearnerBatch.loss_only(
        tokens=np.zeros((n, 4), np.int32), attention_mask=np.ones((n, 4), bool), loss_mask=np.ones((n, 4), bool),
        advantages=np.ones(n, np.float32), learner=np.zeros(n, np.int32), source_policy=np.ones(n, np.int32),
        source_seq_logprob=np.zeros(n, np.float32), old_logprobs=np.zeros((n, 4), np.float32),
    )
    update = jax.jit(make_update(loss_fn, optax.sgd(0.0), num_minibatches=3))
    state = init_train_state({"lp": jnp.asarray(lp0, jnp.float32)}, optax.sgd(0.0))
    _, metrics = update(state, None, batch)
    assert float(metrics["cross_clip_fraction"]) == pytest.approx(1 / 3)  # clipped at m = 2 only
    assert float(metrics["cross_ratio_mean"]) == pytest.approx(0.827, rel=1e-5)


@pytest.mark.parametrize("options, rows, generated", [
    (("workflow.options.share=true",), 16, 16),  # HACPO
    (("workflow.options.share=false",), 8, 16),  # GSPO alone
    (("workflow.options.share=false", "workflow.options.samples_per_policy=8"), 16, 32),  # GSPO, 2x rollouts
])
@pytest.mark.slow
def test_hacpo_and_its_baselines_in_the_trainer(tmp_path, monkeypatch, options, rows, generated):
    monkeypatch.chdir(REPO)
    config = load_config(
        REPO / "configs/hacpo/math_tiny.yaml",
        [f"output_dir={tmp_path}", "workflow.num_tasks=2", *options, "algo.options.discrepancy=false"],
    )
    trainer = trainer_mod.Trainer(config)
    cfg = trainer.algo_cfg
    # the plan's sharing leaves the mechanisms alone: only the ablation set in algo.options is off
    assert cfg.capability_baseline and cfg.stepwise_clip and not cfg.discrepancy
    # rows per learner per step: 2 tasks x 2 policies x G (sharing) or its own G / 2G only;
    # rollouts generated per step: 2 tasks x 2 policies x S (G, or 2G for the 2x baseline)
    assert trainer.rows_bound() == rows
    assert 2 * 2 * trainer.plan_opts.per_policy == generated
