"""Expert parallelism (`jmarl.models.moe.expert_parallel_ffn`, the rule expert -> fsdp): the
rules' mapping and one-axis-per-spec fit, the CPU grouped product against `jax.lax.ragged_dot`,
the sharded expert layer against `expert_ffn` on several meshes (values and gradients, stacked
policies, fewer local experts than k, unsplit rows), a tiny Qwen3-MoE's log-prob gradients
(router aux loss included) and greedy generation with the experts split over fsdp=4 x data=2
against one device, and the compiled update's collectives (tokens move, expert weights do not)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from _tiny_models import tiny_qwen3_moe
from jmarl import sharding
from jmarl.models import GenerationSpec, ModelConfig, generate, init, param_axes, token_logprobs
from jmarl.models import grouped_matmul as grouped
from jmarl.models import moe
from jmarl.sharding.rules import DEFAULT_RULES, fit

E, D, F, K = 8, 32, 16, 2  # tiny experts: distinct sizes, so their shapes are recognisable in HLO


def _moe_config(**changes) -> ModelConfig:
    """The tiny all-sparse Qwen3-MoE (`tiny_qwen3_moe`: 3 layers, top-2 of 8 experts, float32), no remat."""
    config = tiny_qwen3_moe(**{"remat": "none", **changes})
    assert (config.num_experts, config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok) == (E, D, F, K)
    return config


def _params(config: ModelConfig, seed: int = 0):
    """Random parameters whose routing is decisive (router N(0, 0.5^2): no near-ties for float
    order to flip) and whose experts move the residual stream (N(0, 0.15^2))."""
    params = init(config, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 8))
    layer_moe = params["layers"]["moe"]
    layer_moe["router"]["kernel"] = 0.5 * jax.random.normal(next(keys), layer_moe["router"]["kernel"].shape)
    for name, w in layer_moe["experts"].items():
        layer_moe["experts"][name] = 0.15 * jax.random.normal(next(keys), w.shape)
    return params


def _placed(config, params, mesh, rules=DEFAULT_RULES):
    specs = sharding.param_specs(param_axes(config), params, mesh, rules=rules)
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def _routing(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
    _, weights, experts = moe.route(jnp.asarray(rng.normal(size=(n, E)), jnp.float32), K, True)
    gate, up = (jnp.asarray(0.3 * rng.normal(size=(E, D, F)), jnp.float32) for _ in range(2))
    down = jnp.asarray(0.3 * rng.normal(size=(E, F, D)), jnp.float32)
    return x, experts, weights, gate, up, down


# ------------------------------------------------------------------------------ rules


def test_expert_axis_maps_to_fsdp_and_a_mesh_axis_shards_one_dimension():
    assert DEFAULT_RULES.expert == ("fsdp",)
    config = _moe_config()
    axes = param_axes(config)
    mesh = {"data": 2, "fsdp": 4, "tensor": 2}
    spec = lambda a, shape: tuple(DEFAULT_RULES.spec(a, shape, mesh))  # noqa: E731
    experts = axes["layers"]["moe"]["experts"]
    # whole experts on fsdp, Fe on tensor, D whole (fsdp is taken by E)
    assert spec(experts["gate_proj"], (3, E, D, F)) == (None, "fsdp", None, "tensor")
    assert spec(experts["down_proj"], (3, E, F, D)) == (None, "fsdp", "tensor")
    assert spec(axes["layers"]["moe"]["router"]["kernel"], (3, D, E)) == (None, "fsdp")  # D first: E replicated
    # 4 experts on fsdp=8: E replicated, D takes fsdp (plain FSDP, no expert parallelism)
    assert tuple(DEFAULT_RULES.spec(experts["gate_proj"], (3, 4, D, F), {"fsdp": 8, "tensor": 2})) == (
        None, None, "fsdp", "tensor")
    assert tuple(fit([("fsdp",), ("fsdp", "tensor")], (8, 8), {"fsdp": 4, "tensor": 2})) == ("fsdp", "tensor")
    # no mesh sizes: the first dimension keeps the axis too
    assert tuple(DEFAULT_RULES.spec(("expert", "embed", "mlp"), (E, D, F))) == ("fsdp", None, "tensor")


def test_expert_layout_of_the_default_and_other_rules():
    sizes = {"data": 2, "policy": 1, "fsdp": 4, "tensor": 2}
    layout = moe.expert_layout(sizes, 64, K, (E, D, F))
    assert (layout.tokens, layout.experts, layout.hidden) == (("data", "fsdp"), ("fsdp",), ("tensor",))
    assert (layout.gathered, layout.summed, layout.local_experts) == (("fsdp",), ("tensor",), 2)
    assert layout.capacity == 32 * 2 and layout.chunk_rows == 8  # N/data tokens x min(k, E/fsdp), one chunk
    fewer = moe.expert_layout({**sizes, "fsdp": 8, "data": 1}, 64, K, (E, D, F))
    assert fewer.local_experts == 1 and fewer.capacity == 64  # one expert a device: one pair per token at most
    assert moe.expert_layout(sizes, 64, K, (E, D, F), DEFAULT_RULES.replace(expert=())) is None
    on_tensor = moe.expert_layout(sizes, 64, K, (E, D, F), DEFAULT_RULES.replace(expert=("tensor",)))
    assert (on_tensor.gathered, on_tensor.summed, on_tensor.capacity) == ((), ("tensor",), 8 * 2)  # local rows
    assert moe.expert_layout({"data": 8}, 64, K, (E, D, F)) is None  # data parallel: experts replicated
    # 30B-A3B on fsdp=64: 2 experts a device, so 64 x 2 pairs a local row: 256 rows a chunk
    big = moe.expert_layout({"fsdp": 64}, 64 * 4096, 8, (128, 2048, 768))
    assert (big.local_experts, big.chunk_rows, big.capacity) == (2, 256, moe.PAIRS_PER_CHUNK)


# ------------------------------------------------------------------------------ grouped products


@pytest.mark.parametrize("tile", [4, 128])
def test_tiled_grouped_matmul_equals_ragged_dot(monkeypatch, tile):
    """Value and both gradients, with empty groups, groups across tile edges and rows past the
    groups (zeros), in several row tiles (tile 4) and in one."""
    monkeypatch.setattr(grouped, "GROUPED_TILE", tile)
    rng = np.random.default_rng(0)
    m, g = 23, 6
    x = jnp.asarray(rng.normal(size=(m, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(g, 5, 3)), jnp.float32)
    sizes = jnp.asarray([3, 0, 7, 1, 0, 9], jnp.int32)  # 20 of 23 rows
    probe = jnp.asarray(rng.normal(size=(m, 3)), jnp.float32)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w, sizes) * probe)

    want, got = jax.lax.ragged_dot(x, w, sizes), jax.jit(grouped.tiled_grouped_matmul)(x, w, sizes)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.any(np.asarray(got)[20:])
    for a, b in zip(jax.grad(loss(jax.lax.ragged_dot), (0, 1))(x, w), jax.grad(loss(grouped.tiled_grouped_matmul), (0, 1))(x, w)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # the platform's form (the tiled one here) inside expert_ffn
    np.testing.assert_allclose(jax.jit(grouped.grouped_matmul)(x, w, sizes), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", ["tiled_grouped_matmul", "ragged_grouped_matmul"])
def test_grouped_products_vmap_with_shared_weights(form):
    """Rows stacked over policies, weights shared (a LoRA base under the policies' vmap, which
    ragged_dot's own batching rule refuses) or stacked: value and gradients equal a loop of
    ragged_dot."""
    f = getattr(grouped, form)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 23, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 5, 3)), jnp.float32)
    sizes = jnp.asarray([[3, 0, 7, 1, 0, 9], [5, 5, 0, 0, 5, 5]], jnp.int32)
    probe = jnp.asarray(rng.normal(size=(2, 23, 3)), jnp.float32)
    for w_axis, ws in ((None, w), (0, jnp.stack([w, 2 * w]))):
        def loss(x, ws, gmm):
            per_policy = [gmm(x[i], ws if w_axis is None else ws[i], sizes[i]) for i in range(2)]
            return jnp.sum(jnp.stack(per_policy) * probe)

        vmapped = lambda x, ws: jnp.sum(jax.vmap(f, in_axes=(0, w_axis, 0))(x, ws, sizes) * probe)  # noqa: E731
        got, got_g = jax.jit(jax.value_and_grad(vmapped, (0, 1)))(x, ws)
        want, want_g = jax.value_and_grad(lambda x, ws: loss(x, ws, jax.lax.ragged_dot), (0, 1))(x, ws)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for a, b in zip(got_g, want_g):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_on_cpu_compiles_no_dense_copy_over_the_groups():
    """XLA:CPU's ragged_dot copies the rows once per group ([M, G x K]); the tiled form's
    temporaries stay near the output's size."""
    m, g, k, n = 1024, 64, 64, 32
    args = (jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((g, k, n), jnp.float32),
            jax.ShapeDtypeStruct((g,), jnp.int32))
    dense = jax.jit(jax.lax.ragged_dot).lower(*args).compile().memory_analysis().temp_size_in_bytes
    tiled = jax.jit(grouped.grouped_matmul).lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert dense >= m * g * k * 4
    assert tiled < 4 * m * (k + n) * 4


# ------------------------------------------------------------------------------ the sharded layer


@pytest.mark.parametrize("mesh_sizes,n,pairs", [
    (dict(data=2, fsdp=4), 24, None),  # tokens gathered over fsdp, 2 experts a device
    (dict(data=2, fsdp=4), 24, 20),  # ... 2 of a device's 3 rows a chunk (a padding row)
    (dict(fsdp=4, tensor=2), 24, None),  # + Fe over tensor (a sum)
    (dict(fsdp=8), 24, None),  # one expert a device: fewer than k
    (dict(data=2, fsdp=4), 6, None),  # rows that fsdp does not split: no gather, a sum over fsdp
    (dict(data=8), 24, 20),  # experts not split: expert_ffn, 10 rows a chunk
])
@pytest.mark.slow
def test_expert_parallel_ffn_equals_expert_ffn(monkeypatch, mesh_sizes, n, pairs, mesh):
    if pairs is not None:
        monkeypatch.setattr(moe, "PAIRS_PER_CHUNK", pairs)
    x, experts, weights, gate, up, down = _routing(n)
    probe = jnp.asarray(np.random.default_rng(1).normal(size=(n, D)), jnp.float32)

    def loss(f):
        return lambda x, w, g, u, d: jnp.sum(f(x, experts, w, g, u, d) * probe)

    want = moe.expert_ffn(x, experts, weights, gate, up, down)
    want_g = jax.grad(loss(moe.expert_ffn), range(5))(x, weights, gate, up, down)
    mesh = mesh(**mesh_sizes)
    with jax.set_mesh(mesh):
        got = jax.jit(moe.expert_parallel_ffn)(x, experts, weights, gate, up, down)
        got_g = jax.jit(jax.grad(loss(moe.expert_parallel_ffn), range(5)))(x, weights, gate, up, down)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_expert_parallel_ffn_under_a_policy_vmap(mesh):
    """Stacked policies ([P, ...] weights, vmapped with spmd_axis_name="policy", as the
    trainer's per-agent update): each policy's layer and its gradients equal its own
    `expert_ffn`'s."""
    x, experts, weights, gate, up, down = (jnp.stack(a) for a in zip(*[_routing(16, seed) for seed in (0, 1)]))
    probe = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)

    def loss(f, **vmap):
        return lambda x, w, g, u, d: jnp.sum(jax.vmap(f, **vmap)(x, experts, w, g, u, d) * probe)

    want = jax.vmap(moe.expert_ffn)(x, experts, weights, gate, up, down)
    want_g = jax.grad(loss(moe.expert_ffn), range(5))(x, weights, gate, up, down)
    mesh = mesh(policy=2, fsdp=4)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.vmap(moe.expert_parallel_ffn, spmd_axis_name="policy"))(x, experts, weights, gate, up, down)
        got_g = jax.jit(jax.grad(loss(moe.expert_parallel_ffn, spmd_axis_name="policy"), range(5)))(
            x, weights, gate, up, down)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ the model


