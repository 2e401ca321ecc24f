"""tests/conftest.py: the suite's guard against running out of memory mappings, and the shared
fixtures (tiny HF checkpoints, the tiny Qwen3 model, meshes)."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import _mappings, drop_jax_caches_past


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/maps")
@pytest.mark.slow
def test_live_executables_hold_mappings_that_dropping_the_caches_returns():
    programs = [jax.jit(lambda x, i=i: jnp.sin(x) * i + jnp.cos(x * x)) for i in range(200)]
    for program in programs:
        program(jnp.ones(8)).block_until_ready()
    before = _mappings()
    assert not drop_jax_caches_past(before + 1_000)  # under the limit: nothing dropped
    assert drop_jax_caches_past(0)  # the jitted functions stay alive; their executables go
    assert _mappings() < before - 200  # ~3 mappings per executable came back


def test_tiny_hf_checkpoint_is_written_once_per_config_and_seed(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("qwen2")
    assert os.path.isfile(os.path.join(path, "model.safetensors")) and os.path.isfile(os.path.join(path, "config.json"))
    assert tiny_hf_checkpoint("qwen2", tie_word_embeddings=False) == path  # the default, spelled out: the same
    assert tiny_hf_checkpoint("qwen2", seed=1) != path
    assert tiny_hf_checkpoint("qwen2", tie_word_embeddings=True) != path


def test_tiny_qwen3_model_is_the_default_tiny_model(tiny_qwen3_model):
    from _tiny_models import tiny_qwen3
    from jmarl import models

    config, params = tiny_qwen3_model
    assert config == tiny_qwen3()
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
    assert shapes(params) == shapes(models.param_shapes(config))


def test_mesh_builds_the_axes_or_skips_saying_how_many_devices(mesh):
    assert dict(mesh(data=2, tensor=-1).shape) == {"data": 2, "policy": 1, "fsdp": 1, "tensor": jax.device_count() // 2}
    with pytest.raises(pytest.skip.Exception, match=rf"needs {2 * jax.device_count()} devices; this process has"):
        mesh(data=2, fsdp=jax.device_count())
