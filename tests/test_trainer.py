"""The trainer end to end on a tiny model: outputs, export, kill/resume, NaN skip, LoRA, stacking."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from _processes import one_device_xla_flags
from _tensorboard import tensorboard_points
from _tiny_models import TINY_PRESET
from jmarl import models
from jmarl.config import load_config
from jmarl.train import trainer as trainer_mod
from jmarl.train.learner import active_policies, learner_batch, merge, restrict, score_batch
from jmarl.train.packing import token_utilization
from jmarl.train.packing import packed_logprobs
from jmarl.train.step import make_update
from jmarl.workflows import run_plan

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

BASE = {
    "seed": 0,
    "env": {"name": "_toy_env:Letters"},
    "algo": {"name": "grpo"},
    "model": {"preset": TINY_PRESET},
    "tokenizer": "char",
    "workflow": {"plan": "independent", "group_size": 4, "num_tasks": 2},
    "policies": {"mode": "per_agent"},
    "sampling": {"max_new_tokens": 8, "max_prompt_len": 64},
    "optim": {"lr": 1.0e-2},
    "train": {"steps": 2},
    "eval": {"num_episodes": 2},
    "checkpoint": {"every": 1, "keep": 3},
    "logging": {"progress": False},
}


def _config(tmp_path: Path, name: str, **overrides):
    data = json.loads(json.dumps(BASE))
    for dotted, value in overrides.items():
        node = data
        keys = dotted.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    data["output_dir"] = str(tmp_path / name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _exported(out: Path) -> dict[str, dict[str, np.ndarray]]:
    return {p.name: load_file(str(p / "model.safetensors")) for p in sorted((out / "export").iterdir())}


def _timing(key: str) -> bool:
    """A metric that measures time (differs between two runs of the same steps)."""
    return key.startswith(("time/", "perf/")) or key.endswith("_per_s")


def _records(out: Path) -> list[dict]:
    """metrics.jsonl's records without their timing fields."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not _timing(k)} for line in lines]


def _assert_same_records(resumed: list[dict], straight: list[dict]) -> None:
    """The resumed run's records are the uninterrupted run's: each RL step once, in order, with
    equal values (timing aside)."""
    assert [r["step"] for r in resumed] == [r["step"] for r in straight]
    steps = [r["step"] for r in resumed if "train/loss" in r]
    assert steps == sorted(set(steps)) == list(range(1, len(steps) + 1))
    for a, b in zip(resumed, straight):
        assert a.keys() == b.keys() and a == b, a["step"]


