"""Checkpoints of the train state with orbax: atomic saves, keep-last-k, verified restores.

A checkpoint is one step directory holding two items:
- `state`: the train-state pytree (parameters, optimizer states, RNG keys, step counters...),
  written by orbax's PyTree handler. Typed RNG keys are stored as their raw key data.
- `meta`: a JSON document with the caller's metadata (data position, algorithm state such as
  HACPO's capability window or JoyAgents' memory, the config) and a CRC32 of every array leaf.

Orbax writes a step into a temporary directory and renames it when complete, so a save killed
halfway is never listed. `restore` recomputes the checksums: a checkpoint whose files were
truncated, deleted or bit-flipped on disk is reported with a warning and the previous one is
used instead.

    ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
    ckpt.save(step, state, meta={"data_position": 17, "config": config_to_dict(config)})
    restored = ckpt.restore(target=state)      # newest intact checkpoint
    state, meta, step = restored.state, restored.meta, restored.step
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jmarl.errors import JmarlError

log = logging.getLogger(__name__)

_FORMAT = 1


@dataclass(frozen=True)
class Restored:
    """A restored checkpoint: its step, the state (same structure as the target) and metadata."""

    step: int
    state: Any
    meta: dict[str, Any]


def _is_key(x: Any) -> bool:
    """True for a typed JAX PRNG key array (dtype key<impl>)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_saveable(leaf: Any) -> Any:
    """A leaf as an array orbax can write: key data for typed keys, numpy for host scalars."""
    if _is_key(leaf):
        return jax.random.key_data(leaf)
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return leaf
    return np.asarray(leaf)


def _checksum(arr: Any) -> str | None:
    """CRC32 of an array's dtype, shape and bytes; None when not all of it is on this host."""
    if isinstance(arr, jax.Array) and not arr.is_fully_addressable:
        return None
    host = np.ascontiguousarray(np.asarray(arr))
    header = f"{host.dtype.str}{host.shape}".encode()
    return f"{zlib.crc32(host.tobytes(), zlib.crc32(header)):08x}"


def _checksums(tree: Any) -> dict[str, str]:
    """Leaf path -> checksum for every leaf of a saveable tree."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        crc = _checksum(leaf)
        if crc is not None:
            out[jax.tree_util.keystr(path)] = crc
    return out


def _abstract(leaf: Any) -> Any:
    """The restore target of one saveable leaf (jax arrays keep their sharding)."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return leaf  # numpy array: restored as numpy


def _from_saved(target: Any, saved: Any) -> Any:
    """Converts a restored leaf back to the kind of its target leaf."""
    if _is_key(target):
        return jax.random.wrap_key_data(saved, impl=jax.random.key_impl(target))
    if isinstance(target, jax.Array) and not getattr(target, "committed", True):
        # an uncommitted target stays uncommitted: orbax returns arrays pinned to a device, and a
        # committed input compiles a different program (a resumed run would miss the cache)
        return jnp.asarray(np.asarray(saved))
    if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        return saved
    if isinstance(target, np.ndarray):
        return np.asarray(saved)
    if isinstance(target, np.generic):
        return np.asarray(saved, dtype=target.dtype)[()]
    if isinstance(target, (bool, int, float)):
        return type(target)(np.asarray(saved)[()])
    return saved


