"""The parallel host loop: concurrent env steps equal serial ones, failures name the env, each
host of a multi-host run steps its share, batch encoding equals encoding, and a trainer step
reports its rollout timings."""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import dataclass

import jax
import numpy as np
import pytest
from test_workflows import KEY, CounterEnv, ScriptedSampler, _hash_fn

from jmarl.models import CharTokenizer, load_tokenizer
from jmarl.workflows import JointOptions, SharedOptions, TreeOptions, sample_joint, sample_shared, sample_tree
from jmarl.workflows import stepping
from jmarl.workflows.stepping import StepClock, host_loop, process_share, step_all


@dataclass(frozen=True)
class SlowCounterEnv(CounterEnv):
    """CounterEnv whose steps sleep a little (so threads interleave) and record their threads."""

    name: str = "slow_counter"

    def step(self, state, agent, text):
        time.sleep(0.001 * (len(text) % 3))
        THREADS.add(threading.get_ident())
        return super().step(state, agent, text)


THREADS: set[int] = set()


def _summary(result):
    return (
        [(r.prompt, r.completion.text, r.reward, r.group, r.env, r.turn, r.agent, tuple(sorted(r.info.items())))
         for r in result.records],
        result.episodes,
    )


@pytest.mark.parametrize("parallel", [False, True])
def test_concurrent_stepping_equals_serial_on_the_tree_plan(parallel):
    env = SlowCounterEnv(parallel=parallel, max_turns=3)
    seeds, opts = [30, 31, 7, 30, 12], TreeOptions(group_size=4)
    with host_loop(workers=1) as serial_clock:
        serial = sample_tree(env, seeds, (0, 1), ScriptedSampler(_hash_fn), KEY, opts)
    THREADS.clear()
    with host_loop(workers=4) as clock:
        concurrent = sample_tree(env, seeds, (0, 1), ScriptedSampler(_hash_fn), KEY, opts)
    assert len(THREADS) > 1  # really stepped on several threads
    assert _summary(concurrent) == _summary(serial)
    assert clock.items == serial_clock.items == len(serial.records)
    assert clock.seconds > 0 and clock.calls == serial_clock.calls


def test_concurrent_stepping_equals_serial_on_joint_and_shared():
    env = SlowCounterEnv(parallel=True, max_turns=2)
    opts = JointOptions(group_size=3, joint_mode="cross")
    runs = []
    for workers in (1, 3):
        with host_loop(workers=workers):
            runs.append(_summary(sample_joint(env, [5, 9], (0, 1), ScriptedSampler(_hash_fn), KEY, opts)))
    assert runs[0] == runs[1]
    single = SlowCounterEnv(agents=("a",), turn_order=("a",), max_turns=1)
    shared = SharedOptions(group_size=3, num_policies=2, share=False)
    runs = []
    for workers in (1, 4):
        with host_loop(workers=workers):
            runs.append(_summary(sample_shared(single, [3, 4, 5], (0,), ScriptedSampler(_hash_fn), KEY, shared)))
    assert runs[0] == runs[1]


@dataclass(frozen=True)
class BrokenEnv(CounterEnv):
    name: str = "broken_counter"

    def step(self, state, agent, text):
        if text == "3":
            raise ValueError("cannot step 3")
        return super().step(state, agent, text)


@pytest.mark.parametrize("workers", [1, 4])
def test_a_failing_env_step_propagates_naming_the_env(workers):
    env = BrokenEnv()
    state = env.reset(9)
    items = [(state, "a", str(v)) for v in range(5)]
    with pytest.raises(ValueError, match="cannot step 3") as info:
        step_all(env, items, workers=workers)
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "'broken_counter'" in note and "item 3" in note and "'a'" in note


def test_step_many_is_preferred_and_thread_unsafe_envs_step_serially():
    @dataclass(frozen=True)
    class Batched(CounterEnv):
        def step_many(self, items):
            CALLS.append(len(items))
            return [self.step(*item) for item in items]

    @dataclass(frozen=True)
    class Unsafe(SlowCounterEnv):
        thread_safe = False

    CALLS: list[int] = []
    env = Batched()
    items = [(env.reset(9), "a", str(v)) for v in range(6)]
    assert step_all(env, items, workers=4) == [env.step(*i) for i in items]
    assert CALLS == [6]
    THREADS.clear()
    unsafe = Unsafe()
    assert step_all(unsafe, items, workers=4) == [unsafe.step(*i) for i in items]
    assert THREADS == {threading.get_ident()}


