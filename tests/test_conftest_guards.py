"""The suite's guard against running out of memory mappings (tests/conftest.py)."""

import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import _mappings, drop_jax_caches_past


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/maps")
def test_live_executables_hold_mappings_that_dropping_the_caches_returns():
    programs = [jax.jit(lambda x, i=i: jnp.sin(x) * i + jnp.cos(x * x)) for i in range(200)]
    for program in programs:
        program(jnp.ones(8)).block_until_ready()
    before = _mappings()
    assert not drop_jax_caches_past(before + 1_000)  # under the limit: nothing dropped
    assert drop_jax_caches_past(0)  # the jitted functions stay alive; their executables go
    assert _mappings() < before - 200  # ~3 mappings per executable came back
