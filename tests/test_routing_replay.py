"""Routing replay (R3) of mixture-of-experts policies: the sampler records each token's experts
(`Generation.routing`, uint8 ids), the learner runs them with its own router's weights
(`moe.route_replayed`), so its log-probs are the sampler's even where its own routing would
differ (a perturbed router, an exact tie), and reports how often it would
(`learner/<policy>/routing_mismatch`). Tiny random Qwen3-MoE models; the setting's refusals."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _tiny_models import tiny_qwen3, tiny_qwen3_moe
from jmarl.config import ArchConfig, ModelSpec, config_from_dict
from jmarl.errors import JmarlError
from jmarl.models import CharTokenizer, GenerationSpec, generate, init
from jmarl.models import moe
from jmarl.models.generation import engine
from jmarl.models.model import expert_routing
from jmarl.models.presets import preset_config
from jmarl.train import trainer as trainer_mod
from jmarl.train.learner import learner_batch, own_routing
from jmarl.train.packing import packed_logprobs
from jmarl.train.policies import PolicyGroup, build_model
from jmarl.train.sampling import completion_routing
from jmarl.workflows.base import Completion, SampleRecord

# layers 0 and 2 sparse, layer 1 dense (a mixed model: replay skips its dense layer); top-2 of 4
CONFIG = tiny_qwen3_moe(num_experts=4, mlp_only_layers=(1,), routing_replay="replay")
PROMPTS = np.array([[0, 0, 5, 9, 33, 40], [0, 7, 21, 2, 11, 3], [0, 0, 0, 44, 12, 8], [17, 3, 29, 50, 6, 1]], np.int32)
NEW = 8
_score = jax.jit(packed_logprobs, static_argnums=(0,), static_argnames=("with_router_stats",))


def _params(seed: int = 0) -> dict:
    """Random weights whose routing is decisive and whose experts move the residual stream (an
    expert swapped shows in the log-probs), experts 1 and 2 of every sparse layer tied: their
    router columns are equal, so every token's probabilities of the two are exactly equal."""
    params = init(CONFIG, jax.random.key(seed))
    moe_p = params["layers"]["moe"]
    router = moe_p["router"]["kernel"] * 25.0  # N(0, 0.5^2)
    moe_p["router"]["kernel"] = router.at[..., 2].set(router[..., 1])
    moe_p["experts"] = jax.tree.map(lambda w: w * 7.5, moe_p["experts"])  # N(0, 0.15^2)
    params["embed"]["embedding"] = params["embed"]["embedding"] * 15.0
    return params


def _nudged(params: dict, eps: float = 1e-5) -> dict:
    """params with expert 2's router column moved by eps along a random direction: the tie of
    experts 1 and 2 breaks one way or the other by token, and the weights move by about eps."""
    kernel = params["layers"]["moe"]["router"]["kernel"]
    direction = jax.random.normal(jax.random.key(7), kernel[..., 2].shape)
    out = jax.tree.map(lambda x: x, params)
    out["layers"]["moe"]["router"]["kernel"] = kernel.at[..., 2].add(eps * direction)
    return out


def _sample(params: dict):
    """A generation of the 4 prompts (each twice) with the recorded routing, and its rollouts
    (one sample per row), laid out for the learner as the trainer lays them out."""
    mask = PROMPTS > 0
    tokens, masks = np.repeat(PROMPTS, 2, axis=0), np.repeat(mask, 2, axis=0)
    gen = jax.device_get(generate(CONFIG, params, tokens, masks, jax.random.key(3), GenerationSpec(max_new_tokens=NEW)))
    records = []
    for j in range(tokens.shape[0]):
        prompt, length = tokens[j][masks[j]], int(gen.lengths[j])
        comp = Completion(text="", prompt_tokens=prompt, completion_tokens=np.asarray(gen.tokens[j][:length]),
                          logprobs=np.asarray(gen.logprobs[j][:length]),
                          routing=completion_routing(gen, None, j, prompt.size, length))
        records.append(SampleRecord(prompt="", completion=comp, reward=float(j % 2), group=j // 2, env=0, turn=0,
                                    agent=0, policy=0, source_policy=0))
    group = PolicyGroup(name="g", model_config=CONFIG, tokenizer=None, policy_ids=(0,), stacked=False, lora_rank=None,
                        lora_alpha=0.0, base=None, state=None, ref=None)
    batch, _ = learner_batch(group, records, parts=1)
    return gen, tokens, masks, jax.tree.map(jnp.asarray, batch)


