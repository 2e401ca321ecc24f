"""scripts/evidence.py and the trainer fields it reads (eval step-info means, before_eval_*)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from _scripts import load_script
from jmarl import envs
from jmarl.train.evaluate import step_info_means, step_info_metrics
from jmarl.train.metrics import before_summary
from jmarl.workflows.base import Completion
from jmarl.workflows import memory as memory_store
from jmarl.workflows.independent import IndependentOptions, sample_independent
from jmarl.workflows.joint import JointOptions, sample_joint
from jmarl.workflows.node_wise import NodeWiseOptions, sample_node_wise
from jmarl.workflows.stepping import numeric_info

ROOT = Path(__file__).resolve().parents[2]


evidence = load_script("evidence")


# ---- library additions ------------------------------------------------------------------------


class FixedTextSampler:
    """Every request of agent a (told apart by its prompt) gets `texts[a]`."""

    def __init__(self, texts: dict[str, str]):
        self.texts = texts

    def sample(self, requests, n, rng):
        out = []
        for _, prompt in requests:
            agent = "concise" if "CONCISE part" in prompt else "detailed"
            text = self.texts[agent]
            toks = np.array([ord(c) for c in text], np.int32)
            out.append([Completion(text, np.zeros(3, np.int32), toks, np.zeros(toks.size, np.float32))] * n)
        return out


def test_numeric_info_keeps_numbers_only():
    info = {"a": 1, "b": 0.5, "c": True, "d": "text", "e": np.float32(2.0), "f": [1, 2]}
    assert numeric_info(info) == {"a": 1.0, "b": 0.5, "e": 2.0}
    assert numeric_info(None) == {}


def test_independent_records_carry_writing_components_and_means_match_env_score():
    env = envs.make("writing", concise_words=(3, 10), detailed_words=(10, 30))
    texts = {
        "concise": "The mill opened in 1824.",
        "detailed": "First, the mill opened. Moreover, a flood damaged it. Finally, volunteers rebuilt the walls nearby.",
    }
    seeds = [envs.eval_seed(i) for i in range(3)]
    res = sample_independent(env, seeds, (0, 1), FixedTextSampler(texts), jax.random.key(0),
                             IndependentOptions(group_size=1))
    expected = [env.score(env.reset(s).source, texts["concise"], texts["detailed"]) for s in seeds]
    scored = [r for r in res.records if "structure" in r.info["env_info"]]
    assert len(scored) == len(seeds)  # one scoring step per episode (the one completing the pair)
    for r in scored:
        assert r.info["env_info"]["ratio"] == pytest.approx(expected[r.env]["ratio"])
    means = step_info_means(res.records)
    for name in ("structure", "ratio", "diversity", "transitions", "overlap"):
        assert means[name] == pytest.approx(np.mean([e[name] for e in expected]))
    # "words" is reported by both writers' steps: the mean over all six records
    assert means["words"] == pytest.approx((5 + 15) / 2)
    # the trainer's rollout/info figures: the same means, and the share of samples with a non-zero value
    logged = step_info_metrics(res.records)
    assert {k: logged[f"rollout/info/{k}"] for k in means} == pytest.approx(means)
    for name in ("transitions", "overlap", "words"):
        want = np.mean([r.info["env_info"][name] != 0 for r in res.records if name in r.info["env_info"]])
        assert logged[f"rollout/info_nonzero/{name}"] == pytest.approx(want)
    assert logged["rollout/info_nonzero/transitions"] == 1.0 and logged["rollout/info_nonzero/words"] == 1.0


class PerIndexSampler:
    """Completion g of a request from agent a (told apart by its prompt) is `texts[a][g]`."""

    def __init__(self, texts: dict[str, list[str]]):
        self.texts = texts

    def sample(self, requests, n, rng):
        out = []
        for _, prompt in requests:
            agent = "concise" if "CONCISE part" in prompt else "detailed"
            row = []
            for text in self.texts[agent][:n]:
                toks = np.array([ord(c) for c in text], np.int32)
                row.append(Completion(text, np.zeros(3, np.int32), toks, np.zeros(toks.size, np.float32)))
            out.append(row)
        return out


def test_joint_records_carry_the_mean_step_info_of_their_joint_actions():
    env = envs.make("writing", concise_words=(3, 10), detailed_words=(10, 30))
    texts = {
        "concise": ["The mill opened in 1824.", "A flood came."],
        "detailed": ["First, the mill opened. Moreover, a flood damaged it. Finally, volunteers rebuilt the walls nearby.",
                     "The mill opened and a flood damaged it and people rebuilt it later on that year."],
    }
    seed = envs.eval_seed(0)
    res = sample_joint(env, [seed], (0, 1), PerIndexSampler(texts), jax.random.key(0),
                       JointOptions(group_size=2, joint_mode="cross", max_turns=1))
    source = env.reset(seed).source
    detailed = [r for r in res.records if r.agent == 1]
    assert len(detailed) == 2
    for g, r in enumerate(detailed):  # the pair is scored on the detailed writer's step: mean over both concise texts
        scores = [env.score(source, c, texts["detailed"][g]) for c in texts["concise"]]
        for name in ("structure", "ratio", "diversity", "transitions", "overlap"):
            assert r.info["env_info"][name] == pytest.approx(np.mean([s[name] for s in scores]))
    assert [r.info["env_info"] for r in res.records if r.agent == 0] == [{"words": 5.0}, {"words": 3.0}]
    logged = step_info_metrics(res.records)
    assert logged["rollout/info/words"] == pytest.approx(np.mean([5, 3, 15, 16]))


def test_node_wise_records_carry_their_own_step_info():
    env = envs.make("router")
    text = "ANSWER: 42 because"
    res = sample_node_wise(env, [envs.eval_seed(0), envs.eval_seed(1)], tuple(range(len(env.agents))),
                           FixedTextSampler({"concise": text, "detailed": text}), jax.random.key(0),
                           NodeWiseOptions(group_size=2, top_k=2))
    assert res.records
    for r in res.records:  # the master's answer step reports the cost of its words (flags are left out)
        assert r.info["env_info"] == {"cost": pytest.approx(env.token_cost * 3)}
    assert step_info_metrics(res.records)["rollout/info_nonzero/cost"] == 1.0


def test_before_summary_renames_eval_keys():
    got = before_summary({"eval/success_rate": 0.25, "eval/info/ratio": 0.5, "train/loss": 1.0})
    assert got == {"before_eval_success_rate": 0.25, "before_eval_info/ratio": 0.5}


def test_memory_prompt_env_shows_retrieved_entries_like_training():
    env = envs.make("router")
    state = env.reset(envs.eval_seed(0))
    agent = env.agents[0]
    plain = env.observe(state, agent)
    mem = memory_store.Memory(memory_store.MemoryOptions(capacity=4, top_m=1))
    assert memory_store.MemoryPromptEnv(env, mem).observe(state, agent) == plain  # empty memory
    mem = memory_store.admit(mem, agent, plain, "ROUTE-TO-MATH-FIRST", reward=1.0, baseline=0.0, step=0)
    wrapped = memory_store.MemoryPromptEnv(env, mem)
    got = wrapped.observe(state, agent)
    entry = memory_store.retrieve(mem, agent, plain)[0]
    assert got == env.observe(memory_store.with_memory_context(state, agent, [memory_store.format_entry(entry)]), agent)
    assert "ROUTE-TO-MATH-FIRST" in got and "ROUTE-TO-MATH-FIRST" not in plain
    # everything else is the env's
    assert wrapped.agents == env.agents and wrapped.parallel == env.parallel
    assert wrapped.step(state, agent, "x")[1] == env.step(state, agent, "x")[1]


# ---- the runner's pure parts --------------------------------------------------------------------


def test_mean_std_matches_statistics():
    vals = [0.1, 0.4, 0.25]
    got = evidence.mean_std(vals)
    assert got["mean"] == pytest.approx(np.mean(vals))
    assert got["std"] == pytest.approx(np.std(vals, ddof=1))
    assert evidence.mean_std([3.0]) == {"mean": 3.0, "std": 0.0, "n": 1}


def test_read_value_from_summary_and_metrics_log(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "a": 1.0, "b": 4}\n{"step": 2, "a": 3.0}\n\n{"step": 2, "eval/x": 0.5}\n')
    metrics = evidence.logged_metrics(log)
    assert metrics == {"step": [1.0, 2.0, 2.0], "a": [1.0, 3.0], "b": [4.0], "eval/x": [0.5],
                       "step:1:a": [1.0], "step:1:b": [4.0], "step:2:a": [3.0], "step:2:eval/x": [0.5]}
    summary = {"success_after": 0.25}
    assert evidence.read_value(summary, metrics, "success_after") == 0.25
    assert evidence.read_value(summary, metrics, "metrics:a") == 3.0
    assert evidence.read_value(summary, metrics, "mean:a") == 2.0
    assert evidence.read_value(summary, metrics, "mean:missing") is None
    assert evidence.read_value(summary, metrics, "missing") is None
    assert evidence.read_value(summary, metrics, "step:2:a") == 3.0
    assert evidence.read_value(summary, metrics, "step:1:b") == 4.0
    assert evidence.read_value(summary, metrics, "step:2:b") is None
    assert evidence.logged_metrics(tmp_path / "absent.jsonl") == {}


def test_fmt_cell_and_replace_block():
    assert evidence.fmt_cell({"mean": 0.123, "std": 0.04}, 2) == "0.12 ± 0.04"
    assert evidence.fmt_cell({"mean": 96.0, "std": 0.0}, 2) == "96 ± 0"
    assert evidence.fmt_cell(None, 2) == "n/a"
    assert evidence.fmt_cell({"mean": 0.0, "std": 0.0}, 2) == "0.00 ± 0.00"
    assert evidence.fmt_cell({"mean": 0.0938, "std": 0.0, "n": 1}, 3) == "0.094 (1 seed)"  # no spread from one run
    assert evidence.fmt_cell({"mean": 120.0, "std": 0.0, "n": 1}, 2) == "120 (1 seed)"
    text = "a\n<!-- evidence:t:start -->\nold\n<!-- evidence:t:end -->\nb\n"
    assert evidence.replace_block(text, "t", "new\n") == "a\n<!-- evidence:t:start -->\nnew\n<!-- evidence:t:end -->\nb\n"
    with pytest.raises(SystemExit):
        evidence.replace_block("no markers", "t", "x")


def test_every_table_cell_has_one_variant_of_the_table():
    for table in evidence.TABLES.values():
        names = {v.name for v in table.variants}
        cells = table.cells()
        assert len(cells) == len(table.rows) * len(table.columns)
        assert {v for _, _, v, _ in cells} <= names
        assert all(c.variant in names and c.baseline in names for c in table.comparisons)
    bad = dataclasses.replace(evidence.HACPO, columns=(evidence.Line("x", "k", "hacpo"),))
    with pytest.raises(ValueError):
        bad.cells()


def test_sign_flip_p_hand_worked():
    # all differences positive and distinct: only the all-plus and all-minus sign patterns reach
    # the observed |mean|, so p = 2 / 2^n
    assert evidence.sign_flip_p([0.3, 0.1, 0.2]) == pytest.approx(2 / 8)
    assert evidence.sign_flip_p([0.05 * (i + 1) for i in range(8)]) == pytest.approx(2 / 256)
    # [1, -1]: every pattern has |mean| >= 0
    assert evidence.sign_flip_p([1.0, -1.0]) == pytest.approx(1.0)
    # [2, 1, -1]: observed mean 2/3; patterns with |sum| >= 2: (+2 +1 -1)=2, (+2 +1 +1)=4, (+2 -1 +1)=2
    # and their negations -> 6 of 8
    assert evidence.sign_flip_p([2.0, 1.0, -1.0]) == pytest.approx(6 / 8)


def test_bootstrap_interval_brackets_the_mean_and_is_reproducible():
    assert evidence.bootstrap_interval([0.2] * 5) == pytest.approx((0.2, 0.2))
    diffs = [0.1, 0.3, -0.05, 0.2, 0.15, 0.0, 0.25, 0.1]
    lo, hi = evidence.bootstrap_interval(diffs)
    assert min(diffs) <= lo < np.mean(diffs) < hi <= max(diffs)
    assert evidence.bootstrap_interval(diffs) == (lo, hi)
    # a reference from the definition: percentiles of resampled means
    rng = np.random.default_rng(0)
    means = np.asarray(diffs)[rng.integers(0, 8, (10_000, 8))].mean(1)
    assert (lo, hi) == pytest.approx((np.percentile(means, 2.5), np.percentile(means, 97.5)))


def _result_with(values_a, values_b, seeds):
    rows = lambda vals: [{"seed": s, "values": {"k": v}} for s, v in zip(seeds, vals) if v is not None]  # noqa: E731
    return {"seeds": list(seeds), "variants": {"a": {"runs": rows(values_a)}, "b": {"runs": rows(values_b)}}}


def test_paired_stats_pair_by_seed_and_give_a_verdict():
    comp = evidence.Comparison("a", "b", "k", "a vs b")
    seeds = list(range(8))
    up = _result_with([0.5 + 0.01 * i for i in range(8)], [0.3] * 7 + [None], seeds)
    pairs = evidence.paired_values(up, comp)
    assert [s for s, _, _ in pairs] == list(range(7))  # seed 7 has no baseline run: left out
    stats = evidence.paired_stats(pairs)
    assert stats["n"] == 7 and stats["difference"] == pytest.approx(0.23)
    assert stats["verdict"] == "holds" and stats["p"] == pytest.approx(2 / 128)
    down = evidence.paired_stats(evidence.paired_values(_result_with([0.3] * 8, [0.5 + 0.01 * i for i in range(8)], seeds), comp))
    assert down["verdict"] == "reversed"
    mixed = evidence.paired_stats(evidence.paired_values(
        _result_with([0.5, 0.1, 0.4, 0.2, 0.6, 0.2, 0.3, 0.3], [0.3] * 8, seeds), comp))
    assert mixed["verdict"] == "undecided" and mixed["ci95"][0] < 0 < mixed["ci95"][1]
    # three seeds all up: the interval excludes 0 but p = 0.25, so it stays undecided
    few = evidence.paired_stats(evidence.paired_values(_result_with([0.5, 0.6, 0.7], [0.3] * 3, [0, 1, 2]), comp))
    assert few["ci95"][0] > 0 and few["verdict"] == "undecided"
    assert evidence.paired_stats(pairs[:1]) is None


HERE = {"commit": "abc1234", "dirty": False}  # a code_state: the code "now" in these tests
ELSEWHERE = {"commit": "def5678", "dirty": False}


def test_finished_runs_are_reused_only_for_the_same_command(tmp_path):
    table, variant = evidence.WRITING, evidence.WRITING.variants[0]
    out = tmp_path / "run"
    out.mkdir()
    cmd = evidence.run_command(table, variant, 3, out, None)
    assert evidence.finished_row(table, variant, 3, out, cmd, HERE) is None  # never ran
    (out / "summary.json").write_text(json.dumps({"eval_team_reward": 2.5, "before_eval_team_reward": 2.0}))
    (out / evidence.RUN_RECORD).write_text(json.dumps({"argv": cmd[1:], "wall_seconds": 9.0, "cpu_seconds": 12.0, **HERE}))
    row = evidence.finished_row(table, variant, 3, out, cmd, HERE)
    assert row["reused"] and row["seed"] == 3 and row["wall_seconds"] == 9.0 and row["commit"] == "abc1234"
    assert row["values"]["eval_team_reward"] == 2.5 and row["values"]["before_eval_team_reward"] == 2.0
    other = evidence.run_command(table, variant, 3, out, 5)  # --steps 5: another run
    assert evidence.finished_row(table, variant, 3, out, other, HERE) is None
    (out / "summary.json").unlink()  # a record without its summary is not a finished run
    assert evidence.finished_row(table, variant, 3, out, cmd, HERE) is None


def _writing_run_dir(tmp_path):
    """(table, variant, output dir, command, usage) of a finished Writing run's directory."""
    table, variant = evidence.WRITING, evidence.WRITING.variants[0]
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"eval_team_reward": 2.5}))
    cmd = evidence.run_command(table, variant, 0, out, None)
    return table, variant, out, cmd, types.SimpleNamespace(ru_utime=1.5, ru_stime=0.5)