def _batch(rows: int = 4, t: int = 12, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 64, size=(rows, t)).astype(np.int32)
    lengths = rng.integers(t // 2, t + 1, size=rows)
    mask = np.arange(t)[None, :] < lengths[:, None]
    return np.where(mask, tokens, 0), mask


def _loss(config):
    """Sum of the token log-probs plus the load-balancing loss (router stats through the
    layers) of a batch: the two terms a Qwen3-MoE update differentiates."""
    def loss(params, tokens, mask):
        lp, stats = token_logprobs(config, params, tokens, mask, with_router_stats=True)
        return jnp.sum(lp) + 0.01 * moe.load_balancing_loss(stats)
    return loss


@pytest.mark.slow
@pytest.mark.parametrize("remat,mixed", [("none", False), ("full", True)])
def test_update_with_experts_split_equals_one_device(remat, mixed, mesh):
    """Value and gradients of the log-prob + aux loss with the experts split 4 ways (fsdp=4 x
    data=2: each device 2 of the 8 experts, tokens dispatched) equal one device's; `mixed`:
    dense and sparse layers (the layer scan's cond), with full layer remat."""
    changes = dict(remat=remat) if not mixed else dict(remat=remat, decoder_sparse_step=2, mlp_only_layers=(2,),
                                                       num_layers=4)
    config = _moe_config(**changes)
    params = _params(config)
    tokens, mask = _batch(8)
    value_and_grad = jax.jit(jax.value_and_grad(_loss(config)))
    want, want_g = value_and_grad(params, tokens, mask)
    mesh = mesh(data=2, fsdp=4)
    placed = _placed(config, params, mesh)
    assert placed["layers"]["moe"]["experts"]["gate_proj"].sharding.shard_shape((3 + mixed, E, D, F))[1] == E // 4
    with jax.set_mesh(mesh):
        got, got_g = value_and_grad(placed, sharding.shard_batch(tokens, mesh), sharding.shard_batch(mask, mesh))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    # float32 sums in another order (per device, then across devices): each leaf to 1e-5 of its
    # largest entry (the embedding's gradient sums the whole batch's tokens)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())),
                                                         rtol=1e-4), got_g, want_g)