@pytest.mark.slow
def test_replaying_the_own_top_k_is_route_and_the_router_keeps_its_gradient():
    logits = jax.random.normal(jax.random.key(0), (16, 8)) * 2.0
    for normalize in (True, False):
        probs, weights, experts = moe.route(logits, 3, normalize)
        again = moe.route_replayed(logits, experts.astype(jnp.uint8), normalize)
        for ours, theirs in zip(again, (probs, weights, experts)):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    # other experts than the top k: weighted by the router's own probabilities there, renormalised
    other = jnp.tile(jnp.array([[5, 6, 7]], jnp.uint8), (16, 1))
    probs, weights, _ = moe.route_replayed(logits, other, True)
    picked = np.asarray(probs)[:, 5:8]
    np.testing.assert_allclose(np.asarray(weights), picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    # the weights' gradient reaches every logit (the softmax), the replayed experts' own most
    grad = jax.grad(lambda x: jnp.sum(moe.route_replayed(x, other, True)[1] * jnp.arange(3.0)))(logits)
    assert np.all(np.abs(np.asarray(grad)[:, 5:8]) > 0)
    # tokens without a record (the marker) route themselves; the mismatch compares sets
    recorded = other.at[:4].set(moe.no_route(jnp.uint8))
    _, _, used, own, has = moe.replay_route(logits, recorded, 3, True)
    np.testing.assert_array_equal(np.asarray(used[:4]), np.asarray(own[:4]))
    assert not bool(has[:4].any()) and bool(has[4:].all())
    flipped = own[:, ::-1]  # the same sets in another order
    assert not bool(moe.routing_mismatch(own, flipped).any())
    assert bool(moe.routing_mismatch(own, used)[4:].any())


def test_recorded_routing_costs_layers_x_top_k_bytes_per_token():
    assert moe.routing_dtype(128) == np.uint8 and moe.routing_dtype(256) == np.uint16
    figures = {name: moe.routing_bytes_per_token(c.num_sparse_layers, c.num_experts_per_tok, c.num_experts)
               for name in ("qwen3-30b-a3b", "qwen3-235b-a22b") for c in [preset_config(name)]}
    assert figures == {"qwen3-30b-a3b": 48 * 8, "qwen3-235b-a22b": 94 * 8}


def test_a_learner_replays_only_its_own_records_in_its_models_dtype():
    """`own_routing`: a sample the learner drew keeps its recorded experts, cast to the model's
    routing dtype with the "no record" marker carried over; another policy's sample (a cross
    sample) and a sample without a record give None; a record narrower than the model's
    S x k per token is refused."""
    s, k = CONFIG.num_sparse_layers, CONFIG.num_experts_per_tok
    recorded = (np.arange(3 * s * k) % CONFIG.num_experts).astype(np.uint16).reshape(3, s, k)
    recorded[1, 0, 0] = moe.no_route(np.uint16)
    comp = Completion(text="", prompt_tokens=np.array([1, 2], np.int32), completion_tokens=np.array([3], np.int32),
                      logprobs=np.zeros(1, np.float32), routing=recorded)
    own = SampleRecord(prompt="", completion=comp, reward=1.0, group=0, env=0, turn=0, agent=0, policy=0,
                       source_policy=0)
    got = own_routing(own, 0, CONFIG)
    dtype = moe.routing_dtype(CONFIG.num_experts)
    assert got.dtype == dtype and got.shape == (3, s, k)
    assert got[1, 0, 0] == moe.no_route(dtype)
    np.testing.assert_array_equal(got[got != moe.no_route(dtype)], recorded[recorded != moe.no_route(np.uint16)])
    assert own_routing(dataclasses.replace(own, source_policy=1), 0, CONFIG) is None
    assert own_routing(dataclasses.replace(own, completion=dataclasses.replace(comp, routing=None)), 0, CONFIG) is None
    narrow = dataclasses.replace(comp, routing=recorded.reshape(3, -1)[:, :-1])
    with pytest.raises(JmarlError, match="expert ids per token"):
        own_routing(dataclasses.replace(own, completion=narrow), 0, CONFIG)


@pytest.mark.slow
def test_the_sampler_records_the_experts_a_plain_forward_picks():
    params = _nudged(_params())  # no exact tie here: a plain forward and the decode step agree
    gen, tokens, masks, _ = _sample(params)
    assert gen.routing.dtype == np.uint8 and gen.routing.shape == (8, NEW, 2, 2)
    # each row's prompt + completion, right-padded, through one plain forward
    sequences = [np.concatenate([tokens[j][masks[j]], gen.tokens[j][:gen.lengths[j]]]) for j in range(len(tokens))]
    width = max(s.size for s in sequences)
    plain_tokens = np.stack([np.pad(s, (0, width - s.size)) for s in sequences])
    plain_mask = np.arange(width)[None] < np.array([s.size for s in sequences])[:, None]
    plain = np.asarray(jax.jit(expert_routing, static_argnums=0)(CONFIG, params, plain_tokens, plain_mask))
    for j, sequence in enumerate(sequences):
        recorded = completion_routing(gen, None, j, int(masks[j].sum()), int(gen.lengths[j]))
        assert recorded.shape == (sequence.size, 2, 2)
        # every token but the last (which no decode step reads: not recorded)
        np.testing.assert_array_equal(np.sort(recorded[:-1], -1), np.sort(plain[j, :sequence.size - 1], -1))
        assert np.all(recorded[-1] == moe.no_route(np.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["perturbed learner", "tied learner"])
def test_with_replay_the_learner_scores_the_samplers_log_probs(case):
    """The sampler's router has experts 1 and 2 tied (perturbed learner) or nudged apart (tied
    learner), the learner's the other: its own top k then differs from the sampler's on some
    tokens. Replaying, its log-probs are the sampler's; routing itself, they are not."""
    tied = _params()
    sampler, learner = (tied, _nudged(tied)) if case == "perturbed learner" else (_nudged(tied), tied)
    _, _, _, batch = _sample(sampler)
    lp, stats = _score(CONFIG, learner, batch, with_router_stats=True)
    mask = np.asarray(batch.loss_mask)
    behaviour = np.asarray(batch.behavior_logprobs)
    assert float(moe.mismatch_fraction(stats)) > 0
    np.testing.assert_allclose(np.asarray(lp)[mask], behaviour[mask], atol=5e-5)
    routed, _ = _score(CONFIG, learner, batch.replace(packed_routing=None), with_router_stats=True)
    assert np.max(np.abs(np.asarray(routed)[mask] - behaviour[mask])) > 1e-2


def _run_config(tmp_path, **model):
    data = json.loads(json.dumps({
        "seed": 0, "env": {"name": "_toy_env:Letters", "options": {"parallel": True}}, "algo": {"name": "grpo"},
        "policies": {"mode": "per_agent"},  # two policies stacked, both agents' prompts in one sampler call
        "model": {"preset": {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64,
                             "moe_intermediate_size": 16, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                             "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
                  "routing_replay": "replay"},
        "tokenizer": "char", "workflow": {"plan": "independent", "group_size": 2, "num_tasks": 2},
        "sampling": {"max_new_tokens": 6, "max_prompt_len": 64}, "optim": {"lr": 1.0e-2},
        "train": {"steps": 1, "recompute_old_logprobs": False}, "eval": {"num_episodes": 1}, "checkpoint": {"every": 0},
        "logging": {"progress": False, "tensorboard": False, "plots": False}, "output_dir": str(tmp_path / "run"),
    }))
    data["model"].update(model)
    return config_from_dict(data)


@pytest.mark.slow
def test_moe_policies_train_with_routing_replay(tmp_path):
    """A training step of two stacked MoE policies sampled in one call (`generate_stacked`):
    their samples carry the recorded routing to the learner, the update runs, the router trains,
    and each policy's routing mismatch is logged."""
    trainer = trainer_mod.Trainer(_run_config(tmp_path))
    group = trainer.policies.groups[0]
    assert group.model_config.replays_routing and group.stacked
    before = jax.tree.map(np.asarray, group.state.params)
    metrics = trainer.rl_step()
    for policy in ("a", "b"):
        assert 0.0 <= metrics[f"learner/{policy}/routing_mismatch"] <= 1.0
    assert np.isfinite(metrics["train/loss"]) and "train/routing_mismatch" not in metrics
    after = jax.tree.map(np.asarray, group.state.params)
    router = before["layers"]["moe"]["router"]["kernel"], after["layers"]["moe"]["router"]["kernel"]  # [P, L, D, E]
    assert np.all(np.any(router[0] != router[1], axis=(1, 2, 3)))  # each policy's router trains under replay


def test_routing_replay_is_refused_where_it_cannot_work(tmp_path):
    dense = {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
             "num_kv_heads": 1}
    with pytest.raises(JmarlError, match=r"model.routing_replay: replay .* this qwen3 model has no expert layer"):
        _run_config(tmp_path, preset=dense)
    with pytest.raises(JmarlError, match=r"model.routing_replay: must be one of 'off', 'replay'; got 'sometimes'"):
        _run_config(tmp_path, routing_replay="sometimes")
    with pytest.raises(JmarlError, match=r"model.routing_replay: replay .* this qwen3 model"):
        _run_config(tmp_path, preset="qwen3-0.6b")  # a dense preset by name
    with pytest.raises(JmarlError, match=r"sampling.engine: static or model.routing_replay: off"):
        config_from_dict({**json.loads(json.dumps(_as_dict(_run_config(tmp_path)))), "sampling": {"engine": "continuous"}})
    with pytest.raises(JmarlError, match="routing_replay='replay' replays mixture-of-experts routing"):
        tiny_qwen3(routing_replay="replay")  # a dense ModelConfig
    # a model whose kind is known once it is built (a checkpoint's): refused by build_model
    spec = ModelSpec(preset=ArchConfig(**dense), routing_replay="replay")
    with pytest.raises(JmarlError, match=r"policies.models.x.model.routing_replay: replay .* no expert layer"):
        build_model(spec, CharTokenizer(), jax.random.key(0), setting="policies.models.x.model")
    with pytest.raises(JmarlError, match="the continuous engine does not record"):
        engine.run(CONFIG, None, [[1, 2, 3]], 1, jax.random.key(0), GenerationSpec(max_new_tokens=2))
    assert _run_config(tmp_path, routing_replay=False).model.routing_replay == "off"  # YAML's off


def _as_dict(config) -> dict:
    from jmarl.config import config_to_dict

    return config_to_dict(config)
