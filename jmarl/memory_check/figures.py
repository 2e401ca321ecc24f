"""XLA's memory figures of compiled programs, per device, and whether they fit (the leaf of
`jmarl.memory_check`: it knows programs, not runs; `Trainer.programs()` lists a run's).

`analyse` lowers and compiles one `Program` (nothing runs) and reads
`compiled.memory_analysis()`; `check` does it for a run's programs and raises a JmarlError
naming the program and the settings to change when one does not fit.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from jmarl.errors import JmarlError

log = logging.getLogger(__name__)

# what to change when a program does not fit
_ADVICE = {
    "update": "raise optim.minibatches or optim.grad_accum, shard more (mesh.fsdp), set model.remat=full, "
              "or lower sampling.max_prompt_len / max_new_tokens",
    "sft_update": "lower train.warm_start.demos, shard more (mesh.fsdp), set model.remat=full, "
                  "or lower sampling.max_prompt_len / max_new_tokens",
    "score": "lower workflow.num_tasks or workflow.group_size (the step's batch is scored at once), shard more "
             "(mesh.fsdp), or lower sampling.max_prompt_len / max_new_tokens",
    "generate": "lower workflow.num_tasks or workflow.group_size (rows per sampler call), "
                "sampling.max_new_tokens or sampling.max_prompt_len, or shard the parameters more (mesh.fsdp)",
}
_ADVICE["score_ref"] = _ADVICE["score"]
_ADVICE["engine_decode"] = _ADVICE["engine_prefill"] = (
    "lower sampling.kv_budget_bytes (fewer slots), sampling.max_new_tokens or sampling.max_prompt_len, "
    "or shard more (mesh.data / mesh.fsdp split the slots, mesh.fsdp the parameters)")


@dataclass(frozen=True)
class ProgramMemory:
    """XLA's memory analysis of one compiled program, bytes per device (see the module
    docstring), plus the run's resident device state while it runs and the bounds it was
    compiled for (`shapes`)."""

    program: str
    group: str
    state: int
    temporaries: int
    outputs: int
    aliased: int
    code: int
    resident: int
    compile_seconds: float
    shapes: dict[str, Any] = field(default_factory=dict)
    remat: str = "none"  # the group's layer remat policy (what the advice may suggest)

    @property
    def total(self) -> int:
        """Arguments + temporaries + outputs - aliased (donated) bytes."""
        return self.state + self.temporaries + self.outputs - self.aliased

    @property
    def peak(self) -> int:
        """total + resident: what the device holds while the program runs."""
        return self.total + self.resident

    @property
    def label(self) -> str:
        """'update of group 'per_agent''."""
        return f"{self.program} of group {self.group!r}"

    def to_json(self) -> dict[str, Any]:
        """Every figure in bytes (and the bounds), for --json."""
        out = dataclasses.asdict(self)
        out.update(total=self.total, peak=self.peak)
        return out


@dataclass(frozen=True)
class Program:
    """One program to compile: the run's jitted object, the abstract arguments to lower it
    with (carrying the run's shardings), the resident bytes per device and its bounds."""

    program: str
    group: str
    jitted: Any
    args: tuple
    resident: int
    shapes: dict[str, Any]
    remat: str = "none"


def format_size(n: float) -> str:
    """Bytes as '93.1 GiB' / '12.0 MiB' / '3.0 KiB' / '12 B' (whole numbers without decimals)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(n)} B"


# XLA:CPU options that skip LLVM's expensive passes: the buffer assignment (hence every figure)
# is the same, the compile 2-3x faster. Used when the programs are compiled for CPU devices.
CPU_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def analyse(program: Program) -> ProgramMemory:
    """Lowers and compiles `program` (nothing runs) and reads XLA's memory analysis."""
    import jax

    t0 = time.perf_counter()
    from jmarl.sharding import mesh_context, mesh_of

    with mesh_context(mesh_of(program.args)):  # as the run traces it (`ShardedFn`, the sampler)
        lowered = program.jitted.lower(*program.args)
    options = CPU_FAST_COMPILE if jax.default_backend() == "cpu" else None
    stats = lowered.compile(compiler_options=options).memory_analysis()
    if stats is None:
        raise JmarlError(
            f"XLA gives no memory analysis for {program.program} on {jax.default_backend()}; plan on simulated "
            "CPU devices instead (python -m jmarl.memory_check --devices N) or set train.memory_check=off"
        )
    return ProgramMemory(
        program=program.program, group=program.group, state=int(stats.argument_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes), outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes), code=int(stats.generated_code_size_in_bytes),
        resident=int(program.resident), compile_seconds=time.perf_counter() - t0, shapes=dict(program.shapes),
        remat=program.remat,
    )