def test_a_run_records_the_code_it_ran_on(tmp_path):
    table, variant, out, cmd, usage = _writing_run_dir(tmp_path)
    dirty = {"commit": "abc1234", "dirty": True, "diff": "0123456789ab"}
    row = evidence.finish_run(table, variant, 0, (None, cmd, out, time.perf_counter(), dirty), 0, usage)
    assert (row["commit"], row["dirty"], row["diff"], row["cpu_seconds"]) == ("abc1234", True, "0123456789ab", 2.0)
    record = json.loads((out / evidence.RUN_RECORD).read_text())
    assert {k: record[k] for k in dirty} == dirty
    # reused on the same code (same commit, same uncommitted changes), carrying its code
    assert evidence.finished_row(table, variant, 0, out, cmd, dirty)["diff"] == "0123456789ab"
    # the same commit without those changes (or with others) is other code
    assert evidence.finished_row(table, variant, 0, out, cmd, HERE) is None
    assert evidence.finished_row(table, variant, 0, out, cmd, dict(dirty, diff="ffffffffffff")) is None
    failed = evidence.finish_run(table, variant, 1, (None, cmd, out, time.perf_counter(), HERE), 256, usage)
    assert failed["error"] == "exit status 1" and failed["commit"] == "abc1234"


def test_a_run_records_the_machine_it_ran_on_and_the_header_names_it(tmp_path):
    table, variant, out, cmd, usage = _writing_run_dir(tmp_path)
    ran_on = dict(HERE, machine="Some CPU (AVX2), 2 CPUs")
    assert evidence.finish_run(table, variant, 0, (None, cmd, out, time.perf_counter(), ran_on), 0, usage)["machine"] \
        == "Some CPU (AVX2), 2 CPUs"
    assert evidence.finished_row(table, variant, 0, out, cmd, HERE)["machine"] == "Some CPU (AVX2), 2 CPUs"  # reused

    result = _committed("hacpo")
    runs = [r for v in result["variants"].values() for r in v["runs"]]
    for r in runs:
        r["machine"] = "Some CPU (AVX2), 2 CPUs"
    header = evidence.markdown(evidence.HACPO, result).splitlines()[0]
    assert ", Some CPU (AVX2), 2 CPUs, jax " in header and "machines:" not in header
    runs[0]["machine"] = "Some CPU (AVX-512), 2 CPUs"
    del runs[1]["machine"]
    line = evidence.machine_line(result)
    assert line.startswith("machines: ") and f"Some CPU (AVX2), 2 CPUs ({len(runs) - 2} runs)" in line
    assert "Some CPU (AVX-512), 2 CPUs (1 run)" in line and "not recorded (1 run; the JSON was written on " in line


