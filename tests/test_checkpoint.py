"""Checkpoints: bitwise round trip, keep-k, corrupt files detected with fallback, kill mid-save."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmarl.errors import JmarlError
from jmarl.train.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[1]


def make_state(seed: int = 0):
    """A train state like the trainer's: bf16/f32 params, AdamW state, typed keys, host scalars."""
    k = jax.random.key(seed)
    params = {
        "embed": jax.random.normal(k, (16, 8), jnp.bfloat16),
        "layers": [{"w": jax.random.normal(jax.random.fold_in(k, i), (8, 8), jnp.float32)} for i in range(2)],
        "bias": jnp.arange(5, dtype=jnp.int32) + seed,
    }
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.1, params)
    _, opt_state = tx.update(grads, opt_state, params)
    return {
        "params": params,
        "opt_state": opt_state,
        "rng": jax.random.fold_in(jax.random.key(7), seed),
        "rng_rbg": jax.random.key(3, impl="rbg"),
        "host_counts": np.arange(6, dtype=np.int16) * (seed + 1),
        "step": 10 + seed,
        "temperature": 0.5 + seed,
    }


def leaf_bytes(tree):
    """Per leaf: type name, dtype and raw bytes (key data for typed keys)."""
    out = []
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(leaf)).tobytes()
            out.append(("key", str(jax.random.key_impl(leaf)), data))
        elif isinstance(leaf, (jax.Array, np.ndarray)):
            out.append((type(leaf).__name__, str(leaf.dtype), leaf.shape, np.asarray(leaf).tobytes()))
        else:
            out.append((type(leaf).__name__, repr(leaf)))
    return out


def test_round_trip_is_bitwise(tmp_path):
    state = make_state(1)
    meta = {"data_position": 17, "capability_window": [[0.5, 0.25]], "config": {"seed": 3}}
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(4, state, meta)
    # A different state of the same structure as the target: values must come from disk.
    restored = ckpt.restore(make_state(0))
    assert restored.step == 4
    assert restored.meta == meta
    assert jax.tree.structure(restored.state) == jax.tree.structure(state)
    assert leaf_bytes(restored.state) == leaf_bytes(state)
    # Restored keys are usable typed keys that continue the same random stream.
    draws = [jax.random.uniform(s["rng"], (3,)) for s in (restored.state, state)]
    assert jnp.array_equal(*draws)
    ckpt.close()


def test_restore_into_abstract_target(tmp_path):
    state = {"w": jnp.linspace(0, 1, 12, dtype=jnp.float32).reshape(3, 4), "b": jnp.ones(2, jnp.bfloat16)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, state)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        restored = ckpt.restore(abstract)
    assert leaf_bytes(restored.state) == leaf_bytes(state)


def test_keeps_last_k_and_latest_step(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    assert ckpt.latest_step() is None
    for step in range(5):
        ckpt.save(step, make_state(step), {"step_seen": step})
    assert ckpt.steps() == [3, 4]
    assert ckpt.latest_step() == 4
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]
    # An explicit older step is restorable; a deleted one is reported by name.
    older = ckpt.restore(make_state(0), step=3)
    assert older.meta == {"step_seen": 3}
    assert leaf_bytes(older.state) == leaf_bytes(make_state(3))
    with pytest.raises(JmarlError, match="no checkpoint for step 1"):
        ckpt.restore(make_state(0), step=1)


def test_saving_an_existing_step_replaces_it(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=3)
    ckpt.save(2, make_state(0))
    ckpt.save(2, make_state(5))
    assert ckpt.steps() == [2]
    assert leaf_bytes(ckpt.restore(make_state(0)).state) == leaf_bytes(make_state(5))


def _largest_file(step_dir: Path) -> Path:
    files = [p for p in step_dir.rglob("*") if p.is_file() and "state" in p.parts]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(step_dir: Path) -> None:
    path = _largest_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _delete(step_dir: Path) -> None:
    _largest_file(step_dir).unlink()