@pytest.mark.slow
def test_short_run_writes_outputs_and_export_matches_transformers(tmp_path):
    import torch
    import transformers

    cfg = load_config(_config(tmp_path, "run"), ["train.warm_start.steps=1", "train.warm_start.demos=2"])
    summary = trainer_mod.train(cfg)
    out = Path(cfg.output_dir)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "train/loss" in x] == [1, 2]
    assert all(np.isfinite(x["train/loss"]) for x in lines if "train/loss" in x)
    for x in (x for x in lines if "train/loss" in x):  # the signal and sampler-agreement metrics, per policy
        assert 0 <= x["rollout/signal_group_fraction"] <= 1 and x["rollout/groups"] == 4  # 2 tasks x 2 agents
        for p in ("a", "b"):
            assert x[f"rollout/{p}/samples"] == 8
            assert 0 <= x[f"train/{p}/logprob_diff_mean"] <= x[f"train/{p}/logprob_diff_max"] < 1e-3
        assert x["perf/host_peak_rss_gib"] > 0.1  # the process's peak resident set (a CPU device reports no peak)
    assert list((out / "tensorboard").rglob("events.out.tfevents*"))
    assert list((out / "plots").glob("*.png"))
    saved = json.loads((out / "summary.json").read_text())
    assert {"success_before", "success_after", "steps", "wall_seconds", "host_peak_rss_gib"} <= set(saved)
    assert saved["steps"] == 2 == summary["steps"]

    # the exported policy 'b' loads in transformers and gives jmarl's logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "export" / "b").eval()
    config, params = models.load_hf(out / "export" / "b")
    tokens = np.array([[5, 9, 33, 40, 2, 7]], np.int32)
    ours = np.asarray(models.apply(config, params, tokens, np.ones_like(tokens, bool)))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(out / "export" / "b")
    assert tok.decode([models.CharTokenizer().encode("ab")[0]]) == "a"


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{REPO}", JAX_PLATFORMS="cpu", XLA_FLAGS=one_device_xla_flags())
    straight = _config(tmp_path, "straight", **{"train.steps": 6})
    subprocess.run([sys.executable, "-m", "jmarl.run", "--config", str(straight)], env=env, check=True, cwd=REPO)

    killed = _config(tmp_path, "killed", **{"train.steps": 6})
    proc = subprocess.Popen([sys.executable, "-m", "jmarl.run", "--config", str(killed)], env=env, cwd=REPO)
    ckpt = tmp_path / "killed" / "checkpoints"
    deadline = time.time() + 300
    while not (ckpt / "3" / "commit_success.txt").exists() and not (ckpt / "3" / "state").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its third checkpoint"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (tmp_path / "killed" / "export").exists()

    # the newest checkpoint the killed run committed (3, or later if a step finished before the kill)
    last = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    resumed = subprocess.run(
        [sys.executable, "-m", "jmarl.run", "--config", str(killed), "resume=true"], env=env, cwd=REPO,
        capture_output=True, text=True,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from the checkpoint of step {last} in {ckpt}: continuing with step {last + 1} of 6" in resumed.stdout
    # the run's cost counts both attempts: the first up to its last checkpoint, then the second
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    straight_summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert summary["attempts"] == 2 and straight_summary["attempts"] == 1
    assert summary["cpu_seconds"] > 0 and summary["wall_seconds"] > 0
    _assert_same_records(_records(tmp_path / "killed"), _records(tmp_path / "straight"))
    a, b = _exported(tmp_path / "straight"), _exported(tmp_path / "killed")
    assert a.keys() == b.keys()
    for policy in a:
        for name, value in a[policy].items():
            np.testing.assert_array_equal(value, b[policy][name], err_msg=f"{policy}/{name}")


@pytest.mark.slow
def test_interrupted_then_resumed_run_logs_each_step_once(tmp_path, monkeypatch, capsys):
    """A run that dies after logging step 3 (its last checkpoint: step 2) and is resumed reports
    the step it resumed from, drops the dead run's step-3 record, and ends with the metrics of an
    uninterrupted run; resume=true with no checkpoint says so and starts fresh."""
    overrides = ["train.steps=4", "checkpoint.every=2", "eval.num_episodes=1", "logging.plots=false", "resume=true"]
    straight = trainer_mod.Trainer(load_config(_config(tmp_path, "straight"), overrides))
    straight.run()
    out = capsys.readouterr().out
    assert f"resume=true: no checkpoint in {tmp_path / 'straight' / 'checkpoints'}; starting from step 0" in out
    assert straight.resumed_step is None

    cfg = load_config(_config(tmp_path, "killed"), overrides)
    real_step = trainer_mod.Trainer.rl_step

    def dies_in_step_4(self):
        if self.step == 3:
            raise KeyboardInterrupt("killed")
        return real_step(self)

    monkeypatch.setattr(trainer_mod.Trainer, "rl_step", dies_in_step_4)
    with pytest.raises(KeyboardInterrupt):
        trainer_mod.Trainer(cfg).run()
    monkeypatch.setattr(trainer_mod.Trainer, "rl_step", real_step)
    killed = tmp_path / "killed"
    assert [r["step"] for r in _records(killed)] == [0, 1, 2, 3]  # step 3 logged, not checkpointed
    capsys.readouterr()

    resumed = trainer_mod.Trainer(cfg)
    resumed.run()
    assert resumed.resumed_step == 2 and resumed.step == 4
    ckpt = killed / "checkpoints"
    assert (f"resumed from the checkpoint of step 2 in {ckpt}: continuing with step 3 of 4; dropped 1 "
            "metrics.jsonl record(s) logged after it") in capsys.readouterr().out
    _assert_same_records(_records(killed), _records(tmp_path / "straight"))
    # TensorBoard hides the dead run's step 3 (the resumed run's writer purges from step 3)
    straight_tb = tensorboard_points(tmp_path / "straight" / "tensorboard")
    assert [s for s, _ in tensorboard_points(killed / "tensorboard")["train/loss"]] == [1, 2, 3, 4]
    assert tensorboard_points(killed / "tensorboard")["train/loss"] == straight_tb["train/loss"]

    # resuming the finished run (its last checkpoint: step 4) redoes only the final evaluation
    again = trainer_mod.Trainer(cfg)
    again.run()
    assert again.resumed_step == 4
    assert "all 4 steps done; final evaluation and export only; dropped 1 metrics.jsonl record(s)" in capsys.readouterr().out
    _assert_same_records(_records(killed), _records(tmp_path / "straight"))


def test_resume_message_names_the_step_or_a_fresh_start():
    ckpt = Path("/runs/a/checkpoints")
    assert trainer_mod.resume_message(None, 12, ckpt, 0) == (
        "resume=true: no checkpoint in /runs/a/checkpoints; starting from step 0 (fresh run)")
    assert trainer_mod.resume_message(8, 12, ckpt, 1) == (
        "resumed from the checkpoint of step 8 in /runs/a/checkpoints: continuing with step 9 of 12; "
        "dropped 1 metrics.jsonl record(s) logged after it")
    assert trainer_mod.resume_message(12, 12, ckpt, 0).endswith("all 12 steps done; final evaluation and export only")


@pytest.mark.slow
def test_resume_restores_the_kl_reference_the_warm_start_set(tmp_path):
    """With a KL term and a warm start, a full-parameter policy's reference is the warm-started
    policy; a resumed run must get that reference back from the checkpoint, not the initial
    weights it builds."""
    cfg = load_config(_config(tmp_path, "kl"), ["train.kl_coef=0.1", "train.warm_start.steps=2", "train.warm_start.demos=2",
                                                "train.steps=1", "eval.num_episodes=1", "logging.plots=false"])
    first = trainer_mod.Trainer(cfg)
    first.run()
    want = [jax.device_get(g.ref) for g in first.policies.groups]
    fresh = trainer_mod.Trainer(dataclasses.replace(cfg, resume=True))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(want[0]), jax.tree.leaves(jax.device_get(fresh.policies.groups[0].ref))))
    assert fresh.maybe_resume()
    for g, ref in zip(fresh.policies.groups, want):
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(jax.device_get(g.ref))):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_nan_reward_batch_skips_one_update_and_training_continues(tmp_path, monkeypatch):
    cfg = load_config(_config(tmp_path, "nan"), ["policies.mode=shared", "optim.weight_decay=0.0"])
    t = trainer_mod.Trainer(cfg)
    real_learn = trainer_mod.learn
    calls = []

    def poisoned(group, fns, records, *args):
        calls.append(1)
        if len(calls) == 1:  # the first step's rewards all NaN
            records = [dataclasses.replace(r, reward=float("nan")) for r in records]
        return real_learn(group, fns, records, *args)

    monkeypatch.setattr(trainer_mod, "learn", poisoned)
    before = jax.tree.map(np.array, t.policies.groups[0].state.params)
    m1 = t.rl_step()
    after_nan = jax.tree.map(np.array, t.policies.groups[0].state.params)
    jax.tree.map(np.testing.assert_array_equal, before, after_nan)
    assert m1["train/skipped_updates"] == 1.0 and int(t.policies.groups[0].state.step) == 0
    m2 = t.rl_step()
    after = jax.tree.map(np.array, t.policies.groups[0].state.params)
    assert m2["train/skipped_updates"] == 1.0 and int(t.policies.groups[0].state.step) == 1
    assert np.isfinite(m2["train/loss"])
    changed = jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.any(x != y)), after_nan, after))
    assert any(changed)