@pytest.mark.parametrize("n", [0, 1, 5, 8, 13, 1024])
@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_process_share_partitions_exactly(n, count):
    shares = [process_share(n, i, count) for i in range(count)]
    covered = [i for s in shares for i in range(n)[s]]
    assert covered == list(range(n))  # in order, each item exactly once
    sizes = [len(range(n)[s]) for s in shares]
    assert max(sizes) - min(sizes) <= 1


def test_each_host_steps_only_its_share_and_sees_the_whole_batch(monkeypatch):
    """Three simulated hosts: each steps its share; the fake collective hands every host the
    other hosts' pickled results, as `process_allgather` would."""
    env = SlowCounterEnv()
    state = env.reset(40)
    items = [(state, "a", str(v % 10)) for v in range(10)]
    serial = [env.step(*i) for i in items]
    count = 3
    monkeypatch.setattr(jax, "process_count", lambda: count)
    for host in range(count):
        stepped: list[str] = []

        @dataclass(frozen=True)
        class Recording(CounterEnv):
            def step(self, s, a, t):
                stepped.append(t)
                return super().step(s, a, t)

        def fake_allgather(payload, host=host):
            parts = []
            for other in range(count):
                share = process_share(len(items), other, count)
                parts.append(payload if other == host else pickle.dumps(("ok", [env.step(*i) for i in items[share]])))
            return parts

        monkeypatch.setattr(jax, "process_index", lambda host=host: host)
        monkeypatch.setattr(stepping, "_allgather_bytes", fake_allgather)
        out = step_all(Recording(), items, workers=2)
        assert out == serial
        assert stepped == [t for _, _, t in items[process_share(len(items), host, count)]]


def test_a_step_failing_on_another_host_is_raised_on_every_host(monkeypatch):
    env = CounterEnv()
    items = [(env.reset(9), "a", str(v)) for v in range(4)]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    other = pickle.dumps(("error", ValueError("host 1 broke")))
    monkeypatch.setattr(stepping, "_allgather_bytes", lambda payload: [payload, other])
    with pytest.raises(ValueError, match="host 1 broke") as info:
        step_all(env, items)
    assert "host 1 of 2" in " ".join(info.value.__notes__)


def test_host_loop_rejects_bad_workers():
    with pytest.raises(Exception, match="env_workers"):
        with host_loop(workers=0):
            pass
    with host_loop(workers=2, clock=StepClock()) as clock:
        step_all(CounterEnv(), [(CounterEnv().reset(1), "a", "1")])
    assert clock.items == 1


TEXTS = ["Hello, world!", "", "line one\nline two\n", "  spaced  ~{}|", "caf\u00e9 \u2603", "x" * 4000]


def test_encode_batch_equals_encode():
    char = CharTokenizer()
    assert [a.tolist() for a in char.encode_batch(TEXTS)] == [char.encode(t) for t in TEXTS]
    assert char.encode_batch([]) == []
    unknown = char.piece_to_id["?"]
    assert char.encode("\u00e9a") == [unknown, char.piece_to_id["a"]]
    bpe = load_tokenizer(__import__("pathlib").Path(__file__).parents[1] / "configs/hacpo/tokenizers/byte_bpe")
    texts = TEXTS + ["Problem: What is 3 + 4? <|user|> \\boxed{7}</s>"]
    assert [a.tolist() for a in bpe.encode_batch(texts)] == [bpe.encode(t) for t in texts]


@pytest.mark.slow
def test_trainer_step_reports_rollout_timings(tmp_path):
    from test_trainer import _config

    from jmarl.config import load_config
    from jmarl.train import trainer as trainer_mod

    cfg = load_config(_config(tmp_path, "timed"), ["policies.mode=shared", "workflow.env_workers=2"])
    assert cfg.workflow.env_workers == 2
    t = trainer_mod.Trainer(cfg)
    m = t.rl_step()
    for name in ("time/generate", "time/env", "time/host", "time/rollout", "time/update"):
        assert np.isfinite(m[name]) and m[name] >= 0, name
    assert m["time/generate"] > 0 and m["time/env"] > 0 and m["time/update"] > 0
    assert m["time/generate"] + m["time/env"] <= m["time/rollout"] + 1e-6
    if hasattr(t.sampler, "take_stats"):
        assert "rollout/row_utilization" in m