@pytest.mark.slow
def test_policies_vmapped_over_one_shared_base_with_experts_split(mesh):
    """Two policies' batches through one set of weights (the weights unbatched under the
    policies' vmap, as LoRA adapters over a shared base run) with the experts split 4 ways:
    the log-prob gradients with respect to the shared weights equal one device's."""
    config = _moe_config()
    params = _params(config, seed=5)
    batches = [_batch(8, 10, seed) for seed in (6, 7)]
    tokens, mask = (np.stack(a) for a in zip(*batches))

    def loss(p, tokens, mask):
        return jnp.sum(jax.vmap(lambda t, m: token_logprobs(config, p, t, m))(tokens, mask))

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    want, want_g = value_and_grad(params, tokens, mask)
    mesh = mesh(data=2, fsdp=4)
    with jax.set_mesh(mesh):
        got, got_g = value_and_grad(_placed(config, params, mesh), sharding.shard_batch(tokens, mesh, stacked=True),
                                    sharding.shard_batch(mask, mesh, stacked=True))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())),
                                                         rtol=1e-4), got_g, want_g)


@pytest.mark.slow
def test_greedy_generation_with_experts_split_equals_one_device(mesh):
    """Prefill and decode through the sharded experts (8 prompts on fsdp=4 x data=2)."""
    config = _moe_config()
    params = _params(config, seed=3)
    tokens, mask = _batch(8, 10, seed=4)
    kwargs = dict(max_new_tokens=8, temperature=0.0, pad_id=0)
    want = generate(config, params, tokens, mask, jax.random.key(0), GenerationSpec(**kwargs))
    mesh = mesh(data=2, fsdp=4)
    got = generate(config, _placed(config, params, mesh), tokens, mask, jax.random.key(0),
                   GenerationSpec(mesh=mesh, **kwargs))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)