def _flip_byte(step_dir: Path) -> None:
    # Silent corruption: the file still parses, only the checksum can tell.
    path = _largest_file(step_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _delete_meta(step_dir: Path) -> None:
    (step_dir / "meta" / "metadata").unlink()


@pytest.mark.parametrize(
    "damage", [_truncate, _delete, _flip_byte, _delete_meta], ids=lambda f: f.__name__[1:]
)
def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog, damage):
    state_size = 4096  # random values: the array's data file is the largest file (no compression)
    ckpt = Checkpointer(tmp_path, keep=3)
    states = {s: {"w": jax.random.normal(jax.random.key(s), (state_size,)), "step": s} for s in (1, 2)}
    for s, st in states.items():
        ckpt.save(s, st, {"s": s})
    damage(tmp_path / "2")
    target = {"w": jnp.zeros((state_size,), jnp.float32), "step": 0}
    with caplog.at_level(logging.WARNING, logger="jmarl.train.checkpoint"):
        restored = Checkpointer(tmp_path, keep=3).restore(target)
    assert restored.step == 1
    assert restored.meta == {"s": 1}
    assert leaf_bytes(restored.state) == leaf_bytes(states[1])
    assert any("checkpoint 2" in r.getMessage() and "unusable" in r.getMessage() for r in caplog.records)
    with pytest.raises(JmarlError, match="checkpoint 2 .* is corrupt"):
        ckpt.restore(target, step=2)


def test_nothing_restorable_is_a_clear_error(tmp_path):
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    with pytest.raises(JmarlError, match="no checkpoint to resume from"):
        ckpt.restore({"w": jnp.zeros(3)})
    ckpt.save(0, {"w": jax.random.normal(jax.random.key(0), (4096,))})
    _truncate(tmp_path / "ck" / "0")
    with pytest.raises(JmarlError, match="no intact checkpoint"):
        ckpt.restore({"w": jnp.zeros(4096)})


_SAVE_LOOP = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    import jax
    from jmarl.train.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], keep=2)
    base = jax.random.normal(jax.random.key(0), (1 << 21,))  # random: incompressible
    for step in range(1000):
        print("saving", step, flush=True)
        ckpt.save(step, {"w": base + step, "step": step}, {"step": step})
        print("saved", step, flush=True)
    """
)


def test_kill_during_save_leaves_directory_restorable(tmp_path):
    """SIGKILL a process in the middle of its 4th save (8 MB state): the directory stays usable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVE_LOOP, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=env,
    )
    completed, started = [], {}
    try:
        for line in proc.stdout:
            word, step = line.split()
            now = time.monotonic()
            if word == "saving":
                started[int(step)] = now
            if word == "saved":
                completed.append(int(step))
                save_seconds = now - started[int(step)]
            if word == "saving" and int(step) == 3:
                break
        time.sleep(save_seconds / 2)  # land in the middle of the 4th save
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert completed == [0, 1, 2]
    # Typically a '3.orbax-checkpoint-tmp' directory is left here; it must never be listed.
    target = {"w": jnp.zeros((1 << 21,), jnp.float32), "step": 0}
    ckpt = Checkpointer(tmp_path, keep=2)
    assert set(ckpt.steps()) <= {1, 2, 3}  # never a half-written step
    restored = ckpt.restore(target)
    assert restored.step in (2, 3)
    assert restored.meta == {"step": restored.step}
    assert restored.state["step"] == restored.step
    expected = jax.random.normal(jax.random.key(0), (1 << 21,)) + restored.step
    assert np.array_equal(np.asarray(restored.state["w"]), np.asarray(expected))
    # Training can go on: the next save succeeds and becomes the latest.
    ckpt.save(4, target)
    assert ckpt.latest_step() == 4


def test_without_checksums_round_trip_still_works(tmp_path):
    state = make_state(2)
    with Checkpointer(tmp_path, checksums=False, async_save=True) as ckpt:
        ckpt.save(1, state, {"a": 1})
        ckpt.wait()
        assert ckpt.steps() == [1]
        restored = ckpt.restore(make_state(0))
    assert leaf_bytes(restored.state) == leaf_bytes(state) and restored.meta == {"a": 1}


def test_a_process_that_never_saves_exits_cleanly(tmp_path):
    """Building a checkpointer (as every trainer does) and exiting without a save or a close, as a
    script or a notebook that builds a trainer and stops does, prints nothing: orbax's clean-up
    thread starts with the first save or restore, not before."""
    script = textwrap.dedent(f"""
        from jmarl.train.checkpoint import Checkpointer
        Checkpointer({str(tmp_path / "ck")!r}, keep=2)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
