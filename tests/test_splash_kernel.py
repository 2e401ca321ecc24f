"""`jmarl.models.splash_kernel`: the Pallas splash kernels (run by the Pallas interpreter on this
CPU, `interpret=True`) as the packed split's PartKernel, against the dense reference, float32:
each part's out and lse (own part causal and on LocalMask, prompt part), the raw kernel's
answer on a fully masked query row (why the module overwrites those), and the whole packed
attention, forward and gradient in q, k, v, on ragged rows (several segments a row,
continuations of different lengths, a prompt-only segment, a padded tail, a row of padding
only; T not a multiple of 128, two key blocks), grouped-query heads, with and without a
sliding window. And the programs exported from this CPU: the packed update's gradient for TPU
carries the splash kernels and no blockwise loop; what the GPU forms do when lowered for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jmarl.models import attention as attention_lib
from jmarl.models import attention_kernels
from jmarl.models import packed_split as ps
from jmarl.models import splash_kernel as sk
from test_packed_split import packed_layout, random_qkvw

H, KV, HD, T, BLOCK, WINDOW = 4, 2, 64, 200, 128, 16
# per row: segments (prompt length, [continuation lengths])
ROWS = [
    [(30, [20, 45]), (12, [7]), (9, []), (25, [33, 11, 5])],  # 197 slots, a prompt-only segment
    [(70, [40, 60])],  # one segment, 30 padding
    [],  # padding only
]
ATOL = RTOL = 2e-5
INTERPRET = jax.default_backend() != "tpu"  # on a TPU the compiled kernels run


def _layout():
    """segment, branch, positions int[R,T] of ROWS."""
    return packed_layout(ROWS, T)


def _inputs(seed=0):
    return random_qkvw(seed, len(ROWS), T, H, KV, HD)


@pytest.mark.slow
def test_has_key_matches_the_dense_mask():
    seg, br, _ = _layout()
    for (q_ids, k_ids), causal in ((ps.own_ids(seg, br), True), (ps.prompt_ids(seg, br), False)):
        want = np.asarray(jnp.any(ps.part_mask(q_ids, k_ids, causal=causal), axis=-1))
        np.testing.assert_array_equal(np.asarray(sk.has_key(q_ids, k_ids, causal=causal)), want)
    # causal: a key with the query's id only after it does not count (query 0's key is at slot 1)
    q_ids, k_ids = jnp.array([[1, 2, 2]]), jnp.array([[2, 1, 2]])
    assert sk.has_key(q_ids, k_ids, causal=True).tolist() == [[False, True, True]]
    assert sk.has_key(q_ids, k_ids, causal=False).tolist() == [[True, True, True]]


@pytest.mark.slow
def test_raw_splash_averages_a_fully_masked_row():
    """What the module works around: a query whose segment id matches no key gets the mean of
    the values and an lse of mask_value + log(keys) from the kernel, not an error or NaN."""
    kernel_lib, _ = sk._splash()
    kernel = sk._kernel(128, 1, False, None, 128, INTERPRET)
    q, k, v = (jax.random.normal(key, (1, 128, HD)) for key in jax.random.split(jax.random.key(1), 3))
    q_ids = jnp.zeros(128, jnp.int32).at[5].set(7)  # query 5 sees no key
    out, (lse,) = kernel(q, k, v, segment_ids=kernel_lib.SegmentIds(q=q_ids, kv=jnp.zeros(128, jnp.int32)))
    np.testing.assert_allclose(out[0, 5], v[0].mean(axis=0), atol=1e-5)
    np.testing.assert_allclose(lse[0, 5], ps.MASKED_LSE + np.log(128), rtol=1e-6)


@pytest.mark.slow
def test_splash_parts_equal_the_reference_part():
    q, k, v, _ = _inputs()
    seg, br, pos = _layout()
    cases = {
        "own": (ps.own_ids(seg, br), True, None),
        "own, LocalMask": (ps.own_ids(seg, br), True, WINDOW),
        "prompt": (ps.prompt_ids(seg, br), False, None),
    }
    for name, ((q_ids, k_ids), causal, local) in cases.items():
        got = jax.jit(lambda q, k, v: sk.splash_part(q, k, v, q_ids, k_ids, causal=causal, local=local,
                                                     block=BLOCK, interpret=INTERPRET))(q, k, v)
        want = ps.reference_part(q, k, v, q_ids, k_ids, causal=causal, positions=pos,
                                 window=None if local is None else jnp.int32(local))
        for g, w, what in zip(got, want, ("out", "lse")):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=ATOL, rtol=RTOL, err_msg=f"{name} {what}")
        # queries with no key in the part: out 0, lse MASKED_LSE (the prompt part's prompt and padding queries)
        none = ~np.asarray(sk.has_key(q_ids, k_ids, causal=causal))
        assert none.any() and np.all(np.asarray(got[0])[none] == 0)
        assert np.all(np.asarray(got[1])[none] == ps.MASKED_LSE)


def _check_split_against_dense(window, local_window):
    q, k, v, w = _inputs()
    seg, br, pos = _layout()
    real = (seg != 0)[..., None, None]
    kernel = sk.splash_kernel(local_window=local_window, block=BLOCK, interpret=INTERPRET)
    p = None if window is None else pos

    def split_out(q, k, v, win):  # through packed_attention's split form, as a caller would
        return attention_lib.packed_attention(q, k, v, seg, br, impl="split", positions=p, window=win, kernel=kernel)

    def split(q, k, v, win):
        return jnp.sum(split_out(q, k, v, win) * w)

    def dense(q, k, v, win):  # the dense form averages padding queries: count real ones only
        out = attention_lib.packed_attention(q, k, v, seg, br, impl="dense", positions=p, window=win)
        return jnp.sum(jnp.where(real, out, 0.0) * w)

    win = None if window is None else jnp.int32(window)  # traced, as the layer scan passes it
    got = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2)))(q, k, v, win)
    want = jax.jit(jax.value_and_grad(dense, argnums=(0, 1, 2)))(q, k, v, win)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=RTOL)
    for g, d, name in zip(got[1], want[1], "qkv"):
        assert float(jnp.abs(d).max()) > 0.1, name  # the gradient is not trivially 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(d), atol=ATOL, rtol=RTOL, err_msg=f"d{name}")
    out = jax.jit(split_out)(q, k, v, win)
    assert np.all(np.asarray(out)[np.asarray(seg) == 0] == 0)  # padding queries: 0 (and no NaN)


@pytest.mark.slow
def test_splash_split_equals_dense_forward_and_gradient():
    _check_split_against_dense(None, None)


@pytest.mark.slow
@pytest.mark.parametrize("window,local_window", [(attention_lib.NO_WINDOW, WINDOW), (WINDOW, WINDOW), (WINDOW, None)],
                         ids=["full-layer", "LocalMask", "reference"])
def test_splash_split_with_a_window_equals_dense(window, local_window):
    """A layer scan's traced window: NO_WINDOW (splash unwindowed), the kernel's local_window
    (own part on LocalMask, prompt part dense), another window (both parts dense)."""
    _check_split_against_dense(window, local_window)


# ---------------------------------------------------------------------------------- export
_TRITON = "__gpu$xla.gpu.triton"


def _export(fn, args, platform: str, allow: tuple[str, ...] = ()) -> str:
    checks = [export.DisabledSafetyCheck.custom_call(target) for target in allow]
    return export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args).mlir_module()


def _packed_logprob_grad_text(attention: str, platform: str) -> str:
    """The gradient of the summed packed log-probs of a tiny 2-layer model (bf16, head_dim 64,
    GQA 4:2; 2 rows of 512 slots: past the dense form's width) exported for `platform`."""
    from _tiny_models import tiny_qwen3
    from jmarl.models import init
    from jmarl.train.packing import packed_logprobs

    config = tiny_qwen3(hidden_size=128, intermediate_size=96, head_dim=64, o_bias=False, max_position_embeddings=4096,
                        compute_dtype="bfloat16", attention=attention)
    params = jax.eval_shape(lambda: init(config, jax.random.key(0)))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    batch = {"packed_tokens": i32(2, 512), "packed_positions": i32(2, 512), "packed_segment": i32(2, 512),
             "packed_branch": i32(2, 512), "pred_source": i32(256), "pred_target": i32(256), "pred_slot": i32(4, 64)}
    grad = jax.grad(lambda p, b: jnp.sum(packed_logprobs(config, p, b)))
    return _export(grad, (params, batch), platform)


@pytest.mark.slow
def test_exported_packed_update_carries_splash_on_tpu_and_blockwise_elsewhere():
    """Lowered on this CPU inside `lowering_for_tpu`: for TPU, attention auto puts both parts on splash (forward 2
    kernels, backward dkv + dq for each part: 6 Mosaic calls in the scanned layer) and no
    blockwise loop (as many while loops as the dense form's: the layer scan and the LM head's
    blocks); for CPU and CUDA
    the blockwise loops and no kernel: auto does not take the fused GPU kernel, which is opt-in
    until measured (attention "pallas", tests/test_packed_pallas.py)."""
    loops = {}
    assert not attention_lib.traces_tpu_route()  # this CPU traces the TPU route only when asked
    for platform in ("tpu", "cpu", "cuda"):
        with attention_lib.lowering_for_tpu():
            text = _packed_logprob_grad_text("auto", platform)
        loops[platform] = text.count("stablehlo.while")
        dense_loops = _packed_logprob_grad_text("xla", platform).count("stablehlo.while")
        if platform == "tpu":
            assert text.count("tpu_custom_call") == 6
            assert loops[platform] == dense_loops  # the layer scan and the LM head's block loops, no more
        else:
            assert "tpu_custom_call" not in text and "__cudnn" not in text and _TRITON not in text
            assert loops[platform] > dense_loops
    assert loops["cpu"] == loops["cuda"]


def test_gpu_kernel_forms_for_the_parts_lower_for_cuda_or_say_why():
    """The GPU forms packed_split's docstring names, lowered for CUDA on this CPU, one part's
    shape (2 rows x 512 slots, 4 query and 2 key heads of 64, bf16):

    cuDNN's packed (THD) layout, the one that takes a part's sequences as offsets: its trace
        asks the local GPU's compute capability (`check_compute_capability("9.0")`), so without
        a GPU it refuses: NotImplementedError "Packed layout requires a GPU with at least
        Hopper architecture." (the trace stops there, before any lowering).
    Pallas GPU `mha` (Triton), own part by segment ids: lowers, forward with its residuals and
        gradient, to the `__gpu$xla.gpu.triton` custom call, which jax.export refuses to
        serialize unless that target's check is disabled (no compatibility guarantee)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_lib
    from jax.experimental.pallas.ops.gpu import attention as triton_lib

    b, t, h, kv, d, m = 2, 512, 4, 2, 64, 8
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731

    def cudnn(q, k, v, q_len, kv_len, q_off, kv_off):
        with attention_kernels._cudnn_version_for_lowering():
            return cudnn_lib.dot_product_attention(q, k, v, None, None, q_len, kv_len, q_off, kv_off, scale=d**-0.5,
                                                   mask_type=cudnn_lib.MaskType.PADDING_CAUSAL, return_residual=True)

    with pytest.raises(NotImplementedError, match=r"^Packed layout requires a GPU with at least Hopper architecture\."):
        _export(cudnn, (bf16(b, t, h, d), bf16(b, t, kv, d), bf16(b, t, kv, d), i32(b, m), i32(b, m),
                        i32(b, m + 1), i32(b, m + 1)), "cuda",
                allow=("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"))

    def triton(q, k, v, seg):
        out, res = triton_lib.mha(q, k, v, seg, sm_scale=d**-0.5, causal=True, return_residuals=True)
        grad = jax.grad(lambda q, k, v: jnp.sum(triton_lib.mha(q, k, v, seg, sm_scale=d**-0.5, causal=True)
                                                .astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
        return out, res, grad

    args = (bf16(b, t, h, d), bf16(b, t, h, d), bf16(b, t, h, d), i32(b, t))  # one segment-id array: K/V per head
    assert _export(triton, args, "cuda", allow=(_TRITON,)).count(_TRITON) >= 3  # forward, dq/dkv backward
    with pytest.raises(ValueError, match="Cannot serialize code with custom calls whose targets have no compatibility"):
        _export(triton, args, "cuda")
