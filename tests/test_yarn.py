"""YaRN RoPE (`rope_type: yarn`) exact to transformers' `_compute_yarn_parameters`: the inverse
frequencies and attention factor for every option, the cos/sin tables (times the factor), the
logits of tiny Qwen3 and Llama models at positions past original_max_position_embeddings (the
Qwen3-MoE model's: tests/test_qwen3_moe.py), the config round trip, and the RoPE types still
refused."""

import jax
import numpy as np
import pytest
import torch
import transformers

from _tiny_models import VOCAB_SIZE, make_tiny_torch_model
from jmarl.errors import JmarlError
from jmarl.models import apply, load_hf
from jmarl.models.hf_config import config_from_hf, config_to_hf
from jmarl.models.rope import inv_frequencies, rope_attention_scaling, rope_tables

BASE = dict(model_type="qwen3", vocab_size=10, hidden_size=64, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=1, head_dim=64, max_position_embeddings=512)
YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 32}
OPTIONS = {
    "defaults": {},
    "betas": {"beta_fast": 16, "beta_slow": 2},
    "no-truncate": {"truncate": False},
    "attention-factor": {"attention_factor": 1.3},
    "mscale": {"mscale": 1.0, "mscale_all_dim": 0.5},  # DeepSeek's ratio of two mscales
    "large-theta": {"rope_theta": 1_000_000.0, "factor": 8.0, "original_max_position_embeddings": 64},
}


def _hf_config(rope: dict) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(**{k: v for k, v in BASE.items() if k != "model_type"}, rope_parameters=rope)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_inverse_frequencies_and_attention_factor_match_transformers(option):
    rope = {**YARN, **OPTIONS[option]}
    inv_freq, factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](_hf_config(rope), "cpu")
    config = config_from_hf({**BASE, "rope_parameters": rope})
    assert config.rope_type == "yarn" and config.rope_factor == rope["factor"]
    np.testing.assert_allclose(inv_frequencies(config), inv_freq.numpy(), rtol=1e-6)
    np.testing.assert_allclose(rope_attention_scaling(config), factor, rtol=1e-12)
    assert rope_attention_scaling(config, local=True) == 1.0
    assert config_from_hf(config_to_hf(config)) == config


def test_legacy_rope_scaling_and_a_missing_factor_read_as_transformers_does():
    legacy = config_from_hf({**BASE, "rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                              "original_max_position_embeddings": 32}})
    assert legacy == config_from_hf({**BASE, "rope_parameters": YARN})
    # no original_max_position_embeddings: max_position_embeddings (then the factor only blends nothing in)
    no_original = config_from_hf({**BASE, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    assert no_original.rope_original_max_position == 512
    # factor null: max_position_embeddings / original
    implied = config_from_hf({**BASE, "rope_parameters": {**YARN, "factor": None}})
    assert implied.rope_factor == 512 / 32


def test_rope_tables_match_transformers_rotary_with_the_attention_factor():
    """Both forms (trace-time tables gathered, and computed in the program) equal Qwen3's rotary
    cos/sin, which carry the attention factor."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = config_from_hf({**BASE, "rope_parameters": YARN})
    positions = np.array([[0, 1, 31, 32, 200], [7, 64, 128, 3, 511]], np.int32)
    rotary = Qwen3RotaryEmbedding(_hf_config(YARN))
    want = [t.numpy() for t in rotary(torch.zeros(1, dtype=torch.float32), torch.tensor(positions, dtype=torch.long))]
    assert np.abs(want[0]).max() > 1.1  # the attention factor (0.1 ln 4 + 1 = 1.139) is in them
    # A float32 angle position x frequency is exact to half its spacing (3e-5 rad at 511), and the
    # two libraries round it in different orders, differently on different CPUs: cos/sin x the
    # factor agree to the factor times one spacing of the largest angle, far below a wrong
    # frequency or factor (0.14 for a missing attention factor).
    atol = 1.2 * float(np.spacing(np.float32(positions.max())))
    for bound in (512, None):
        got = jax.jit(lambda p, bound=bound: rope_tables(config, p, bound))(positions)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=atol)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_logits_match_transformers_past_the_original_context(family, tiny_hf_checkpoint):
    """Tiny models with YaRN x4 over an original context of 8 positions: logits equal
    transformers' for 40 tokens (right- and left-padded rows), most positions past 8."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    overrides = dict(rope_scaling=rope, max_position_embeddings=64)
    path = tiny_hf_checkpoint(family, **overrides)
    model = make_tiny_torch_model(family, **overrides)
    config, params = load_hf(path)
    assert config.rope_type == "yarn" and config.rope_original_max_position == 8
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, VOCAB_SIZE, (3, 40))
    mask = np.ones((3, 40), bool)
    mask[1, 30:] = False
    mask[2, :12] = False
    tokens[~mask] = 0
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                    position_ids=torch.tensor(positions)).logits.numpy()
    ours = np.asarray(apply(config, params, tokens, mask))
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)
    # without the attention factor the logits would differ: the test sees it
    plain = np.asarray(apply(config.replace(rope_attention_factor=1.0), params, tokens, mask))
    assert np.abs(plain - ref)[mask].max() > 1e-3


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}])
def test_other_rope_types_are_still_refused(rope):
    with pytest.raises(JmarlError, match="unsupported RoPE scaling type"):
        config_from_hf({**BASE, "rope_parameters": rope})


def test_partial_rotary_yarn_is_refused():
    with pytest.raises(JmarlError, match="partial_rotary_factor"):
        config_from_hf({**BASE, "rope_parameters": {**YARN, "partial_rotary_factor": 0.5}})