def test_a_resumable_run_continues_only_its_own_command_on_its_own_code(tmp_path, monkeypatch):
    table, variant = evidence.REAL, evidence.REAL.variants[0]
    out = tmp_path / "run"
    cmd = evidence.run_command(table, variant, 0, out, None)
    assert "resume=true" in cmd and "resume=false" not in cmd
    assert "resume=false" in evidence.run_command(evidence.WRITING, evidence.WRITING.variants[0], 0, out, None)
    out.mkdir()
    (out / "stale.ckpt").write_text("another run's")
    assert evidence.prepare_run_dir(out, cmd, HERE) == 1 and not (out / "stale.ckpt").exists()  # no record: emptied
    (out / "step_3.ckpt").write_text("this run's")
    assert evidence.prepare_run_dir(out, cmd, HERE) == 2 and (out / "step_3.ckpt").exists()  # continues
    other = evidence.run_command(table, variant, 0, out, 5)
    assert evidence.prepare_run_dir(out, other, HERE) == 1 and not (out / "step_3.ckpt").exists()
    (out / "step_1.ckpt").write_text("this run's")
    monkeypatch.setattr(evidence, "equivalent_code", lambda a, b, root=None: a == b)
    assert evidence.prepare_run_dir(out, other, ELSEWHERE) == 1 and not (out / "step_1.ckpt").exists()


