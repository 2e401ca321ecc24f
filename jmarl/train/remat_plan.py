"""model.remat "auto" chosen by the memory planner.

Layer rematerialisation trades memory for recompute: "none" keeps every activation for the
backward pass (no recompute), "dots" keeps the dense layers' matrix-product outputs (recomputes
the cheap element-wise work), "full" keeps only each layer's input (recomputes the whole forward
pass). Where the device's memory is known (the trainer's check before step 0 on an accelerator,
or `python -m jmarl.memory_check --device-memory ...`), a policy group whose remat setting is
"auto" gets the first policy of `REMAT_ORDER` whose gradient programs (the RL update and the
warm-start update) fit the device less the headroom, by XLA's memory analysis of the compiled
programs; "full" when none does (the check then reports what to change). Elsewhere "auto" stays
the parameter-count rule of `jmarl.models.config.resolve_remat`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from jmarl.memory_check import ProgramMemory, analyse, format_size
from jmarl.memory_check.figures import figure_key
from jmarl.train.programs import trainer_programs

log = logging.getLogger(__name__)

# least recompute first: the planner keeps the first that fits
REMAT_ORDER: tuple[str, ...] = ("none", "dots", "full")
# the programs that run a backward pass through the layers, so whose memory remat changes
GRADIENT_PROGRAMS: tuple[str, ...] = ("update", "sft_update")


def remat_setting(config: Any, group_name: str) -> str:
    """The model.remat a policy group was configured with ("auto" or a policy): its own model's
    under policies.models.<name> in heterogeneous mode, else the run's model.remat."""
    if config.policies.mode == "heterogeneous":
        return config.policies.models[group_name].model.remat
    return config.model.remat


def gradient_figures(trainer: Any, group_index: int) -> list[ProgramMemory]:
    """XLA's memory figures of group `group_index`'s gradient programs as the trainer builds
    them now (compiled for its devices; nothing runs)."""
    name = trainer.policies.groups[group_index].name
    return [analyse(p) for p in trainer_programs(trainer)
            if p.group == name and p.program in GRADIENT_PROGRAMS]


def plan_remat(trainer: Any, device_memory: int, headroom: float,
               progress: Callable[[str], None] = log.info,
               measured: dict[tuple[str, str, str], ProgramMemory] | None = None) -> dict[str, str]:
    """Sets the remat policy of every group of `trainer` whose setting is "auto" to the first of
    `REMAT_ORDER` whose gradient programs fit in `device_memory` bytes less `headroom` (a
    fraction), rebuilding the group's device functions for it (`Trainer.set_remat`); "full"
    when none fits. Returns {group name: policy} for the groups it planned. measured: a dict
    that gets every figure compiled here, by `figure_key`, for the memory check to reuse."""
    limit = device_memory * (1.0 - headroom)
    chosen: dict[str, str] = {}
    for i, group in enumerate(trainer.policies.groups):
        if remat_setting(trainer.config, group.name) != "auto":
            continue
        for policy in REMAT_ORDER:
            trainer.set_remat(i, policy)
            figures = gradient_figures(trainer, i)
            if measured is not None:
                measured.update((figure_key(f), f) for f in figures)
            peak = max((f.peak for f in figures), default=0)
            fits = peak <= limit
            progress(f"model.remat auto: group {group.name!r} with remat {policy}: gradient programs peak at "
                     f"{format_size(peak)} per device, {'within' if fits else 'over'} {format_size(limit)}")
            if fits:
                break
        chosen[group.name] = policy  # the first that fits, else the last tried: full
        progress(f"model.remat auto: group {group.name!r} runs with remat {policy}")
    return chosen
