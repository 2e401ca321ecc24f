"""Two processes on localhost (4 CPU devices each, gloo collectives) run one sharded train step
on an 8-device global mesh and save/restore a checkpoint collectively; the numbers must equal
the single-process step."""

import textwrap

import jax
import numpy as np
import pytest

from _processes import free_port, one_device_xla_flags, run_workers
from jmarl import models
from jmarl.train.step import init_train_state, make_update


# Shared by the workers and the single-process reference (exec'd in both).
SETUP = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jmarl import algos, models
    from jmarl.train.optim import make_optimizer
    from jmarl.train.step import init_train_state, make_update
    from tests._tiny_models import tiny_qwen3  # the repository root is on every process's path

    CONFIG = tiny_qwen3(o_bias=False)
    OPT = make_optimizer(1e-3, total_steps=10, eps=1e-6)
    FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}  # faster CPU compiles

    def loss_fn(params, frozen, batch):
        lp = models.token_logprobs(CONFIG, params, batch["tokens"], batch["attention_mask"])
        return algos.policy_loss(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
                                 aggregation="seq_mean_token_mean")

    def make_batch():
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 64, (16, 10)).astype(np.int32)
        attn = np.arange(10) < rng.integers(5, 11, (16, 1))
        return {"tokens": tokens, "attention_mask": attn, "loss_mask": attn & (np.arange(10) >= 3),
                "old_logprobs": np.where(attn, -rng.uniform(2, 6, (16, 10)), 0).astype(np.float32),
                "advantages": rng.normal(size=16).astype(np.float32)}
    """
)

WORKER = textwrap.dedent(
    """
    import sys
    from jmarl import sharding
    from jmarl.config import DistributedConfig
    port, pid, out, ckpt_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    assert sharding.maybe_initialize_distributed(
        DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid))
    """
) + SETUP + textwrap.dedent(
    """
    from jmarl.train.checkpoint import Checkpointer
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)  # spans both processes
    axes = models.param_axes(CONFIG)  # the model's declared axes: sharding does not import the model
    params = sharding.shard_params(axes, models.init(CONFIG, jax.random.key(0)), mesh)
    state = sharding.shard_train_state(axes, init_train_state(params, OPT), mesh)
    shardings = sharding.train_state_shardings(axes, state, mesh)
    step = sharding.sharded_update(make_update(loss_fn, OPT, num_minibatches=2), mesh, shardings, compiler_options=FAST)
    state, metrics = step(state, None, make_batch())
    kernel = state.params["layers"]["mlp"]["gate_proj"]["kernel"]
    assert not kernel.is_fully_addressable and kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    with Checkpointer(ckpt_dir, keep=2) as ckpt:  # every process writes its own shards
        ckpt.save(1, state, {"process_count": jax.process_count()})
        restored = ckpt.restore(jax.tree.map(jnp.zeros_like, state)).state
    host = sharding.to_host({"state": state, "restored": restored, "loss": metrics["loss"]})
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(host)[0]}
    np.savez(out, **flat)
    print("worker", pid, "done")
    """
)


@pytest.mark.slow
def test_two_processes_match_single_process(tmp_path):
    port = free_port()
    outs = [tmp_path / f"p{i}.npz" for i in range(2)]
    run_workers(WORKER, [(port, i, outs[i], tmp_path / "ckpt") for i in range(2)], timeout=300,
                xla_flags=f"{one_device_xla_flags()} --xla_force_host_platform_device_count=4")

    # the single-process reference: the same step, unsharded
    scope: dict = {}
    exec(SETUP, scope)
    update = jax.jit(make_update(scope["loss_fn"], scope["OPT"], num_minibatches=2), compiler_options=scope["FAST"])
    ref_state, ref_metrics = update(
        init_train_state(models.init(scope["CONFIG"], jax.random.key(0)), scope["OPT"]), None, scope["make_batch"]()
    )
    ref = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(
        {"state": ref_state, "restored": ref_state, "loss": ref_metrics["loss"]})[0]}
    for out in outs:
        got = dict(np.load(out))
        assert set(got) == set(ref)
        for key, want in ref.items():
            np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-5, err_msg=key)
    assert list((tmp_path / "ckpt").iterdir())  # one checkpoint directory, written by both