@pytest.mark.slow
def test_lora_run_changes_only_adapters(tmp_path):
    cfg = load_config(
        _config(tmp_path, "lora"),
        ["policies.mode=lora", "policies.lora.rank=2", "optim.lr=0.05", "train.steps=3"],
    )
    t = trainer_mod.Trainer(cfg)
    base = jax.tree.map(np.array, t.policies.groups[0].base)
    adapters0 = jax.tree.map(np.array, t.policies.groups[0].state.params)
    for _ in range(3):
        t.rl_step()
    g = t.policies.groups[0]
    assert g.stacked and g.lora_rank == 2
    jax.tree.map(np.testing.assert_array_equal, base, jax.tree.map(np.array, g.base))
    moved = [bool(np.any(x != y)) for x, y in zip(jax.tree.leaves(adapters0), jax.tree.leaves(g.state.params))]
    assert any(moved)
    # the merged policies now differ from the base, and from each other
    p0, p1 = g.policy_params(0), g.policy_params(1)
    diff_base = [bool(np.any(np.asarray(x) != y)) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(base))]
    assert any(diff_base)
    assert any(bool(np.any(np.asarray(x) != np.asarray(y))) for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)))


@pytest.mark.slow
def test_stacked_update_equals_each_policy_alone(tmp_path):
    cfg = load_config(_config(tmp_path, "stack"), [])
    t = trainer_mod.Trainer(cfg)
    group, fns = t.policies.groups[0], t.fns[0]
    assert group.stacked and group.policy_ids == (0, 1)
    key = jax.random.key(3)
    result = run_plan("independent", t.env, [0, 1], t.policies.agent_policy, t.sampler, key, group_size=4)
    batch, counts = learner_batch(group, result.records, t.parts)
    assert counts == [8, 8]
    scored = score_batch(group, fns, batch, None, recompute=True, cross=False)
    assert float(jnp.abs(scored.advantages).sum()) > 0  # the toy env gives varied rewards
    start = jax.tree.map(jnp.array, group.state)
    stacked_state, _ = fns.update(jax.tree.map(jnp.array, start), None, scored)

    single = jax.jit(make_update(_single_loss(t), t.optimizer))
    for i in range(2):
        one_state = jax.tree.map(lambda x: x[i], start)
        one_batch = jax.tree.map(lambda x: x[i], scored)
        # each policy's slice holds only its own agent's samples
        assert set(np.asarray(batch.agent[i])[: counts[i]]) == {i}
        alone, _ = single(one_state, None, one_batch)
        # Adam's first step moves a parameter by lr * g / (|g| + eps): where g is at rounding
        # level (~eps) the step itself is rounding-sensitive, so allow 1% of lr (a wrong update
        # is off by up to 2 * lr = 0.02)
        for x, y in zip(jax.tree.leaves(alone.params), jax.tree.leaves(stacked_state.params)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y[i]), rtol=1e-5, atol=1e-2 * cfg.optim.lr)


