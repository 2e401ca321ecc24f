"""`python -m jmarl.memory_check` and the trainer's memory check before step 0, on a tiny model over
the 8 simulated CPU devices (data=2, fsdp=2): the planned programs are the trainer's own."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from _tiny_models import TINY_PRESET
from jmarl import memory_check
from jmarl.config import load_config
from jmarl.errors import JmarlError
from jmarl.memory_check import cli
from jmarl.models.generation import budget, static
from jmarl.sharding import device_bytes, mesh_context, mesh_of
from jmarl.train import programs as programs_lib
from jmarl.train.learner import learner_batch, score_batch
from jmarl.workflows.base import Completion, SampleRecord
from jmarl.train.trainer import Trainer
from jmarl.workflows.bounds import BoundsContext
from jmarl.workflows.plans import PLANS

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

RUN = {
    "seed": 0,
    "env": {"name": "_toy_env:Letters"},  # two sequential agents, one turn
    "algo": {"name": "at_grpo"},
    "model": {"preset": TINY_PRESET},
    "tokenizer": "char",
    "workflow": {"plan": "tree", "group_size": 4, "num_tasks": 2},
    "policies": {"mode": "per_agent"},  # one stacked group of two policies
    "sampling": {"max_new_tokens": 8, "max_prompt_len": 48},
    "optim": {"minibatches": 2},
    "train": {"steps": 1, "kl_coef": 0.01, "warm_start": {"steps": 1, "demos": 2}},
    "logging": {"progress": False, "tensorboard": False, "plots": False},
    "mesh": {"data": 2, "fsdp": 2},
}
PROGRAMS = ["sft_update", "generate", "score", "score_ref", "update"]


@pytest.fixture(scope="module")
def run_yaml(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(dict(RUN, output_dir=str(root / "out"))))
    return path


@pytest.fixture(scope="module")
def planned(run_yaml):
    """(abstract trainer, its programs, their figures)."""
    config, notes = cli.load_config_for_check(str(run_yaml), [f"output_dir={run_yaml.parent / 'abstract'}"])
    assert notes == []
    trainer = Trainer(config, abstract=True)
    assert not trainer.out.exists() and trainer.checkpointer is None  # an abstract trainer writes nothing
    programs = trainer.programs()
    return trainer, programs, [memory_check.analyse(p) for p in programs]


@pytest.fixture(scope="module")
def real(run_yaml):
    return Trainer(load_config(run_yaml))


def test_plans_declare_their_bounds():
    # two sequential agents with a policy each, E = 2 tasks, T = 1 turn, K = G = 4
    ctx = BoundsContext(num_tasks=2, turns=1, order=(0, 1), agent_policy=(0, 1), policy_ids=(0, 1), parallel=False)
    tree = PLANS["tree"].bounds(PLANS["tree"].options(group_size=4), ctx)
    assert (tree.rows, tree.share, tree.aligned) == (2 * 1 * 4 * 1, 4, True)
    assert tree.calls == (((8, 0), 4), ((0, 8), 4))  # one call per acting agent, E x K rows
    both = BoundsContext(num_tasks=2, turns=1, order=(0, 1), agent_policy=(0, 1), policy_ids=(0, 1), parallel=True)
    assert PLANS["tree"].bounds(PLANS["tree"].options(group_size=4), both).calls == (((8, 8), 4),)
    joint = PLANS["joint"].bounds(PLANS["joint"].options(group_size=3, joint_mode="cross"), ctx)
    assert (joint.rows, joint.share) == (2 * 3 * 1 * 1, 3) and joint.calls == (((6, 6), 3),)


@pytest.mark.slow
def test_a_plan_of_your_own_is_checked_through_its_bounds(run_yaml, planned, tmp_path, monkeypatch):
    """workflow.plan: package.module:NAME works as algo.name does, memory check included: the
    run's programs come from the plan's own bounds; a plan without bounds says what to do."""
    trainer, programs, _ = planned
    (tmp_path / "my_plans.py").write_text(
        "import dataclasses\nfrom jmarl.workflows.plans import PLANS\n"
        "MY_TREE = dataclasses.replace(PLANS['tree'], name='my_tree')\n"
        "NO_BOUNDS = dataclasses.replace(PLANS['tree'], name='no_bounds', bounds=None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = f"output_dir={tmp_path / 'abstract'}"
    config, _ = cli.load_config_for_check(str(run_yaml), [out, "workflow.plan=my_plans:MY_TREE"])
    mine = Trainer(config, abstract=True)
    assert mine.plan.name == "my_tree"
    assert [(p.program, p.shapes) for p in mine.programs()] == [(p.program, p.shapes) for p in programs]
    config, _ = cli.load_config_for_check(str(run_yaml), [out, "workflow.plan=my_plans:NO_BOUNDS"])
    with pytest.raises(JmarlError, match="'no_bounds' declares no step bounds .*set train.memory_check=off$"):
        Trainer(config, abstract=True).programs()


def _figures(m):
    return (m.state, m.temporaries, m.outputs, m.aliased, m.resident)


@pytest.mark.slow
def test_plan_figures_equal_the_real_trainers_programs_compiled_directly(planned, real):
    trainer, _, figures = planned
    assert [f.program for f in figures] == PROGRAMS
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(trainer.policies.groups[0].state))
    real_programs = real.programs()  # real arrays: abstract args from their own shardings
    assert real_programs[-1].jitted is real.fns[0].update.jitted  # the trainer's own update
    for want, p in zip(figures, real_programs):
        with mesh_context(mesh_of(p.args)):  # as the run calls it (ShardedFn enters its mesh)
            lowered = p.jitted.lower(*p.args)
        stats = lowered.compile(compiler_options=memory_check.CPU_FAST_COMPILE).memory_analysis()
        got = (stats.argument_size_in_bytes, stats.temp_size_in_bytes, stats.output_size_in_bytes,
               stats.alias_size_in_bytes, p.resident)
        assert got == _figures(want), p.program
        assert want.total == want.state + want.temporaries + want.outputs - want.aliased
        assert want.peak == want.total + want.resident


@pytest.mark.slow
def test_update_state_is_sharded_params_and_two_adam_moments(planned):
    trainer, programs, figures = planned
    group = trainer.policies.groups[0]
    update = dict(zip(PROGRAMS, programs))["update"]
    figure = dict(zip(PROGRAMS, figures))["update"]
    params = device_bytes(group.state.params)
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(group.state.params))
    assert params < full  # fsdp=2 shards the parameters
    state = device_bytes(group.state)
    assert 3 * params <= state <= 3 * params + 1024  # params, mu, nu (+ counters)
    # XLA's argument bytes: the state and the batch fields the loss reads (jit drops unread ones)
    assert device_bytes(update.args[:2]) <= figure.state <= device_bytes(update.args)
    assert figure.aliased >= state - 1024  # the donated state is updated in place
    assert figure.resident == device_bytes(group.ref) > 0  # the reference stays on the device


@pytest.mark.slow
def test_update_batch_is_the_trainers_batch_at_the_bound(planned, real):
    _, programs, _ = planned
    update = dict(zip(PROGRAMS, programs))["update"]
    assert update.shapes == {"R": 8, "N": 8, "parts": 2, "U": 1, "rows": 4, "L": 1024, "M": 4096, "C": 32}
    # the largest step: 2 tasks x 1 turn x K=4 candidates per policy, prompts and answers at their caps
    rows, prompt, answer = 8, 48, 8
    tokens = np.zeros((2 * rows, prompt + answer), np.int32)
    for r in range(2 * rows):
        tokens[r, :prompt] = 1 + (r // 4) % 50  # a node's K candidates share a prompt
        tokens[r, prompt:] = 2 + r % 7
    records = [SampleRecord(prompt="", completion=Completion(text="", prompt_tokens=tokens[r, :prompt],
                                                             completion_tokens=tokens[r, prompt:],
                                                             logprobs=np.zeros(answer, np.float32)),
                            reward=float(r), group=r // 4, env=0, turn=0, agent=0, policy=r // rows,
                            source_policy=r // rows) for r in range(2 * rows)]
    group, fns = real.policies.groups[0], real.fns[0]
    batch, counts = learner_batch(group, records, real.parts, real.rows_bound(), real.rows_per_part(group))
    assert counts == [rows, rows]
    scored = score_batch(group, fns, batch, real.method_device_state(), recompute=True, cross=False)
    want = update.args[2]
    # the plan bounds the packed rows and predictions (first-fit may need fewer); all else equal
    for name in [f.name for f in dataclasses.fields(scored)]:
        got, bound = getattr(scored, name), getattr(want, name)
        if got is None:
            assert bound is None, name
            continue
        assert np.dtype(got.dtype) == np.dtype(bound.dtype), name
        if name.startswith(("packed_", "pred_source", "pred_target")):
            assert got.shape[:-2] == bound.shape[:-2] and all(g <= b for g, b in zip(got.shape, bound.shape)), name
        else:
            assert got.shape == bound.shape, name


def test_fast_cpu_compile_options_leave_the_memory_figures_unchanged():
    """`analyse` compiles with CPU_FAST_COMPILE on CPU; one small program of the planned kind
    (a gradient step of blockwise attention: while loops, a custom VJP, donated inputs, rows
    split over 2 devices) compiled with XLA's default options gives the same figures."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jmarl.models import attention as attn

    assert jax.default_backend() == "cpu"  # analyse uses the fast options only here
    rows = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), PartitionSpec("data"))
    q = jax.ShapeDtypeStruct((2, 1024, 4, 16), np.float32, sharding=rows)  # 2 x 2 tiles of 512 per row
    kv = jax.ShapeDtypeStruct((2, 1024, 2, 16), np.float32, sharding=rows)
    lengths = jax.ShapeDtypeStruct((2,), np.int32, sharding=rows)

    def step(q, k, v, n):
        def loss(q, k, v):
            return jnp.sum(jnp.sin(attn.attention(q, k, v, n, causal=True, impl="blockwise")))

        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return jax.tree.map(lambda x, g: x - 0.1 * g, (q, k, v), grads)

    jitted = jax.jit(step, donate_argnums=(0, 1, 2))
    fast = memory_check.analyse(memory_check.Program("step", "g", jitted, (q, kv, kv, lengths), resident=0, shapes={}))
    stats = jitted.lower(q, kv, kv, lengths).compile().memory_analysis()  # default options
    default = (stats.argument_size_in_bytes, stats.temp_size_in_bytes, stats.output_size_in_bytes,
               stats.alias_size_in_bytes, 0)
    assert default == _figures(fast)
    assert fast.temporaries > 0 and fast.aliased > 0  # the figures compared are real ones