def figure_key(item: Program | ProgramMemory) -> tuple[str, str, str]:
    """(group, program, remat): what names a program's figures among a run's."""
    return item.group, item.program, item.remat


def analyse_all(programs: Sequence[Program], progress: Callable[[str], None] | None = None,
                known: Mapping[tuple[str, str, str], ProgramMemory] | None = None) -> list[ProgramMemory]:
    """Compiles every one of `programs` (a run's: `Trainer.programs()`) and returns their
    figures; `progress` gets a line before and after each compile. known: figures already
    measured on the same build, by `figure_key` (the remat planner's), taken instead of compiling
    again."""
    figures = []
    for i, p in enumerate(programs, 1):
        got = (known or {}).get(figure_key(p))
        if progress:
            how = "measured while planning remat" if got else "compiling"
            progress(f"[{i}/{len(programs)}] {how} {p.program} of group {p.group!r} ...")
        got = got or analyse(p)
        figures.append(got)
        if progress:
            progress(f"      {format_size(got.peak)} peak per device, compiled in {got.compile_seconds:.1f} s")
    return figures


def device_memory_of(given: int | None) -> tuple[int | None, str]:
    """(bytes per device, where it came from): `given` (bytes: a parsed train.device_memory),
    else the first device's own `memory_stats()['bytes_limit']`, else (None, 'unknown')."""
    import jax

    if given is not None:
        return int(given), "given"
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # backends without memory stats (CPU)
        stats = {}
    limit = stats.get("bytes_limit")
    return (int(limit), "the device") if limit else (None, "unknown")


def over_limit(figures: Sequence[ProgramMemory], device_memory: int, headroom: float) -> str | None:
    """The one-line message for the program with the largest peak over device_memory x
    (1 - headroom), or None when every program fits."""
    limit = device_memory * (1.0 - headroom)
    over = [f for f in figures if f.peak > limit]
    if not over:
        return None
    worst = max(over, key=lambda f: f.peak)
    advice = _ADVICE[worst.program]
    if worst.remat == "full":  # already keeps only each layer's input
        advice = advice.replace(" set model.remat=full,", "")
    return (
        f"{worst.label} needs {format_size(worst.peak)} per device, over {format_size(limit)} "
        f"({format_size(device_memory)} less {headroom:.0%} headroom): {advice}"
    )


def table(figures: Sequence[ProgramMemory], limit: float | None = None) -> str:
    """The per-device table, one row per program, in the unit of the largest peak; with a
    `limit` (bytes per device) a last column says whether each peak fits under it."""
    top = max((f.peak for f in figures), default=0)
    unit, size = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top >= s), ("B", 1))
    cols = ("state", "temporaries", "outputs", "aliased", "total", "resident", "peak")
    names = [f"{f.program} [{f.group}]" for f in figures]
    width = max([len(n) for n in names] + [len(f"per device ({unit})")])
    head = f"{'per device (' + unit + ')':<{width}}  " + "  ".join(f"{c:>11}" for c in cols)
    lines = [head + ("  fits" if limit is not None else "")]
    for name, f in zip(names, figures):
        values = (f.state, f.temporaries, f.outputs, f.aliased, f.total, f.resident, f.peak)
        row = f"{name:<{width}}  " + "  ".join(f"{v / size:>11.2f}" for v in values)
        lines.append(row + ("" if limit is None else "  yes" if f.peak <= limit else "  NO"))
    return "\n".join(lines)


def check(programs: Sequence[Program], device_memory: int | None, headroom: float,
          progress: Callable[[str], None] = log.info,
          known: Mapping[tuple[str, str, str], ProgramMemory] | None = None) -> list[ProgramMemory]:
    """The trainer's check before step 0: compiles `programs` (on the real devices and arrays;
    `known`: see `analyse_all`), logs the figures, raises JmarlError (the same one line as the
    CLI) when one does not fit in `device_memory` bytes (train.device_memory, parsed; None: the
    device's own) less `headroom`."""
    figures = analyse_all(programs, progress=progress, known=known)
    for line in table(figures).splitlines():
        progress(line)
    limit, _ = device_memory_of(device_memory)
    if limit is None:
        log.warning("memory check: the device reports no memory limit; set train.device_memory (e.g. 80GiB)")
        return figures
    message = over_limit(figures, limit, headroom)
    if message:
        raise JmarlError(message)
    progress(f"memory check: every program fits in {format_size(limit)} less {headroom:.0%} headroom")
    return figures