@pytest.mark.slow
def test_a_stacked_policy_without_samples_is_neither_computed_nor_stepped(tmp_path):
    """A step whose samples are all policy 0's: the update runs on policy 0's slice of the stack
    alone (`restrict` / `merge`), computing half the slots; policy 1 stays bit-for-bit as it was
    (as in the whole stack's update, which does not apply its zero gradient: no weight decay, no
    step count), and policy 0 ends as in the whole stack's update."""
    cfg = load_config(_config(tmp_path, "idle"), ["optim.weight_decay=0.1"])
    t = trainer_mod.Trainer(cfg)
    group, fns = t.policies.groups[0], t.fns[0]
    result = run_plan("independent", t.env, [0, 1], t.policies.agent_policy, t.sampler, jax.random.key(3), group_size=4)
    batch, counts = learner_batch(group, [r for r in result.records if r.policy == 0], t.parts)
    assert counts == [8, 0]
    active = active_policies(counts, group.stacked)
    assert active.tolist() == [0]
    assert active_policies(counts, True, multiple=2) is None  # a mesh splitting the policy axis in two
    assert active_policies([8, 8], True) is None and active_policies(counts, False) is None
    assert active_policies([0, 3, 0, 5], True, multiple=2).tolist() == [1, 3]
    assert active_policies([0, 3, 0, 0], True, multiple=2).tolist() == [0, 1]

    start = jax.tree.map(jnp.array, group.state)
    whole, _ = fns.update(jax.tree.map(jnp.array, start), None, score_batch(group, fns, batch, None, recompute=True, cross=False))
    view, part = restrict(group, batch, active)
    assert view.policy_ids == (0,) and np.shape(part.packed_segment)[0] == 1
    assert token_utilization(part)[1] * 2 == token_utilization(batch)[1]  # half the slots computed
    new, _ = fns.update(view.state, None, score_batch(view, fns, part, None, recompute=True, cross=False))
    merge(group, active, new)
    assert np.asarray(group.state.step).tolist() == [1, 0] and np.asarray(whole.step).tolist() == [1, 0]
    for after, before, stack in zip(jax.tree.leaves(group.state.params), jax.tree.leaves(start.params),
                                    jax.tree.leaves(whole.params)):
        np.testing.assert_array_equal(np.asarray(after[1]), np.asarray(before[1]))
        np.testing.assert_array_equal(np.asarray(stack[1]), np.asarray(before[1]))
        np.testing.assert_allclose(np.asarray(after[0]), np.asarray(stack[0]), rtol=1e-5, atol=1e-2 * cfg.optim.lr)