def test_commits_that_change_no_run_path_are_equivalent_code(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True).stdout  # noqa: E731
    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / "jmarl").mkdir()
    (tmp_path / "jmarl" / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "code")
    first = evidence.code_state(tmp_path)
    (tmp_path / "notes.md").write_text("docs\n")
    git("add", "-A")
    git("commit", "-qm", "docs")
    docs = evidence.code_state(tmp_path)
    (tmp_path / "jmarl" / "a.py").write_text("x = 2\n")
    git("commit", "-qam", "code again")
    code = evidence.code_state(tmp_path)
    assert first["commit"] != docs["commit"] and not evidence.same_code(first, docs)
    assert evidence.equivalent_code(first, docs, tmp_path)
    assert not evidence.equivalent_code(first, code, tmp_path) and not evidence.equivalent_code(docs, code, tmp_path)
    assert not evidence.equivalent_code(first, dict(docs, dirty=True, diff="0123456789ab"), tmp_path)
    assert not evidence.equivalent_code({}, docs, tmp_path)

    # a finished run is reused across a docs-only commit, and runs again across a code commit
    monkeypatch.setattr(evidence, "ROOT", tmp_path)
    table, variant = evidence.WRITING, evidence.WRITING.variants[0]
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"eval_team_reward": 2.5}))
    cmd = evidence.run_command(table, variant, 0, out, None)
    (out / evidence.RUN_RECORD).write_text(json.dumps({"argv": cmd[1:], "wall_seconds": 1.0, "cpu_seconds": 1.0,
                                                       **first}))
    assert evidence.finished_row(table, variant, 0, out, cmd, docs)["commit"] == first["commit"]
    assert evidence.finished_row(table, variant, 0, out, cmd, code) is None
    previous = {"variants": {variant.name: {"runs": [{"seed": 0, "values": {"x": 1.0},
                                                      "argv": evidence.portable(cmd[1:]), **first}]}}}
    assert evidence.recorded_row(previous, variant, 0, cmd, docs)["reused"]
    assert evidence.recorded_row(previous, variant, 0, cmd, code) is None

    # and they pair: a seed's two runs on commits that differ only in docs are one code
    evidence.run_tree.cache_clear()
    table = evidence.TABLES["quickstart"]
    comparison = next(c for c in table.comparisons if c.baseline == "single")

    def run(seed, value, state):
        return {"seed": seed, "values": {"success_after": value}} | state

    result = {"seeds": [0, 1], "versions": {}, "variants": {
        "per_agent": {"runs": [run(0, 0.5, first), run(1, 0.6, first)]},
        "single": {"runs": [run(0, 0.1, docs), run(1, 0.2, code)]},
    }}
    assert evidence.paired_values(result, comparison) == [(0, 0.5, 0.1)]
    assert evidence.code_summary(result)["mixed"] and "code: mixed:" in evidence.code_line(result)
    assert evidence._code_short(result).startswith("mixed: ")
    result["variants"]["single"]["runs"][1] = run(1, 0.2, docs)
    assert [s for s, _, _ in evidence.paired_values(result, comparison)] == [0, 1]
    assert not evidence.code_summary(result)["mixed"] and "(the same code)" in evidence.code_line(result)
    # a README sentence names the commits and says they are one code, without the header's run counts
    labels = list(evidence.code_summary(result)["runs"])
    assert evidence._code_short(result) == f"{labels[0]} and {labels[1]}, the same run code"
    evidence.run_tree.cache_clear()


def test_a_run_on_other_code_is_not_reused_silently(tmp_path):
    table, variant = evidence.WRITING, evidence.WRITING.variants[0]
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"eval_team_reward": 2.5}))
    cmd = evidence.run_command(table, variant, 0, out, None)
    (out / evidence.RUN_RECORD).write_text(json.dumps({"argv": cmd[1:], "wall_seconds": 1.0, "cpu_seconds": 1.0, **ELSEWHERE}))
    passed = []
    assert evidence.finished_row(table, variant, 0, out, cmd, HERE, passed=passed) is None
    assert passed == [ELSEWHERE]
    kept = evidence.finished_row(table, variant, 0, out, cmd, HERE, other_code=True)
    assert kept["reused"] and kept["commit"] == "def5678"
    # a record from before runs recorded their code is other code too
    (out / evidence.RUN_RECORD).write_text(json.dumps({"argv": cmd[1:], "wall_seconds": 1.0, "cpu_seconds": 1.0}))
    assert evidence.finished_row(table, variant, 0, out, cmd, HERE) is None
    assert evidence.finished_row(table, variant, 0, out, cmd, {}) is None  # no git: nothing is known to match


