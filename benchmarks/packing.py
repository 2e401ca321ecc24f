"""The learner's packed layout against the previous shared-prefix layout, on recorded batches.

    python -m benchmarks.packing [--steps 6] [--repeats 3] [--configs quickstart hacpo joyagents]
                                 [--overrides KEY=VALUE ...]

Runs each config's trainer (warm start as configured, or `--warm-start` steps; `--steps` RL
steps; evaluation and checkpoints off; `--overrides`: config overrides applied last, e.g. a
smaller run for a smoke test, recorded in each row) and records every batch the learner builds
(each policy group's step records). For every recorded batch it lays the samples out both ways:
- packed (`jmarl.train.packing`, what the trainer runs): each micro-batch's distinct prompts and
  their continuations in rows of a token budget;
- shared prefix (`benchmarks.shared_prefix_layout`, the previous layout): distinct prompts
  [U, P] left-padded to a length bucket, continuations [N, C] right-padded to the longest.

Token utilization = real tokens (distinct prompt tokens + continuation tokens) / token slots
the update computes (packed: rows x L of the policies the step updates, `active_policies`: a
stacked group's policies without samples are not computed; shared prefix, which computed every
policy of a stack: U x P + N x C), summed over the run.
On the `--time` configs (default: the quickstart) it then times one optimizer update of each
layout on the same batches (the method's loss, advantages and old log-probs from the trainer's
scoring pass, identical [N, C] fields), compiled once per shape before timing, interleaved,
best of `--repeats`: real tokens per second of the update, summed over the batches.
Writes benchmarks/results/packing.json.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

from benchmarks.common import results_end, results_header, timed, write_json

CONFIGS = {
    "quickstart": "configs/quickstart.yaml",
    "hacpo": "configs/hacpo/plan_path_tiny.yaml",
    "joyagents": "configs/joyagents/router_tiny.yaml",
}


def record(path: str, steps: int, warm_start: int | None, out_dir: str,
           extra: list[str] | None = None) -> tuple[Any, list[tuple[Any, Any, Any, Any]]]:
    """(trainer, [(group, group fns, the step's sample records, the packed LearnerBatch the
    trainer built)]) for `steps` RL steps of the config at `path` (`extra`: config overrides
    applied after the benchmark's own)."""
    import jmarl.train.learn as learn_mod
    import jmarl.train.trainer as trainer_mod
    from jmarl.config import load_config

    overrides = [f"output_dir={out_dir}", f"train.steps={steps}", "eval.every=0", "checkpoint.every=0",
                 "logging.tensorboard=false", "logging.plots=false", "logging.progress=false"]
    if warm_start is not None:
        overrides.append(f"train.warm_start.steps={warm_start}")
    overrides += list(extra or [])
    trainer = trainer_mod.Trainer(load_config(path, overrides))
    seen: list[tuple[Any, Any, Any, Any]] = []
    original = learn_mod.learner_batch

    def recording(group, records, *args, **kwargs):
        fns = trainer.fns[trainer.policies.groups.index(group)]
        batch, counts = original(group, records, *args, **kwargs)
        seen.append((group, fns, records, batch))
        return batch, counts

    learn_mod.learner_batch = recording
    try:
        trainer.run()
    finally:
        learn_mod.learner_batch = original
    return trainer, seen


def plain_rows(records: Any, size: int) -> dict[str, Any]:
    """The records as `size` whole sequences in [size, T] rows (prompt then completion,
    right-padded; loss_mask on the completion; padding rows empty): the shared-prefix layout's input."""
    import numpy as np

    seqs = [(np.asarray(r.completion.prompt_tokens).reshape(-1), np.asarray(r.completion.completion_tokens).reshape(-1))
            for r in records]
    t = max([p.size + c.size for p, c in seqs] + [1])
    tokens = np.zeros((size, t), np.int32)
    attn = np.zeros((size, t), bool)
    loss = np.zeros((size, t), bool)
    for i, (p, c) in enumerate(seqs):
        tokens[i, :p.size + c.size] = np.concatenate([p, c])
        attn[i, :p.size + c.size] = True
        loss[i, p.size:p.size + c.size] = True
    return {"tokens": tokens, "attention_mask": attn, "loss_mask": loss}


def layouts(trainer: Any, group: Any, records: Any, packed: Any) -> tuple[Any, dict[str, Any], list[int]]:
    """(the trainer's packed LearnerBatch, the same samples as shared-prefix arrays
    [policy-stacked when the group is], counts)."""
    import numpy as np

    from benchmarks.shared_prefix_layout import to_shared_prefix
    from jmarl.train.learner import batch_rows, records_by_policy

    mine = records_by_policy(records, group.policy_ids)
    counts = [len(mine[p]) for p in group.policy_ids]
    size = batch_rows(counts, trainer.parts, trainer.rows_bound())
    shared = to_shared_prefix([plain_rows(mine[p], size) for p in group.policy_ids], trainer.parts)
    keys = ("prefix_tokens", "prefix_mask", "prefix_rows", "tokens", "attention_mask")
    stacked = {k: np.stack([s[k] for s in shared]) if group.stacked else shared[0][k] for k in keys}
    return packed, stacked, counts


def utilization(packed: Any, shared: dict[str, Any], counts: list[int], stacked: bool) -> dict[str, int]:
    """Real tokens and the slots each layout computes for one batch (packed: the policies the
    trainer's step updates, `active_policies`)."""
    import numpy as np

    from jmarl.train.learner import active_policies

    segment = np.asarray(packed.packed_segment)
    real = int(np.count_nonzero(segment))
    shared_real = int(np.count_nonzero(shared["prefix_mask"]) + np.count_nonzero(shared["attention_mask"]))
    assert real <= shared_real  # the shared layout's empty-continuation prompts are the only difference
    active = active_policies(counts, stacked)
    computed = segment if active is None else segment[active]
    return {"real": real, "packed_slots": int(computed.size),
            "shared_slots": int(shared["prefix_mask"].size + shared["attention_mask"].size)}


def shared_prefix_update(trainer: Any, group: Any):
    """The group's update with the model run in the shared-prefix layout: batch = (LearnerBatch
    with the loss fields, shared-prefix arrays)."""
    import jax.numpy as jnp

    from benchmarks.shared_prefix_layout import shared_prefix_logprobs
    from jmarl.train.learner import model_params
    from jmarl.train.step import jit_update, make_update

    params_of = model_params(group)

    def loss(trainable, frozen, batch):
        fields, shared = batch  # one micro-batch: its own counts are the mini-batch's
        mask = fields.loss_mask
        fields = fields.replace(update_index=jnp.zeros((), jnp.int32), num_tokens=jnp.sum(mask, dtype=jnp.float32),
                                num_rows=jnp.sum(jnp.any(mask, axis=-1), dtype=jnp.float32))
        lp = shared_prefix_logprobs(group.model_config, params_of(trainable, frozen), shared, trainer.temperature)
        return trainer.method.loss(trainer.algo_cfg, lp, fields)

    return jit_update(make_update(loss, trainer.optimizer), stacked=group.stacked, frozen_stacked=False)


def time_updates(trainer: Any, seen: list, repeats: int) -> dict[str, Any]:
    """Seconds per update of both layouts on every recorded batch (best of `repeats`, each after
    a compile call), and the real tokens they cover."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jmarl.train.learner import active_policies, restrict, score_batch

    if trainer.parts != 1:
        raise SystemExit("timing compares one update of a single micro-batch: use a config with 1 mini-batch, no accumulation")
    out = {"real_tokens": 0, "packed_s": 0.0, "shared_s": 0.0, "batches": 0}
    updates = {}
    for group, fns, records, batch in seen:
        packed, shared, counts = layouts(trainer, group, records, batch)
        if not any(counts):
            continue
        full = packed
        active = active_policies(counts, group.stacked)  # both layouts on the policies the step updates
        view = group
        if active is not None:
            view, packed = restrict(group, packed, active)
            shared = {k: v[active] for k, v in shared.items()}
        cross = bool(np.any(packed.source_policy != packed.learner))
        scored = score_batch(view, fns, packed, trainer.method_device_state(), recompute=False, cross=cross)
        shared_batch = (scored, jax.tree.map(jnp.asarray, shared))
        key = id(group)
        if key not in updates:
            updates[key] = shared_prefix_update(trainer, group)
        state = view.state

        def run_packed():
            jax.block_until_ready(fns.update(jax.tree.map(jnp.copy, state), group.base, scored))

        def run_shared():
            jax.block_until_ready(updates[key](jax.tree.map(jnp.copy, state), group.base, shared_batch))

        run_packed(), run_shared()  # compile
        best_p, best_s = float("inf"), float("inf")
        for _ in range(repeats):
            best_p, best_s = min(best_p, timed(run_packed)), min(best_s, timed(run_shared))
        out["packed_s"] += best_p
        out["shared_s"] += best_s
        out["real_tokens"] += int(np.count_nonzero(np.asarray(full.packed_segment)))
        out["batches"] += 1
    out["packed_real_tokens_per_s"] = out["real_tokens"] / out["packed_s"]
    out["shared_real_tokens_per_s"] = out["real_tokens"] / out["shared_s"]
    out["speedup"] = out["shared_s"] / out["packed_s"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--time", nargs="*", default=["quickstart"], choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=6, help="RL steps recorded per config")
    parser.add_argument("--warm-start", type=int, default=None, help="warm-start steps (default: the config's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/packing.json")
    parser.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides applied last to every config (default: none)")
    args = parser.parse_args(argv)
    header = results_header("benchmarks.packing", argv)
    from jmarl.host_memory import apply_on_cpu

    apply_on_cpu()
    rows = []
    for name in args.configs:
        with tempfile.TemporaryDirectory() as out_dir:
            trainer, seen = record(CONFIGS[name], args.steps, args.warm_start, out_dir, args.overrides)
            totals = {"real": 0, "packed_slots": 0, "shared_slots": 0}
            for group, _, records, batch in seen:
                packed, shared, counts = layouts(trainer, group, records, batch)
                if any(counts):
                    for k, v in utilization(packed, shared, counts, group.stacked).items():
                        totals[k] += v
            row = {"config": CONFIGS[name], "steps": args.steps, "overrides": args.overrides, "batches": len(seen),
                   **totals,
                   "packed_utilization": totals["real"] / totals["packed_slots"],
                   "shared_utilization": totals["real"] / totals["shared_slots"]}
            if name in args.time:
                row["update"] = time_updates(trainer, seen, args.repeats)
            print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "update"},
                  row.get("update"), flush=True)
            rows.append(row)
    results = {**header, "rows": rows, **results_end()}
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
