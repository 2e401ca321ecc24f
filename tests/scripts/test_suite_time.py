"""scripts/suite_time.py: reading a pytest run's output, and telling a cold cache from a warm one."""

from _scripts import load_script

suite_time = load_script("suite_time")

OUTPUT = """\
============================= slowest 25 durations =============================
160.24s setup    tests/test_gemma3_real.py::test_config_and_parameters_equal_transformers
115.59s call     tests/test_configs_train.py::test_config_trains_a_tiny_model_and_metrics_move[at_grpo/math]
0.50s teardown tests/test_x.py::test_y
=========================== short test summary info ============================
FAILED tests/scripts/test_readme_figures.py::test_seeds_sentence_quotes_the_evidence_table
========== 1 failed, 1255 passed, 3 skipped, 2 warnings in 2972.02s (0:49:32) ==========
"""


def test_the_counts_seconds_and_slowest_tests_of_a_run():
    got = suite_time.parse(OUTPUT)
    assert got["counts"] == {"failed": 1, "passed": 1255, "skipped": 3, "warnings": 2}
    assert got["pytest_seconds"] == 2972.02
    assert [(s["seconds"], s["phase"]) for s in got["slowest"]] == [(160.24, "setup"), (115.59, "call"), (0.5, "teardown")]
    assert got["slowest"][1]["test"].endswith("[at_grpo/math]")
    assert got["failed"] == ["tests/scripts/test_readme_figures.py::test_seeds_sentence_quotes_the_evidence_table"]


def test_the_suite_times_quoted_come_from_passing_runs():
    """The README's suite times render from results/suite_time/: each run there passed."""
    import json

    records = {str(p.relative_to(suite_time.RESULTS)): json.loads(p.read_text()) for p in sorted(suite_time.RESULTS.rglob("*.json"))}
    assert records, "no suite-time record"
    failing = {name: (r["exit_code"], r.get("failed"), r["counts"]) for name, r in records.items()
               if r["exit_code"] != 0 or r["counts"].get("failed") or r.get("failed")}
    assert not failing, f"suite times recorded from failing runs: {failing}"


def test_a_cache_is_cold_until_a_worker_has_written_programs_into_it(tmp_path):
    assert suite_time.is_cold(tmp_path)
    (tmp_path / "jmarl-test-jax-cache-gw0").mkdir()
    assert suite_time.is_cold(tmp_path)  # an empty cache folder holds nothing
    (tmp_path / "jmarl-test-jax-cache-gw0" / "entry").write_bytes(b"x")
    assert not suite_time.is_cold(tmp_path)


def test_file_totals_rank_the_costliest_files():
    record = {"tests": {"tests/a.py::t1": {"call": 1.0}, "tests/a.py::t2": {"call": 2.0},
                        "tests/b.py::t": {"setup": 9.0, "call": 1.0}},
              "files": {"tests/a.py": 3.0, "tests/b.py": 10.0}}
    assert suite_time.file_totals(record) == [{"file": "tests/b.py", "seconds": 10.0, "tests": 1},
                                              {"file": "tests/a.py", "seconds": 3.0, "tests": 2}]
    assert suite_time.file_totals(record, most=1)[0]["file"] == "tests/b.py"


def test_every_run_leaves_its_durations_in_the_temporary_directory(tmp_path):
    """tests/conftest.py writes each test's phases and each file's total at the session's end."""
    import json
    import os
    import subprocess
    import sys

    test = "tests/scripts/test_suite_time.py::test_file_totals_rank_the_costliest_files"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                          cwd=suite_time.ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = suite_time.newest_durations(tmp_path)
    assert written is not None and written.name.startswith("jmarl-test-durations-")
    record = json.loads(written.read_text())
    assert record["exit_status"] == 0
    assert set(record["tests"][test]) == {"setup", "call", "teardown"}
    assert record["files"]["tests/scripts/test_suite_time.py"] == round(sum(record["tests"][test].values()), 3)


def test_cpu_use_is_the_share_of_the_cores_capacity_over_the_wall_time():
    assert suite_time.cpu_use(150.0, 100.0, 2) == {"cpu_seconds": 150.0, "cores": 2, "core_utilization": 0.75}
    assert suite_time.cpu_use(0.0, 0.0, 2)["core_utilization"] == 0.0


def test_children_cpu_seconds_counts_a_finished_subprocess():
    import subprocess
    import sys

    before = suite_time.children_cpu_seconds()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    assert suite_time.children_cpu_seconds() - before > 0.05