def test_a_committed_result_json_resumes_a_table_on_a_new_machine(tmp_path):
    table, variant = evidence.WRITING, evidence.WRITING.variants[0]
    out = evidence.ROOT / "runs" / "evidence" / "writing" / variant.name / "seed_4"
    cmd = evidence.run_command(table, variant, 4, out, None)
    assert all(str(evidence.ROOT) not in a for a in evidence.portable(cmd[1:]))
    row = {"seed": 4, "values": {"eval_team_reward": 2.5}, "argv": evidence.portable(cmd[1:]), "wall_seconds": 3.0, **HERE}
    previous = {"variants": {variant.name: {"runs": [row]}}}
    assert evidence.recorded_row(previous, variant, 4, cmd, HERE) == dict(row, reused=True)
    assert evidence.recorded_row(previous, variant, 5, evidence.run_command(table, variant, 5, out, None), HERE) is None
    assert evidence.recorded_row(previous, variant, 4, evidence.run_command(table, variant, 4, out, 7), HERE) is None
    assert evidence.recorded_row(previous, variant, 4, cmd, ELSEWHERE) is None  # made on other code
    assert evidence.recorded_row(previous, variant, 4, cmd, ELSEWHERE, other_code=True)["commit"] == "abc1234"
    failed = {"variants": {variant.name: {"runs": [{"seed": 4, "error": "exit status 1", "argv": row["argv"]}]}}}
    assert evidence.recorded_row(failed, variant, 4, cmd, HERE) is None  # a failed run is run again
    assert evidence.recorded_row(None, variant, 4, cmd, HERE) is None


def test_rows_without_their_own_code_take_the_json_commit(tmp_path):
    table, variant = evidence.WRITING, evidence.WRITING.variants[0]
    cmd = evidence.run_command(table, variant, 4, tmp_path, None)
    row = {"seed": 4, "values": {"eval_team_reward": 2.5}, "argv": evidence.portable(cmd[1:]), "wall_seconds": 3.0}
    legacy = {"versions": {"git_commit": "abc1234"}, "variants": {variant.name: {"runs": [row]}}}
    assert evidence.run_code(legacy, row) == {"commit": "abc1234", "inferred": True}
    assert evidence.recorded_row(legacy, variant, 4, cmd, ELSEWHERE) is None
    kept = evidence.recorded_row(legacy, variant, 4, cmd, HERE)
    assert kept["commit"] == "abc1234" and kept["commit_inferred"]
    assert evidence.run_code(None, kept) == {"commit": "abc1234", "inferred": True}  # still labelled inferred
    assert evidence.run_code({}, row) == {}