@pytest.mark.parametrize("rows, share, parts, aligned, packed_rows",
                         [(16, 4, 2, True, 1), (16, 3, 2, False, 1), (12, 1, 3, True, 1), (16, 3, 1, False, 4)])
def test_packed_bounds_hold_for_the_worst_layout(rows, share, parts, aligned, packed_rows):
    """The plan's (L, M) bound the packed layout of micro-batches whose prompts (6 tokens) and
    completions (4) take the longest lengths, wherever the groups start."""
    from jmarl.train.packing import pack, plain_samples

    u = programs_lib.prefixes_per_part(rows // parts, share, aligned)
    bound_rows, width, preds = programs_lib.packed_bounds(rows // parts, u, share, 6, 4, packed_rows)
    for offset in range(share):  # where the first group starts: groups may straddle micro-batches
        ids = (np.arange(rows) + offset) // share
        tokens = np.stack([np.full(6, 1 + i, np.int32) for i in ids])
        tokens = np.concatenate([tokens, np.full((rows, 4), 99, np.int32)], axis=1)
        loss = np.zeros(tokens.shape, bool)
        loss[:, 6:] = True
        batch = {"tokens": tokens, "attention_mask": np.ones(tokens.shape, bool), "loss_mask": loss}
        (out,) = pack([plain_samples(batch)], parts, packed_rows)
        assert out["packed_tokens"].shape[0] // parts <= bound_rows and out["packed_tokens"].shape[1] <= width
        assert out["pred_source"].shape[0] // parts <= preds
        if aligned:
            break


def test_packed_rows_are_bounded_by_the_segments():
    """Segments as long as a row (a 1024-token prompt and two 512-token continuations, L =
    2048): each row holds one, so 4 distinct prompts take 4 rows, the bound min(2T/L + 1, U)
    says 4 where 2T/L + 1 alone says 9, and the packed batch fits it."""
    from jmarl.train.packing import pack, plain_samples

    rows, share, prompt_len, new_tokens = 8, 2, 1024, 512
    bound_rows, width, preds = programs_lib.packed_bounds(rows, rows // share, share, prompt_len, new_tokens, 1)
    assert (bound_rows, width) == (4, 2048) and preds == 4 * 2048
    ids = np.arange(rows) // share
    tokens = np.concatenate([np.stack([np.full(prompt_len, 1 + i, np.int32) for i in ids]),
                             np.full((rows, new_tokens), 99, np.int32)], axis=1)
    loss = np.zeros(tokens.shape, bool)
    loss[:, prompt_len:] = True
    (out,) = pack([plain_samples({"tokens": tokens, "attention_mask": np.ones(tokens.shape, bool), "loss_mask": loss})])
    assert out["packed_tokens"].shape == (4, 2048) and out["pred_source"].shape[0] <= preds


@pytest.mark.slow
def test_generation_program_is_the_samplers_call(real, monkeypatch):
    statics, calls = [], []
    real_program = static._program

    def recording(*settings):
        statics.append(settings)
        program = real_program(*settings)

        def call(*args):
            calls.append(args)
            return program(*args)

        return call

    monkeypatch.setattr(static, "_program", recording)
    group = real.policies.groups[0]
    # two prompts cut to sampling.max_prompt_len (their ends differ), K=4 answers each: tree's call for agent a
    real.sampler.sample([(0, "x" * 80 + f" task {i}") for i in range(2)], 4, jax.random.key(0))
    _, args = real.sampler.generation_program(group, (8, 0), 4)
    assert statics[0] == statics[1]  # same program settings: 4 rows share a prompt cache
    def shape(tree):
        key = jax.dtypes.prng_key
        return [(x.shape, "key" if jax.dtypes.issubdtype(x.dtype, key) else np.dtype(x.dtype)) for x in jax.tree.leaves(tree)]

    assert jax.tree.structure(calls[0]) == jax.tree.structure(args)
    assert shape(calls[0]) == shape(args)


@pytest.mark.slow
def test_cli_fits_and_writes_json(run_yaml, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli.main(["--config", str(run_yaml), "--devices", "8", "--device-memory", "1GiB", "--json", str(out)]) == 0
    text = capsys.readouterr()
    assert "update [per_agent]" in text.out and "fits" in text.out and text.err == ""
    doc = json.loads(out.read_text())
    assert doc["devices"] == 8 and doc["mesh"] == {"data": 2, "policy": 1, "fsdp": 2, "tensor": 1}
    assert doc["fits"] is True and doc["device_memory"] == 2**30 and doc["limit"] == int(0.9 * 2**30)
    assert doc["config"] == str(run_yaml) and doc["jax_version"] == jax.__version__
    assert [p["program"] for p in doc["programs"]] == PROGRAMS
    for p in doc["programs"]:
        assert p["peak"] == p["state"] + p["temporaries"] + p["outputs"] - p["aliased"] + p["resident"] > 0
    worst = max(doc["programs"], key=lambda p: p["peak"])
    assert doc["peak"] == worst["peak"] and doc["peak_program"] == worst["program"]
    assert doc["left"] == pytest.approx(1 - doc["peak"] / 2**30)


@pytest.mark.slow
def test_cli_does_not_fit_one_line(run_yaml, capsys):
    # without a warm start the update is the largest program (their sizes are close at this scale)
    assert cli.main(["--config", str(run_yaml), "--devices", "8", "--device-memory", "1MiB", "train.warm_start.steps=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "update of group 'per_agent' needs" in err[0] and "over 921.6 KiB (1 MiB less 10% headroom)" in err[0]
    assert "optim.grad_accum" in err[0] and "mesh.fsdp" in err[0]


@pytest.mark.parametrize("overrides, words", [
    (["model.preset=gpt-5"], "unknown preset 'gpt-5'"),
    (["mesh.fsdp=16"], "needs 32 devices but only 8"),
    (["mesh.data=-1", "mesh.fsdp=3"], "do not split"),
    (["model.preset=null", "model.path=/nowhere/my-model"], "matches no preset"),
])
def test_cli_bad_input_one_line(run_yaml, capsys, overrides, words):
    assert cli.main(["--config", str(run_yaml), "--devices", "8", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0]


def test_cli_in_a_fresh_process_simulates_devices(run_yaml, tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{REPO}")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-m", "jmarl.memory_check", "--config", str(run_yaml), "--devices", "4", "mesh.data=1", "mesh.fsdp=8"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: the mesh fsdp=8 needs 8 devices but only 4 are available; lower mesh.* "
        "(an axis of -1 uses whatever the other axes leave)"
    ]


def test_missing_checkpoint_plans_with_the_matching_preset():
    data, notes = cli.resolve_models({"model": {"path": "checkpoints/Qwen3-1.7B"}, "tokenizer": None})
    assert data["model"] == {"path": None, "preset": "qwen3-1.7b"} and data["tokenizer"] == "char"
    assert notes == ["model.path checkpoints/Qwen3-1.7B not found: planning with preset qwen3-1.7b's shapes"]
    with pytest.raises(JmarlError, match="matches no preset"):
        cli.resolve_models({"model": {"path": "checkpoints/gpt-5"}})


def test_a_checkpoint_is_planned_from_its_architecture_alone(run_yaml, tmp_path):
    """Any architecture jmarl loads is planned as it is (a Gemma 3 with sliding windows here, which
    no preset mapping can express), from its config.json: the directory holds no weights at all."""
    import transformers

    from jmarl.models import param_shapes
    from jmarl.models.tokenizer import CharTokenizer

    ckpt = tmp_path / "gemma-3-tiny"
    transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, max_position_embeddings=256, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ).save_pretrained(ckpt)
    CharTokenizer().save(str(ckpt))
    assert not list(ckpt.glob("*.safetensors"))
    config, notes = cli.load_config_for_check(str(run_yaml), ["model.preset=null", f"model.path={ckpt}", "tokenizer=null",
                                                              f"output_dir={tmp_path / 'out'}"])
    assert notes == [f"model.path {ckpt}: planned from its config.json (no weights read)"]
    trainer = Trainer(config, abstract=True)
    group = trainer.policies.groups[0]
    model = group.model_config
    assert model.model_type == "gemma3_text" and model.sliding_window == 5 and model.query_pre_attn_scalar == 24
    one_policy = jax.tree.map(lambda x: (x.shape[1:], x.dtype), group.state.params)  # per_agent: stacked
    assert one_policy == jax.tree.map(lambda x: (x.shape, x.dtype), param_shapes(model))
    programs = trainer.programs()
    assert [p.program for p in programs] == PROGRAMS
    score = memory_check.analyse(programs[PROGRAMS.index("score")])  # the sliding-window model compiles
    assert score.peak > score.state > 0


@pytest.mark.slow
def test_trainer_checks_memory_before_step_0(run_yaml, real):
    assert real.check_memory() == []  # memory_check auto: off on CPU, nothing compiled
    tight = Trainer(load_config(run_yaml, ["train.memory_check=on", "train.device_memory=64KiB"]))
    with pytest.raises(JmarlError, match=r"of group 'per_agent' needs .* over 57.6 KiB \(64 KiB less 10% headroom\)"):
        tight.run()
    assert not (tight.out / "metrics.jsonl").exists()  # nothing ran
    roomy = Trainer(load_config(run_yaml, ["train.memory_check=on", "train.device_memory=1GiB"]))
    assert [f.program for f in roomy.check_memory()] == PROGRAMS


@pytest.mark.slow
def test_continuous_engine_plans_its_prefill_and_decode_programs(run_yaml):

    config, _ = cli.load_config_for_check(str(run_yaml), [f"output_dir={run_yaml.parent / 'engine'}",
                                                      "sampling.engine=continuous", "sampling.kv_budget_bytes=64KiB"])
    trainer = Trainer(config, abstract=True)
    programs = [p for p in trainer.programs() if p.program.startswith(("engine", "generate"))]
    assert [p.program for p in programs] == ["engine_prefill", "engine_decode"]
    decode = programs[1]
    slots = decode.shapes["slots"]
    assert slots == 8 and decode.shapes["rows"] == 8  # tree: E x K = 8 rows per policy, 8 slots fit the budget
    state = decode.args[1]
    model = trainer.policies.groups[0].model_config
    entries = decode.shapes["entries"]
    assert entries == budget.entries_for(slots // 4, decode.shapes["share"]) * 4  # per device, for K per prompt
    assert decode.shapes["share"] > 1 and entries < slots  # the tree's K candidates share their prompt's entry
    assert state.cache.keys[0].shape[0] == slots and state.cache.values[0].shape[2] == decode.shapes["G"]
    assert state.pool.cache.keys[0].shape[0] == entries and state.pool.cache.values[0].shape[2] == decode.shapes["P"]
    for buf in (state.cache.keys[0], state.pool.cache.keys[0]):  # slots and entries over data x fsdp
        assert buf.sharding.shard_shape(buf.shape)[0] == buf.shape[0] // 4
    figures = [memory_check.analyse(p) for p in programs]
    kv_per_device = (slots * budget.slot_bytes(model, decode.shapes["G"] + 1)
                     + entries * budget.entry_bytes(model, decode.shapes["P"])) // 4
    for f in figures:
        assert f.state >= kv_per_device and f.peak > f.resident > 0
