"""The packed learner's fused Pallas kernel (`jmarl.models.packed_pallas`): exact against the dense
form in the Pallas interpreter on this CPU, forward and gradient, on ragged packed rows; and
lowered for CUDA from this CPU as Triton kernels with no loop left in XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jmarl.models import attention as attention_lib
from jmarl.models import packed_pallas
from test_packed_split import packed_layout, random_qkvw

TRITON = "__gpu$xla.gpu.triton"
# per row: (prompt length, [continuation lengths]) segments, padding after; prompts and
# continuations cross tile boundaries at every block size below, a continuation sits several
# tiles after its prompt, one row is padding only
ROWS = [[(5, [7, 3, 9]), (20, [30, 2])], [(40, [10, 10, 10, 10]), (3, [1])], [], [(1, [60, 50])]]
T = 150


def _dense(q, k, v, segment, branch):
    return attention_lib.packed_attention(q, k, v, segment, branch, impl="xla")


def _kernel(block):
    return lambda q, k, v, segment, branch: packed_pallas.packed_flash(q, k, v, segment, branch, block=block,
                                                                       interpret=True)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.slow
def test_fused_kernel_equals_dense_forward_and_gradient(block):
    """float32, 4 query heads on 2 key heads of 16: outputs of the real slots within 2e-6 of the
    dense form (padding slots: 0), and the gradients in q, k and v of a random cotangent on the
    real slots within 2e-5."""
    segment, branch, _ = packed_layout(ROWS, T)
    q, k, v, w = random_qkvw(block, len(ROWS), T, 4, 2, 16)
    real = (segment != 0)[:, :, None, None]
    got, want = _kernel(block)(q, k, v, segment, branch), _dense(q, k, v, segment, branch)
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-6, rtol=0)
    assert np.all(np.asarray(got)[~np.asarray(segment != 0)] == 0)
    w = jnp.where(real, w, 0)
    grads = [jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v, segment, branch) * w), argnums=(0, 1, 2))(q, k, v)
             for f in (_kernel(block), _dense)]
    for g, ref in zip(*grads):
        assert float(jnp.max(jnp.abs(ref))) > 0.1
        np.testing.assert_allclose(g, ref, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_a_wrong_tile_bound_shows():
    """The test above can fail: a kernel that skips its segment's prompt tiles (the prompt range
    emptied) differs from the dense form by far more than its tolerance."""
    segment, branch, _ = packed_layout(ROWS, T)
    q, k, v, _ = random_qkvw(1, len(ROWS), T, 4, 2, 16)
    real = np.asarray(segment != 0)[:, :, None, None]
    want = _dense(q, k, v, segment, branch)
    ranges = packed_pallas._key_ranges

    def no_prompt(*args):
        (lo, _), own = ranges(*args)
        return (lo, lo), own

    packed_pallas._key_ranges = no_prompt
    try:
        broken = _kernel(16)(q, k, v, segment, branch)
    finally:
        packed_pallas._key_ranges = ranges
    assert float(np.max(np.abs(np.where(real, broken - want, 0)))) > 0.1


def test_bfloat16_inputs_stay_close():
    segment, branch, _ = packed_layout(ROWS, T)
    q, k, v, _ = (x.astype(jnp.bfloat16) for x in random_qkvw(2, len(ROWS), T, 4, 2, 32))
    real = np.asarray(segment != 0)[:, :, None, None]
    got = np.asarray(_kernel(32)(q, k, v, segment, branch), np.float32)
    want = np.asarray(_dense(q, k, v, segment, branch), np.float32)
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=3e-2, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("window", [8, 33])
def test_sliding_window_equals_dense(window):
    """Gemma 3's local layers: with a window over the tokens' positions (one shorter than a
    tile, one longer), outputs within 2e-6 and gradients within 2e-5 of the dense form, the
    window traced as an int32 scalar (as a stacked layer scan passes it)."""
    segment, branch, positions = packed_layout(ROWS, T)
    q, k, v, w = random_qkvw(window, len(ROWS), T, 4, 2, 16)
    real = (segment != 0)[:, :, None, None]
    w = jnp.where(real, w, 0)

    def kernel(q, k, v, win):
        return packed_pallas.packed_flash(q, k, v, segment, branch, positions=positions, window=win, block=16,
                                          interpret=True)

    def dense(q, k, v, win):
        return attention_lib.packed_attention(q, k, v, segment, branch, impl="xla", window=win, positions=positions)

    win = jnp.int32(window)
    got, want = jax.jit(kernel)(q, k, v, win), dense(q, k, v, win)
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=2e-6, rtol=0)
    unwindowed = _dense(q, k, v, segment, branch)
    assert float(np.max(np.abs(np.where(real, unwindowed - want, 0)))) > 0.1  # the window matters here
    grads = [jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v, win) * w), argnums=(0, 1, 2))(q, k, v)
             for f in (kernel, dense)]
    for g, ref in zip(*grads):
        np.testing.assert_allclose(g, ref, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_impl_pallas_runs_the_kernel_only_where_it_applies():
    """packed_attention(impl="pallas"): the interpreted kernel inside `interpret_kernels` (padding
    queries get 0), with a sliding window too; outside it on this CPU, and for a head_dim the
    kernel refuses, the blockwise form (a padding query's finite average)."""
    segment, branch, positions = packed_layout(ROWS, T)
    q, k, v, _ = random_qkvw(3, len(ROWS), T, 4, 2, 16)
    pad = ~np.asarray(segment != 0)
    with packed_pallas.interpret_kernels():
        inside = np.asarray(attention_lib.packed_attention(q, k, v, segment, branch, impl="pallas"))
        windowed = np.asarray(attention_lib.packed_attention(q, k, v, segment, branch, impl="pallas", window=8,
                                                             positions=positions))
        odd = np.asarray(attention_lib.packed_attention(q[..., :12], k[..., :12], v[..., :12], segment, branch,
                                                        impl="pallas"))
    outside = np.asarray(attention_lib.packed_attention(q, k, v, segment, branch, impl="pallas"))
    assert np.all(inside[pad] == 0) and np.all(windowed[pad] == 0)
    assert not np.all(outside[pad] == 0) and not np.all(odd[pad] == 0)
    np.testing.assert_allclose(inside[~pad], outside[~pad], atol=2e-6)
    dense_windowed = np.asarray(attention_lib.packed_attention(q, k, v, segment, branch, impl="xla", window=8,
                                                               positions=positions))
    np.testing.assert_allclose(windowed[~pad], dense_windowed[~pad], atol=2e-6)


def _export_text(fn, args) -> str:
    checks = [export.DisabledSafetyCheck.custom_call(TRITON)]
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()


@pytest.mark.slow
def test_lowered_for_cuda_the_update_runs_three_triton_kernels_a_layer_and_no_attention_loop():
    """The gradient of a tiny 2-layer model's packed log-probs (bf16, head_dim 64, 4 query on 2
    key heads, 2 rows of 512 slots), exported for CUDA from this CPU: with attention "pallas"
    the scanned layer holds the forward, dq and dkv Triton kernels and XLA keeps only the loops
    the dense form has (the layer scan, the LM head's blocks); the blockwise form has more."""
    from _tiny_models import tiny_qwen3
    from jmarl.models import init
    from jmarl.train.packing import packed_logprobs

    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    batch = {"packed_tokens": i32(2, 512), "packed_positions": i32(2, 512), "packed_segment": i32(2, 512),
             "packed_branch": i32(2, 512), "pred_source": i32(256), "pred_target": i32(256), "pred_slot": i32(4, 64)}
    texts = {}
    for attention in ("pallas", "xla", "blockwise"):
        config = tiny_qwen3(hidden_size=128, intermediate_size=96, head_dim=64, o_bias=False,
                            max_position_embeddings=4096, compute_dtype="bfloat16", attention=attention)
        params = jax.eval_shape(lambda config=config: init(config, jax.random.key(0)))
        grad = jax.grad(lambda p, b, config=config: jnp.sum(packed_logprobs(config, p, b)))
        texts[attention] = _export_text(grad, (params, batch))
    assert texts["pallas"].count(TRITON) == 3
    assert TRITON not in texts["xla"] and TRITON not in texts["blockwise"]
    loops = {name: text.count("stablehlo.while") for name, text in texts.items()}
    assert loops["pallas"] == loops["xla"] < loops["blockwise"]


@pytest.mark.slow
def test_lowered_for_cuda_gemma3s_windowed_layers_take_the_kernel_too():
    """A tiny Gemma 3 (sliding and full layers in one scan, the window traced per layer), its
    packed update exported for CUDA with attention "pallas": the scanned layer holds the three
    Triton kernels, and no XLA loop is left beyond the dense form's."""
    from test_gemma3 import _hf_config
    from jmarl.models import init
    from jmarl.models.hf_config import config_from_hf
    from jmarl.train.packing import packed_logprobs

    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    batch = {"packed_tokens": i32(2, 256), "packed_positions": i32(2, 256), "packed_segment": i32(2, 256),
             "packed_branch": i32(2, 256), "pred_source": i32(128), "pred_target": i32(128), "pred_slot": i32(4, 32)}
    texts = {}
    for attention in ("pallas", "xla"):
        config = config_from_hf(_hf_config().to_dict(), compute_dtype="bfloat16").replace(attention=attention)
        params = jax.eval_shape(lambda config=config: init(config, jax.random.key(0)))
        grad = jax.grad(lambda p, b, config=config: jnp.sum(packed_logprobs(config, p, b)))
        texts[attention] = _export_text(grad, (params, batch))
    assert texts["pallas"].count(TRITON) == 3 and TRITON not in texts["xla"]
    assert texts["pallas"].count("stablehlo.while") == texts["xla"].count("stablehlo.while")