def test_code_state_of_a_git_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert evidence.code_state(tmp_path) == {}  # not a checkout
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True).stdout  # noqa: E731
    git("init", "-q")
    (tmp_path / "jmarl").mkdir()
    (tmp_path / "jmarl" / "code.py").write_text("x = 1\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "c.yaml").write_text("a: 1\n")
    (tmp_path / "notes.md").write_text("a\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text("{}\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = git("rev-parse", "--short", "HEAD").strip()
    assert evidence.code_state(tmp_path) == {"commit": head, "dirty": False}
    # files no run executes or reads (docs, result JSONs), and untracked files, change no run
    (tmp_path / "notes.md").write_text("b\n")
    (tmp_path / "results" / "r.json").write_text("[]\n")
    (tmp_path / "jmarl" / "new.py").write_text("y = 2\n")
    assert evidence.code_state(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "jmarl" / "code.py").write_text("x = 2\n")
    dirty = evidence.code_state(tmp_path)
    assert dirty["commit"] == head and dirty["dirty"] and len(dirty["diff"]) == 12
    assert not evidence.same_code(dirty, {"commit": head, "dirty": False})
    (tmp_path / "jmarl" / "code.py").write_text("x = 3\n")
    assert evidence.code_state(tmp_path)["diff"] != dirty["diff"]
    (tmp_path / "jmarl" / "code.py").write_text("x = 1\n")
    (tmp_path / "configs" / "c.yaml").write_text("a: 2\n")  # a config is code a run reads
    assert evidence.code_state(tmp_path)["dirty"]


def _made_up(table, seeds=(0, 1, 2, 3)) -> dict:
    """A result of `table` as `run_table` writes it, from rows of made-up values (each key of each
    variant a different number per seed), every run on one code."""
    runs = {v.name: [{"seed": s, "wall_seconds": 100.0 + s, "cpu_seconds": 150.0 + s, "commit": "abc1234", "dirty": False,
                      "values": {k: 0.05 + 0.1 * ((i + j + s) % 7) / 7 + 0.02 * s
                                 for j, k in enumerate(table.keys_of(v.name))}}
                     for s in seeds]
            for i, v in enumerate(table.variants)}
    return evidence._result(table, list(seeds), None, runs, time.perf_counter(), complete=True)


def _committed(name: str) -> dict:
    """A table's committed result, made whole for the note tests: every run on one code, and
    every variant with a row per seed (a missing variant's rows copied from the first variant's,
    its values shifted by seed so its comparisons are not degenerate)."""
    table = evidence.TABLES[name]
    path = ROOT / "results" / f"evidence_{name}.json"
    result = json.loads(path.read_text()) if path.exists() else None
    seeds = {r["seed"] for v in (result or {}).get("variants", {}).values() for r in v.get("runs", []) if "values" in r}
    if len(seeds) < 2:  # no committed runs yet, or too few to pair: made-up rows through the script's own builder
        return _made_up(table)
    first = next(v for v in table.variants if result["variants"].get(v.name, {}).get("runs"))
    template = {r["seed"]: r for r in result["variants"][first.name]["runs"] if "values" in r}
    for variant in table.variants:
        entry = result["variants"].setdefault(variant.name, {"label": variant.label, "runs": []})
        have = {r["seed"] for r in entry["runs"] if "values" in r}
        entry["runs"] = [r for r in entry["runs"] if "values" in r] + [
            dict(r, values={k: (None if x is None else x * (0.9 + 0.03 * r["seed"])) for k, x in r["values"].items()})
            for seed, r in template.items() if seed not in have]
        entry["runs"].sort(key=lambda r: r["seed"])
        for r in entry["runs"]:
            r.update(commit="abc1234", dirty=False)
            r.pop("commit_inferred", None)
            r.pop("diff", None)
    return result


def test_the_header_names_the_runs_code_not_the_renderers():
    result = _committed("hacpo")
    runs = [r for v in result["variants"].values() for r in v["runs"]]
    for r in runs:  # rows written before runs recorded their code
        for key in ("commit", "dirty", "diff", "commit_inferred"):
            r.pop(key, None)
    legacy = evidence.markdown(evidence.HACPO, result).splitlines()[0]
    assert f"code: {result['versions']['git_commit']} (not recorded per run" in legacy
    for r in runs:
        r.update(commit="aaaaaaa", dirty=False)
    result["versions"]["git_commit"] = "fffffff"  # the renderer's checkout: not the runs' code
    header = evidence.markdown(evidence.HACPO, result).splitlines()[0]
    assert "code: aaaaaaa." in header and "fffffff" not in header
    for r in runs[:5]:
        r.update(commit="bbbbbbb", dirty=True, diff="0123456789ab")
    assert evidence.code_summary(result)["mixed"]
    header = evidence.markdown(evidence.HACPO, result).splitlines()[0]
    assert (f"code: mixed: bbbbbbb with uncommitted changes (0123456789ab) (5 runs), aaaaaaa ({len(runs) - 5} runs)"
            in header)
    # runs reused when the JSON was written ran on that commit or earlier code
    for r in runs:
        r.update(reused=True)
        for key in ("commit", "dirty", "diff", "commit_inferred"):
            r.pop(key, None)
    assert f"{result['versions']['git_commit']} or earlier" in evidence.markdown(evidence.HACPO, result).splitlines()[0]


def test_reusing_other_commits_marks_the_table_mixed(tmp_path, monkeypatch, capsys):
    table = dataclasses.replace(evidence.WRITING, name="tiny")
    now = evidence.code_state()
    for variant, code in zip(table.variants, (now, ELSEWHERE)):
        out = tmp_path / table.name / variant.name / "seed_0"
        out.mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps({"eval_team_reward": 2.5, "before_eval_team_reward": 2.0}))
        cmd = evidence.run_command(table, variant, 0, out, None)
        (out / evidence.RUN_RECORD).write_text(json.dumps({"argv": cmd[1:], "wall_seconds": 1.0, "cpu_seconds": 1.0, **code}))
    result = evidence.run_table(table, [0], None, tmp_path, reuse_other_commits=True)  # nothing left to run
    assert result["code"]["mixed"] and sum(result["code"]["runs"].values()) == 2
    assert "code: mixed: " in evidence.markdown(table, result)
    assert evidence.code_line(result).endswith("def5678 (1 run)")
    # without the flag the run made on other code would run again: the table says so first
    monkeypatch.setattr(evidence, "start_run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("would run")))
    with pytest.raises(RuntimeError, match="would run"):
        evidence.run_table(table, [0], None, tmp_path)
    said = capsys.readouterr().out
    assert "cross seed 0: made on def5678" in said and "--reuse-other-commits" in said and "1 runs to go, 1 reused" in said


# ---- notes: computed from the result ----------------------------------------------------------------


def test_notes_quote_the_results_figures():
    result = _committed("quickstart")
    cpu = sum(r["cpu_seconds"] for v in result["variants"].values() for r in v["runs"]) / 60
    (note, _, cpu_note, row_note) = evidence.note_texts(evidence.QUICKSTART, result)
    assert f"took {cpu:.0f} CPU-minutes" in cpu_note
    warm = evidence.paired_stats(evidence.paired_values(result, evidence.QUICKSTART.comparisons[0]))
    assert f"{100 * warm['difference']:+.1f} points (interval" in note and f"p = {warm['p']:.3f}" in note
    used = result["aggregate"]["per_agent"]["mean:rollout/row_utilization"]["mean"]
    assert f"{used:.2f} per-agent" in row_note

    hacpo = _committed("hacpo")
    lossy = [r["values"]["mean:plan/num_lossy"] for r in hacpo["variants"]["hacpo"]["runs"]]
    text = evidence.note_texts(evidence.HACPO, hacpo)[0]
    assert f"{np.mean(lossy):.2f} per step on average" in text
    assert f"nonzero on {sum(v > 0 for v in lossy)} of {len(lossy)} seeds" in text
    for r in hacpo["variants"]["hacpo"]["runs"]:
        r["values"]["mean:plan/num_lossy"] = 0.0
    assert "none on any of the 8 seeds" in evidence.note_texts(evidence.HACPO, hacpo)[0]


def test_notes_follow_the_numbers():
    result = _committed("quickstart")
    for r in result["variants"]["single"]["runs"]:  # the single agent ahead on every seed
        r["values"]["success_after"] = 0.95 + 0.001 * r["seed"]
    before = evidence.note_texts(evidence.QUICKSTART, result)[1]
    assert "is not reproduced here" in before and "ends above per-agent AT-GRPO on 8 of 8 seeds" in before
    for r in result["variants"]["per_agent"]["runs"]:  # per-agent far ahead of the single agent on every seed
        r["values"]["success_after"] = 0.99 - 0.001 * r["seed"]
    after = evidence.note_texts(evidence.QUICKSTART, result)[1]
    assert "is reproduced here" in after and "ends above per-agent AT-GRPO on 0 of 8 seeds" in after
    control = evidence.note_texts(evidence.QUICKSTART, result)[0]
    assert "the gain is RL's" in control
    for r in result["variants"]["supervised"]["runs"]:  # the control ahead of RL on every seed
        r["values"]["success_after"] = 1.0
    assert "is not shown to exceed" in evidence.note_texts(evidence.QUICKSTART, result)[0]


@pytest.mark.parametrize("name", sorted(evidence.TABLES))
def test_every_note_renders_from_its_result_and_depends_on_it(name):
    table, result = evidence.TABLES[name], _committed(name)
    texts = evidence.note_texts(table, result)
    assert len(texts) == len(table.notes) and all(texts)
    rng = np.random.default_rng(0)
    for variant in result["variants"].values():
        for r in variant["runs"]:
            r["values"] = {k: (None if v is None else v * rng.uniform(0.5, 1.5)) for k, v in r["values"].items()}
    assert evidence.note_texts(table, result) != texts


@pytest.mark.parametrize("name", sorted(n for n, t in evidence.TABLES.items() if t.headline is not None))
def test_every_readme_sentence_is_its_committed_result_rendered(name):
    """The README's sentence on a table (between its readme markers) is the one its committed
    result renders now: figures, verdict and code."""
    result = json.loads((ROOT / "results" / f"evidence_{name}.json").read_text())
    sentence = evidence.headline_text(evidence.TABLES[name], result)
    assert sentence, f"{name}: the committed result renders no README sentence"
    readme = (ROOT / "README.md").read_text()
    marked = readme.split(f"<!-- evidence:{name}:readme:start -->\n")[1].split(f"<!-- evidence:{name}:readme:end -->")[0]
    assert marked == sentence + "\n"


def test_a_note_without_its_figures_is_left_out():
    result = _committed("hacpo")
    result["seeds"] = [0]  # a smoke run: one seed, no paired statistics
    for variant in result["variants"].values():
        variant["runs"] = variant["runs"][:1]
    assert evidence.note_texts(evidence.HACPO, result) == []
    assert "Per-seed values" in evidence.markdown(evidence.HACPO, result)


def test_cpu_sets_split_this_process_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    sets = evidence._cpu_sets(2)
    assert sorted(c for s in sets for c in s) == cpus and all(sets)
    assert evidence._cpu_sets(1) == [cpus]


# ---- end to end: a tiny table, one seed, one RL step ----------------------------------------------


@pytest.mark.slow
def test_runner_writes_json_and_readme_table(tmp_path, monkeypatch):
    tiny = dataclasses.replace(
        evidence.WRITING,
        name="tiny",
        base=evidence.WRITING.base + (
            "sampling.max_new_tokens=12", "sampling.max_prompt_len=48", "workflow.num_tasks=1",
            "workflow.group_size=2", "train.warm_start.steps=0", "eval.num_episodes=2",
        ),
        variants=evidence.WRITING.variants[:1],
        columns=evidence.WRITING.columns[:2],
        comparisons=evidence.WRITING.comparisons[:1],
    )
    monkeypatch.setitem(evidence.TABLES, "tiny", tiny)
    # one code for both invocations (in a shared checkout others may edit jmarl/ meanwhile)
    monkeypatch.setattr(evidence, "code_state", lambda root=evidence.ROOT: dict(HERE))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- evidence:tiny:start -->\nold\n<!-- evidence:tiny:end -->\nrest\n")
    out = tmp_path / "tiny.json"
    code = evidence.main(["tiny", "--seeds", "0", "--steps", "1", "--runs", str(tmp_path / "runs"),
                          "--out", str(out), "--readme", str(readme)])
    assert code == 0
    result = json.loads(out.read_text())
    run = result["variants"]["aligned"]["runs"][0]
    assert run["seed"] == 0 and run["wall_seconds"] > 0
    summary = json.loads((tmp_path / "runs" / "tiny" / "aligned" / "seed_0" / "summary.json").read_text())
    assert summary["steps"] == 1
    for name in ("structure", "ratio", "diversity", "transitions", "overlap"):
        for key in (f"before_eval_info/{name}", f"eval_info/{name}"):
            assert 0.0 <= run["values"][key] <= 1.0
            assert run["values"][key] == summary[key]
            assert result["aggregate"]["aligned"][key] == {"mean": summary[key], "std": 0.0, "n": 1}
    # the team reward is the sum of the five components (each episode scores one pair)
    assert summary["eval_team_reward"] == pytest.approx(
        sum(summary[f"eval_info/{n}"] for n in ("structure", "ratio", "diversity", "transitions", "overlap")))
    assert "seed=0" in " ".join(evidence.run_command(tiny, tiny.variants[0], 0, tmp_path, 1))
    assert result["variants"]["aligned"]["overrides"] == ["workflow.options.joint_mode=aligned"]
    assert result["base_overrides"] == list(tiny.base) and result["versions"]["jax"] == jax.__version__
    text = readme.read_text()
    assert text.startswith("intro\n<!-- evidence:tiny:start -->\n") and text.endswith("<!-- evidence:tiny:end -->\nrest\n")
    assert "old" not in text
    row = next(line for line in text.splitlines() if line.startswith("| ratio |"))
    before, after = summary["before_eval_info/ratio"], summary["eval_info/ratio"]
    assert row == f"| ratio | {before:.2f} (1 seed) | {after:.2f} (1 seed) |"
    assert "python scripts/evidence.py tiny --seeds 0 --steps 1" in text
    assert statistics.fmean([run["wall_seconds"]]) <= result["total_wall_seconds"]
    # --render rebuilds the same block from the JSON without running anything
    readme.write_text("intro\n<!-- evidence:tiny:start -->\n<!-- evidence:tiny:end -->\nrest\n")
    assert evidence.main(["tiny", "--render", "--out", str(out), "--readme", str(readme)]) == 0
    assert readme.read_text() == text
    # run again: the finished run is reused (resume), not rerun
    stamp = (tmp_path / "runs" / "tiny" / "aligned" / "seed_0" / "summary.json").stat().st_mtime_ns
    assert evidence.main(["tiny", "--seeds", "0", "--steps", "1", "--runs", str(tmp_path / "runs"),
                          "--out", str(out), "--readme", str(readme)]) == 0
    again = json.loads(out.read_text())["variants"]["aligned"]["runs"][0]
    assert again["reused"] and again["values"] == run["values"] and again["commit"] == HERE["commit"]
    assert "code: abc1234." in readme.read_text()
    assert (tmp_path / "runs" / "tiny" / "aligned" / "seed_0" / "summary.json").stat().st_mtime_ns == stamp


def test_runs_on_different_code_are_not_paired():
    """A comparison pairs a seed only when both sides ran on one commit with the same changes."""
    table = evidence.TABLES["quickstart"]
    comparison = next(c for c in table.comparisons if c.baseline == "single")

    def run(seed, value, commit):
        return {"seed": seed, "commit": commit, "dirty": False, "values": {"success_after": value}}

    result = {"seeds": [0, 1, 2], "versions": {}, "variants": {
        "per_agent": {"runs": [run(0, 0.5, "aaa"), run(1, 0.6, "aaa"), run(2, 0.7, "aaa")]},
        "single": {"runs": [run(0, 0.1, "bbb"), run(1, 0.2, "aaa"), run(2, 0.3, "bbb")]},
    }}
    assert evidence.paired_values(result, comparison) == [(1, 0.6, 0.2)]
    lines = evidence.comparison_lines(table, result)
    assert any(comparison.what in line and "not paired" in line for line in lines)
    for r in result["variants"]["single"]["runs"]:
        r["commit"] = "aaa"
    assert [s for s, _, _ in evidence.paired_values(result, comparison)] == [0, 1, 2]
    assert not any("not paired" in line for line in evidence.comparison_lines(table, result))


def test_the_real_pair_table_compares_each_model_with_gspo_and_its_start():
    table = evidence.TABLES["hacpo_real"]
    assert [v.name for v in table.variants] == ["hacpo", "gspo"]
    assert table.resume and table.config == "configs/real/hacpo_math.yaml"
    config = yaml.safe_load((ROOT / table.config).read_text())
    assert sorted(config["policies"]["models"]) == sorted(evidence.REAL_PAIR_MODELS)
    compared = {(c.variant, c.baseline, c.key) for c in table.comparisons}
    for m in evidence.REAL_PAIR_MODELS:
        assert ("hacpo", "gspo", f"eval_{m}/success_rate") in compared
        assert ("hacpo", "hacpo", f"eval_{m}/success_rate") in compared
    text = evidence.note_texts(table, _committed("hacpo_real"))[0]
    assert "Against the untrained model: smollm2" in text and "twice the rollouts" not in text
    assert "<!-- evidence:hacpo_real_add:start -->" in (ROOT / "docs" / "evidence.md").read_text()


def test_the_real_pair_at_scale_runs_hacpo_at_both_clip_ranges_and_says_how_many_cross_samples_were_clipped():
    """hacpo_wide is HACPO with delta 0.8 (the config otherwise equal); the note quotes each
    variant's mean cross_clip_fraction per model over the runs that logged it, and says that no run
    kept it when none did."""
    from jmarl.config import load_config

    table = evidence.TABLES["hacpo_real_add"]
    wide = next(v for v in table.variants if v.name == "hacpo_wide")
    assert load_config(ROOT / table.config, list(wide.overrides)).algo.options["delta"] == 0.8
    assert load_config(ROOT / table.config, []).algo.options["delta"] == 0.2
    compared = {(c.variant, c.baseline) for c in table.comparisons}
    assert {("hacpo_wide", "gspo_2x"), ("hacpo_wide", "hacpo"), ("hacpo", "gspo_2x")} <= compared

    def run(seed, clip=None):
        values = {"eval_smollm2/success_rate": 0.5}
        if clip is not None:
            values |= {f"mean:train/{m}/cross_clip_fraction": c for m, c in zip(evidence.REAL_PAIR_MODELS, clip)}
            values |= {f"mean:train/{m}/cross_ratio_mean": 0.5 for m in evidence.REAL_PAIR_MODELS}
        return {"seed": seed, "commit": "aaa", "dirty": False, "values": values}

    result = {"seeds": [0, 1, 2], "versions": {}, "variants": {
        "hacpo": {"runs": [run(0), run(1, (1.0, 0.9)), run(2, (0.8, 1.0))]},
        "hacpo_wide": {"runs": [run(0, (0.25, 0.5))]},
    }}
    note = evidence._cross_clip_note(evidence.Facts(table, result))
    assert "with delta 0.2 (range [0.8, 1] at the first mini-batch), smollm2 90%, gemma3 95%" in note
    assert "2 runs per model" in note
    assert "with delta 0.8 (range [0.2, 1] at the first mini-batch), smollm2 25%, gemma3 50%" in note
    for v in result["variants"].values():
        v["runs"] = [run(r["seed"]) for r in v["runs"]]
    note = evidence._cross_clip_note(evidence.Facts(table, result))
    assert "No HACPO run here kept" in note and "%" not in note


def test_the_real_pair_signal_note_quotes_each_models_rollouts_and_update_size():
    table = evidence.TABLES["hacpo_real"]
    config = yaml.safe_load((ROOT / table.config).read_text())
    # hacpo/success_<i> is policy i, the i-th entry of policies.models: the note's order
    assert list(config["policies"]["models"]) == list(evidence.REAL_PAIR_MODELS)
    result = _committed("hacpo_real")
    note = next(t for t in evidence.note_texts(table, result) if t.startswith("Training rollouts"))

    def mean_over_runs(key):
        per_variant = [statistics.fmean(r["values"][key] for r in result["variants"][v]["runs"]) for v in ("hacpo", "gspo")]
        return statistics.fmean(per_variant)

    for i, m in enumerate(evidence.REAL_PAIR_MODELS):
        assert f"{m} {mean_over_runs(f'mean:hacpo/success_{i}'):.1%}" in note
        assert f"{m} {mean_over_runs(f'mean:rollout/{m}/truncated_fraction'):.0%}" in note
        assert f"{m} {mean_over_runs(f'mean:train/{m}/approx_kl'):.1e}" in note
    # rows recorded without these fields leave the note out instead of quoting a stale figure
    for v in result["variants"].values():
        for r in v["runs"]:
            r["values"].pop("mean:train/gemma3/approx_kl", None)
    assert not any(t.startswith("Training rollouts") for t in evidence.note_texts(table, result))
