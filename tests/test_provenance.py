"""Every result file says what made it (`jmarl.provenance`): its code, command, machine, libraries, date."""

import json
import subprocess
from pathlib import Path


from jmarl import provenance

REPO = Path(__file__).resolve().parents[1]
RESULT_DIRS = ("results", "benchmarks/results")

# Written before results carried a provenance record; each is to be re-run on a clean commit and
# then taken off this list (the test fails while a listed file already has its record).
LEGACY = frozenset({
    'benchmarks/results/gpu.json',
    'benchmarks/results/gpu_attention.json',
})


def _result_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for d in RESULT_DIRS for p in (REPO / d).rglob("*.json"))


def test_every_result_file_has_a_clean_provenance_record_or_is_listed_as_legacy():
    files = _result_files()
    assert files, "no result files found"
    lacking, clean_legacy = [], []
    for name in files:
        result = json.loads((REPO / name).read_text())
        gaps = provenance.missing(result)
        dirty = not gaps and result[provenance.KEY]["dirty"]
        if name in LEGACY:
            if not gaps:
                clean_legacy.append(name)
        elif gaps or dirty:
            lacking.append(f"{name}: " + (f"no {', '.join(gaps)}" if gaps else "made from a dirty tree"))
    assert not lacking, "result files without a clean provenance record:\n" + "\n".join(lacking)
    assert not clean_legacy, "now recorded, take off LEGACY: " + ", ".join(clean_legacy)
    assert LEGACY <= set(files), "LEGACY names files that are gone: " + ", ".join(sorted(LEGACY - set(files)))


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def test_code_state_sees_tracked_changes_and_new_files_under_the_watched_paths(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "jmarl").mkdir()
    (tmp_path / "jmarl" / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("free text\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    clean = provenance.code_state(tmp_path)
    assert clean["dirty"] is False and clean["diff"] is None and len(clean["commit"]) >= 7
    (tmp_path / "notes.txt").write_text("edited outside the watched paths\n")
    assert provenance.code_state(tmp_path)["dirty"] is False
    (tmp_path / "benchmarks" / "results" / "r.json").write_text('{"re-run": 1}\n')  # a result, not code
    (tmp_path / "benchmarks" / "results" / "new.json").write_text("{}\n")
    assert provenance.code_state(tmp_path)["dirty"] is False
    (tmp_path / "benchmarks" / "b.py").write_text("z = 1\n")  # a benchmark's code is watched
    assert provenance.code_state(tmp_path)["dirty"] is True
    (tmp_path / "benchmarks" / "b.py").unlink()
    (tmp_path / "jmarl" / "new.py").write_text("y = 2\n")  # untracked, under jmarl/
    new = provenance.code_state(tmp_path)
    assert new["dirty"] is True and new["diff"]
    (tmp_path / "jmarl" / "new.py").write_text("y = 3\n")
    assert provenance.code_state(tmp_path)["diff"] != new["diff"]  # the hash covers the new file's bytes
    (tmp_path / "jmarl" / "new.py").unlink()
    (tmp_path / "jmarl" / "a.py").write_text("x = 2\n")
    assert provenance.code_state(tmp_path)["dirty"] is True


def test_a_record_has_every_field_and_missing_names_the_gaps():
    record = provenance.record("python -m x", root=REPO)
    assert provenance.missing({provenance.KEY: record}) == []
    assert record["command"] == "python -m x" and "jax" in record["versions"] and record["machine"]
    assert provenance.missing({}) == list(provenance.FIELDS)
    assert provenance.missing({provenance.KEY: {**record, "command": ""}}) == ["command"]


def test_the_machine_names_the_cpus_widest_vector_extension():
    """XLA:CPU compiles for the host's vector extensions, so two CPUs of one model name that
    differ in them give different numbers: the machine string tells them apart."""
    assert provenance.vector_extension("fpu sse4_2 avx avx2 fma") == "AVX2"
    assert provenance.vector_extension("fpu avx2 avx512f avx512bw") == "AVX-512"
    assert provenance.vector_extension("fp asimd sve") == "SVE" and provenance.vector_extension("fp asimd") == "NEON"
    assert provenance.vector_extension("fpu") is None
    vector = provenance.vector_extension()
    if vector is not None:  # a CPU backend: the name carries it
        assert f"({vector}), " in provenance.machine()