@pytest.mark.slow
def test_scoring_by_micro_batches_equals_one_pass(tmp_path):
    """The scoring program runs the step's batch one micro-batch at a time (4 parts here): the
    same log-probs as one pass over the whole packed batch."""
    cfg = load_config(_config(tmp_path, "score"), ["optim.minibatches=2", "optim.grad_accum=2"])
    t = trainer_mod.Trainer(cfg)
    group, fns = t.policies.groups[0], t.fns[0]
    assert t.parts == 4 and group.stacked
    result = run_plan("independent", t.env, [0, 1], t.policies.agent_policy, t.sampler, jax.random.key(4), group_size=4)
    batch, _ = learner_batch(group, result.records, t.parts)
    inputs = jax.tree.map(jnp.asarray, batch.model_inputs())
    scored = fns.score(group.state.params, group.base, inputs)
    one_pass = jax.vmap(lambda p, b: packed_logprobs(group.model_config, p, b, t.temperature))
    np.testing.assert_allclose(np.asarray(scored), np.asarray(one_pass(group.state.params, inputs)), atol=1e-5)
    assert float(jnp.abs(scored).sum()) > 0


def _single_loss(t):
    mcfg, method, algo_cfg = t.policies.groups[0].model_config, t.method, t.algo_cfg

    def loss_fn(params, frozen, batch):
        return method.loss(algo_cfg, packed_logprobs(mcfg, params, batch, t.temperature), batch)

    return loss_fn


@pytest.mark.slow
def test_sampler_call_cap_splits_requests_and_keeps_every_completion(tmp_path):
    """sampling.max_rows_per_call: requests are generated in consecutive calls of at most that
    many rows; every request still gets its n completions, reproducibly from the key."""
    from jmarl.train.sampling import split_calls

    assert split_calls(5, 4, None) == [(0, 5)]
    assert split_calls(5, 4, 8) == [(0, 2), (2, 4), (4, 5)]
    assert split_calls(3, 4, 2) == [(0, 1), (1, 2), (2, 3)]  # at least one request per call
    capped = trainer_mod.Trainer(load_config(_config(tmp_path, "capped"), ["sampling.max_rows_per_call=4"]))
    requests = [(p, f"prompt {i}") for i, p in enumerate([0, 1, 0, 0, 1])]
    calls = []
    original = capped.sampler._prepare_call
    capped.sampler._prepare_call = lambda g, reqs, n, key: calls.append(len(reqs) * n) or original(g, reqs, n, key)
    first = capped.sampler.sample(requests, 2, jax.random.key(5))
    assert calls == [4, 4, 2] and [len(c) for c in first] == [2] * 5
    again = capped.sampler.sample(requests, 2, jax.random.key(5))
    assert [[c.text for c in cs] for cs in first] == [[c.text for c in cs] for cs in again]


def test_warm_start_shows_memory_lines_in_its_share_of_the_demonstrations(tmp_path, monkeypatch):
    """train.warm_start.memory_share: that share of each step's demonstration episodes is
    prompted with memory lines (retrieved from other expert episodes) ahead of the same task the
    plain demonstration shows; 0 shows none."""
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"output_dir={tmp_path / 'ws'}", "train.warm_start.steps=2", "train.warm_start.demos=8",
        "train.warm_start.memory_share=0.5", "logging.progress=false", "logging.plots=false",
        "logging.tensorboard=false", "sampling.max_prompt_len=512"])
    t = trainer_mod.Trainer(cfg)
    real, calls = t.demonstrations, []

    def spy(seeds, memory_seeds=None):
        calls.append((list(seeds), memory_seeds, real(seeds, memory_seeds)))
        return calls[-1][2]

    monkeypatch.setattr(t, "demonstrations", spy)
    t.warm_start()
    shown = [c for c in calls if c[1]]
    assert len(calls) == 4 and len(shown) == 2  # per step: the plain episodes, then the shown ones
    for (plain_seeds, _, _), (seeds, memory_seeds, demos) in zip(calls[0::2], calls[1::2]):
        assert 0 < len(seeds) < 8 and len(plain_seeds) + len(seeds) == 8 and not set(seeds) & set(plain_seeds)
        assert len(memory_seeds) == 8 and not set(memory_seeds) & set(seeds + plain_seeds)
        plain = real(seeds)
        assert [(p, x) for p, _, x in demos] == [(p, x) for p, _, x in plain]
        for (_, prompt, _), (_, plain_prompt, _) in zip(demos, plain):
            assert prompt.startswith("Relevant memory:\n- query: ") and prompt.endswith("\n" + plain_prompt)
    calls.clear()
    t.config = dataclasses.replace(t.config, train=dataclasses.replace(
        t.config.train, warm_start=dataclasses.replace(t.config.train.warm_start, memory_share=0.0)))
    t.warm_started = False
    t.warm_start()
    assert len(calls) == 2 and not any(c[1] for c in calls)
