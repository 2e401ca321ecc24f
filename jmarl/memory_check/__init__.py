"""Does a run fit in device memory? Its own programs, compiled for N devices, and XLA's figures.

    python -m jmarl.memory_check --config configs/at_grpo/plan_path.yaml --devices 8 --device-memory 80GiB
    python -m jmarl.memory_check --config X.yaml model.preset=qwen3-8b mesh.fsdp=8 --devices 8 --json plan.json

What the figures are. For each program the run executes, XLA's own memory analysis of the
compiled program (`compiled.memory_analysis()`), per device: `state` (argument buffers:
parameters, optimizer state, reference, KV cache, batch), `temporaries` (XLA's temp buffers:
activations, gradients, workspaces), `outputs`, `aliased` (outputs written into donated
arguments), `total` = state + temporaries + outputs - aliased, `resident` (device state of the
run that is not an argument of that program but stays in memory while it runs: the optimizer
state and reference during generation, the other policy groups, the old log-probs kept while
the reference scores) and `peak` = total + resident. A run fits when every program's peak fits
in the device memory less a headroom (default 10%).

What they are not. Host memory (rollouts, tokenizers, the Python heap) is not included; nor is
the allocator's fragmentation, nor what the runtime adds outside a program (collective
buffers, kernel workspaces, a second copy while an array is resharded): hence the headroom.
Simulated CPU devices (--devices) give the figures of XLA's CPU compiler (compiled without
LLVM's expensive passes, `CPU_FAST_COMPILE`: the same buffers, a faster compile); an accelerator's
compiler fuses differently and picks its own attention kernels, so its figures differ (the
trainer's own check before step 0 compiles for the real devices, see below).

The run's own programs. `Trainer(config, abstract=True)` builds the run exactly as training
does (policies, optimizer, device functions built with their shardings on the config's mesh:
`jmarl.sharding.group_shardings`) with every array a `jax.ShapeDtypeStruct` (`jax.eval_shape`
over the initialisers: an 8B model is checked on a laptop), and `Trainer.programs()` lists, per
policy group, those very jitted objects with abstract arguments carrying the run's shardings
and the shapes they are compiled for (`jmarl.train.programs`):

    sft_update  the warm-start update (only when train.warm_start.steps > 0), state donated
    generate    the sampler's program (prefill + decode, KV cache) for its largest call
    score       old log-probs over the step's batch (train.recompute_old_logprobs, or HACPO)
    score_ref   reference log-probs (only when a KL term keeps a reference)
    update      the RL update: mini-batches x grad-accum micro-batches, state donated

The command line (`jmarl.memory_check.cli`) builds that run from a config without reading any
weights.

Device memory: --device-memory, else train.device_memory, else the device's own
(`memory_stats()["bytes_limit"]`); simulated CPU devices have none, so without either the
figures are reported and no limit is checked. Exit 0 when every program fits (or nothing was
checked), 2 with one line on stderr when one does not (naming it, its peak, the limit and the
settings to change) or on bad input.

The trainer runs the same check before step 0 (`Trainer.check_memory` -> `check`) when
train.memory_check is "on", or "auto" on an accelerator, on the real devices and arrays.
"""

from jmarl.memory_check.figures import (
    CPU_FAST_COMPILE,
    Program,
    ProgramMemory,
    analyse,
    analyse_all,
    check,
    device_memory_of,
    format_size,
    over_limit,
    table,
)

__all__ = [
    "CPU_FAST_COMPILE",
    "Program",
    "ProgramMemory",
    "analyse",
    "analyse_all",
    "check",
    "device_memory_of",
    "format_size",
    "over_limit",
    "table",
]