@pytest.mark.parametrize("variant", ["coder_tester", "helper_main"])
def test_code_env_step_many_batches_its_sandbox_runs(variant, monkeypatch):
    """`Code.step_many` equals stepping one by one, and runs every sandbox program of the batch
    through one `run_many` call (the steps that follow hit the cache)."""
    from jmarl.envs import code_harness as code_mod
    from jmarl.envs.base import make

    env = make("code", variant=variant)
    states = [env.reset(s) for s in (11, 12)]
    texts = {a: [env.expert_text(states[0], a), "```python\ndef nope(:\n```", "```python\nx = 1\n```"]
             for a in env.turn_order}
    items = [(st, a, t) for st in states for a in env.turn_order for t in texts[a]]
    # the tester is judged against the coder's program: give the state one first
    items += [(env.step(st, env.turn_order[0], texts[env.turn_order[0]][0])[0], env.turn_order[1], t)
              for st in states for t in texts[env.turn_order[1]]]
    code_mod._CACHE.clear()
    calls = []
    real = code_mod.run_many
    monkeypatch.setattr(code_mod, "run_many", lambda codes, *a, **kw: calls.append(len(codes)) or real(codes, *a, **kw))
    batched = step_all(env, items, workers=4)
    assert len(calls) == 1 and calls[0] >= 2
    code_mod._CACHE.clear()
    one_by_one = [env.step(*item) for item in items]
    assert [(s, r.local_reward, r.team_reward) for s, r in batched] == [
        (s, r.local_reward, r.team_reward) for s, r in one_by_one]


HOST_WORKER = """
import json, sys
from dataclasses import dataclass, replace
from jmarl import sharding
from jmarl.config import DistributedConfig
port, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
assert sharding.maybe_initialize_distributed(
    DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid))
import jax
from jmarl.envs.base import StepResult
from jmarl.workflows.stepping import step_all

STEPPED = []

@dataclass(frozen=True)
class Adder:
    name: str = "adder"
    def step(self, state, agent, text):
        STEPPED.append(text)
        return state + int(text), StepResult(int(text) / 10, 0.0, False)

items = [(i, "a", str(i % 7)) for i in range(11)]
first = step_all(Adder(), items, workers=2)
second = step_all(Adder(), items[:3], workers=1)
json.dump({"stepped": STEPPED, "first": [[s, r.local_reward] for s, r in first],
           "second": [[s, r.local_reward] for s, r in second], "count": jax.process_count()}, open(out, "w"))
"""


def test_two_processes_each_step_their_share_and_see_every_result(tmp_path):
    """Two localhost processes (jax.distributed): each steps its half of the items and both get
    every result, in order, through the real collective."""
    import json

    from _processes import free_port, run_workers

    port = free_port()
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    run_workers(HOST_WORKER, [(port, i, outs[i]) for i in range(2)], timeout=240)
    items = [(i, str(i % 7)) for i in range(11)]
    want_first = [[s + int(t), int(t) / 10] for s, t in items]
    want_second = want_first[:3]
    got = [json.loads(o.read_text()) for o in outs]
    stepped = []
    for host, g in enumerate(got):
        assert g["count"] == 2 and g["first"] == want_first and g["second"] == want_second
        share1, share2 = process_share(11, host, 2), process_share(3, host, 2)
        assert g["stepped"] == [t for _, t in items[share1]] + [t for _, t in items[:3][share2]]
        stepped += g["stepped"]
    assert sorted(stepped) == sorted([t for _, t in items] + [t for _, t in items[:3]])  # each item once


def test_host_loop_benchmark_step_runs_small():
    """`benchmarks.host_loop` at a toy size: both settings give the same samples."""
    from benchmarks.host_loop import long_prompt_env, one_step

    tok = CharTokenizer()
    env, prompt_tokens = long_prompt_env(tok, 1024, turns=2)
    assert 1000 < prompt_tokens < 1100
    rows = [one_step("tree", env, tok, episodes=3, k=2, device_s=0.0, after=after) for after in (False, True)]
    assert rows[0]["completions"] == rows[1]["completions"] == 3 * 2 * 2 * 2
    assert rows[0]["prompt_tokens"] == rows[1]["prompt_tokens"]
    for row in rows:
        assert row["host_s"] > 0 and set(row["split_s"]) == {"tokenise", "env", "learner_batch", "rest"}


@pytest.mark.parametrize("n", [1, 2, 4, 5, 9])
def test_waiting_env_steps_equal_serial_at_every_size(n):
    """Steps that wait (sleep) go to the threads after the probe, whatever is left of them."""
    env = SlowCounterEnv()
    items = [(env.reset(50), "a", "1" * (1 + i % 2)) for i in range(n)]
    assert step_all(env, items, workers=3) == [env.step(*i) for i in items]