# ------------------------------------------------------------------------------ compiled collectives


def _collectives(hlo: str, op: str) -> list[tuple[int, ...]]:
    """Result shapes of every `op` (all-gather, reduce-scatter, ...) in compiled HLO text."""
    shapes = []
    for line in hlo.splitlines():
        match = re.search(r"= \(?[a-z0-9]+\[([0-9,]*)\][^ ]* " + re.escape(op) + r"(-start)?\(", line)
        if match:
            shapes.append(tuple(int(d) for d in match.group(1).split(",") if d))
    return shapes


def _holds_experts(shape: tuple[int, ...], local: int) -> bool:
    """Whether a result shape carries more than `local` experts' weights [.., e, D, Fe] / [.., e, Fe, D]."""
    for i in range(len(shape) - 2):
        if shape[i] > local and shape[i + 1:i + 3] in ((D, F), (F, D), (D, F // 2), (F // 2, D)):
            return True
    return False


@pytest.mark.slow
def test_compiled_update_moves_tokens_not_expert_weights(monkeypatch, mesh):
    """The compiled value-and-gradient program on fsdp=4 x data=2: all-gathers of tokens and
    reduce-scatters of outputs, none of an expert weight over the expert axis (no result holds
    more than a device's 2 experts); with the expert layer left to XLA (`expert_layout` None)
    the same placement gathers the expert weights, so the check can fail."""
    config = _moe_config()
    params = _params(config)
    tokens, mask = _batch(8)
    mesh = mesh(data=2, fsdp=4)
    placed = _placed(config, params, mesh)
    args = (placed, sharding.shard_batch(tokens, mesh), sharding.shard_batch(mask, mesh))

    def hlo() -> str:
        with jax.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(_loss(config))).lower(*args).compile().as_text()

    text = hlo()
    gathers = _collectives(text, "all-gather")
    assert gathers and _collectives(text, "reduce-scatter")
    assert not [s for s in gathers if _holds_experts(s, E // 4)], gathers
    monkeypatch.setattr(moe, "expert_layout", lambda *a, **k: None)
    assert [s for s in _collectives(hlo(), "all-gather") if _holds_experts(s, E // 4)]