class Checkpointer:
    """Saves and restores train states under `directory`, keeping the `keep` newest steps.

    Call `save`/`restore` on every process of a multi-host run (orbax coordinates them).
    Keep at least 2 checkpoints so that a corrupt newest one has a fallback.
    """

    def __init__(
        self, directory: str | Path, keep: int = 3, *, async_save: bool = False, checksums: bool = True
    ):
        """keep: newest steps kept; async_save: write in a background thread (call `wait` or
        `close` before exiting); checksums: CRC32 every leaf on save (a host copy of the state)."""
        if keep < 1:
            raise JmarlError(f"checkpoint.keep: must be >= 1, got {keep}")
        self.directory = Path(directory).absolute()
        self.checksums = checksums
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,  # remove leftovers of saves that were killed
            create=True,
        )
        self._options = options
        self._opened: ocp.CheckpointManager | None = None

    @property
    def _manager(self) -> ocp.CheckpointManager:
        """orbax's manager, opened on first use: opening starts a background clean-up of killed
        saves, which must not outlive a process that built a trainer and never trained."""
        if self._opened is None:
            self._opened = ocp.CheckpointManager(self.directory, options=self._options, item_names=("state", "meta"))
        return self._opened

    def steps(self) -> list[int]:
        """The committed steps on disk, oldest first (not yet verified)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None) -> None:
        """Writes `state` (any pytree of arrays/scalars/typed keys) and JSON-able `meta` at `step`.

        A step that already exists (left by a run that was resumed from an earlier step) is
        replaced. The write is atomic: a killed save leaves the previous checkpoints intact.
        """
        self._manager.wait_until_finished()
        saveable = jax.tree.map(_to_saveable, state)
        document = {
            "format": _FORMAT,
            "step": int(step),
            "meta": dict(meta or {}),
            "checksums": _checksums(saveable) if self.checksums else {},
        }
        if int(step) in self.steps():
            self._manager.delete(int(step))
        self._manager.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(saveable), meta=ocp.args.JsonSave(document)),
            force=True,
        )

    def wait(self) -> None:
        """Blocks until an asynchronous save has been committed."""
        self._manager.wait_until_finished()

    def restore(self, target: Any, step: int | None = None) -> Restored:
        """Restores into `target`'s structure, dtypes and shardings, verifying every checksum.

        `target` is a pytree like the one saved (concrete arrays, or jax.ShapeDtypeStruct leaves
        for non-key arrays). step None: the newest intact checkpoint; a corrupt one is skipped
        with a warning. An explicit `step` that is missing or corrupt raises JmarlError.
        """
        self._manager.wait_until_finished()
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise JmarlError(f"no checkpoint for step {step} in {self.directory}; available: {steps}")
            try:
                return self._restore_step(target, step)
            except _Corrupt as e:
                raise JmarlError(f"checkpoint {step} in {self.directory} is corrupt: {e}") from None
        if not steps:
            raise JmarlError(f"no checkpoint to resume from in {self.directory}")
        problems = []
        for candidate in reversed(steps):
            try:
                return self._restore_step(target, candidate)
            except _Corrupt as e:
                log.warning(
                    "checkpoint %d in %s is unusable (%s); trying an earlier one",
                    candidate,
                    self.directory,
                    e,
                )
                problems.append(f"step {candidate}: {e}")
        raise JmarlError(f"no intact checkpoint in {self.directory}: " + "; ".join(problems))

    def _restore_step(self, target: Any, step: int) -> Restored:
        saveable_target = jax.tree.map(_to_saveable, target)
        abstract = jax.tree.map(_abstract, saveable_target)
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(abstract, restore_args=restore_args),
                    meta=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:  # orbax/tensorstore raise many kinds on damaged files
            raise _Corrupt(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
        document = restored["meta"]
        if not isinstance(document, dict) or document.get("format") != _FORMAT:
            raise _Corrupt("metadata missing or unreadable")
        saved = restored["state"]
        if jax.tree.structure(saved) != jax.tree.structure(saveable_target):
            raise _Corrupt("the saved tree has a different structure than the target")
        expected = document["checksums"]
        if expected:
            for key, crc in _checksums(saved).items():
                if expected.get(key) != crc:
                    raise _Corrupt(f"checksum mismatch at {key}")
        state = jax.tree.map(_from_saved, target, saved)
        return Restored(step=int(document["step"]), state=state, meta=document["meta"])

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        if self._opened is not None:
            self._opened.wait_until_finished()
            self._opened.close()
            self._opened = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Corrupt(Exception):
    """A checkpoint on disk that cannot be restored intact."""
