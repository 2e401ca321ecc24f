"""Model settings of a run: preset names of published shapes, remat/attention, fp32 master
parameters (bf16 + AdamW refused, LoRA adapters float32), the memory/cache fields of `train`."""

import functools
import os
import subprocess
import sys
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmarl import models
from jmarl.config import (
    ArchConfig,
    AttentionName,
    ModelSpec,
    RematName,
    config_from_dict,
    dump_yaml,
    load_config,
    parse_bytes,
    parse_yaml,
)
from jmarl.errors import JmarlError
from jmarl.models.config import ATTENTION_IMPLS, REMAT_AUTO_MIN_PARAMS, REMAT_POLICIES, ModelConfig
from jmarl.models.hf_config import config_from_hf, config_to_hf
from jmarl.models.presets import preset_names
from jmarl.train import policies
from jmarl.train.lora import init_lora, merge_lora
from jmarl.train.step import init_train_state, low_precision_leaves

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = "configs/quickstart.yaml"
TOKENIZER = models.CharTokenizer()
BASE = {"env": {"name": "plan_path"}, "algo": {"name": "grpo"}, "tokenizer": "char"}

# Published parameter counts in billions, as the model cards round them: each preset's count
# rounds to it (to the digits given), and lies within 1.5% of it (Qwen3-1.7B has 1.72B).
PUBLISHED = {
    "qwen3-0.6b": "0.6", "qwen3-1.7b": "1.7", "qwen3-4b": "4.0", "qwen3-8b": "8.2",
    "qwen3-30b-a3b": "30.5", "qwen3-235b-a22b": "235",  # mixture-of-experts: all experts counted
    "llama3.2-1b": "1.24", "llama3.2-3b": "3.2", "llama3.1-8b": "8.0",
    "gemma3-270m": "0.27", "gemma3-1b": "1.0",
    # the text part: the published 4B, 12B and 27B counts include a ~0.4B vision encoder
    "gemma3-4b": "3.9", "gemma3-12b": "11.8", "gemma3-27b": "27.0",
}


def make(model: dict, **sections) -> object:
    """A validated Config with `model` (and other sections) set."""
    return config_from_dict({**BASE, "model": model, **sections})


@pytest.fixture
def abstract_init(monkeypatch):
    """`models.init` traced only (jax.eval_shape): preset models of real size allocate nothing."""
    real = models.init
    monkeypatch.setattr(models, "init", lambda config, rng: jax.eval_shape(functools.partial(real, config), rng))


# ------------------------------------------------------------------------------ preset names


def test_every_preset_is_named_and_has_its_published_size(abstract_init):
    assert set(preset_names()) == set(PUBLISHED)
    for name, published in PUBLISHED.items():
        spec = make({"preset": name, "compute_dtype": "bfloat16"}).model
        assert spec.preset == name
        config, params = policies.build_model(spec, TOKENIZER, jax.random.key(0))
        count = sum(x.size for x in jax.tree.leaves(params))
        assert count == config.num_params()
        digits = len(published.split(".")[1]) if "." in published else 0
        assert f"{count / 1e9:.{digits}f}" == published, (name, count)
        assert abs(count / (float(published) * 1e9) - 1) < 0.015, (name, count)
        assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
        assert config.param_dtype == "float32" and config.compute_dtype == "bfloat16"
        assert config.remat == "full"  # auto: every preset has >= 1e8 parameters
        # the run's tokenizer supplies the special ids; the embedding keeps the preset's size
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
            TOKENIZER.bos_id, TOKENIZER.eos_id, TOKENIZER.pad_id)
        assert config.vocab_size > TOKENIZER.vocab_size


def test_preset_shapes_are_the_checkpoints(abstract_init):
    qwen, _ = policies.build_model(ModelSpec(preset="Qwen3-1.7B"), TOKENIZER, jax.random.key(0))
    assert (qwen.model_type, qwen.hidden_size, qwen.num_layers, qwen.num_heads, qwen.num_kv_heads) == (
        "qwen3", 2048, 28, 16, 8)
    assert qwen.qk_norm and qwen.tie_word_embeddings and qwen.vocab_size == 151936
    llama, _ = policies.build_model(ModelSpec(preset="llama3.1-8b"), TOKENIZER, jax.random.key(0))
    assert (llama.model_type, llama.rope_type, llama.rope_factor, llama.intermediate_size) == (
        "llama", "llama3", 8.0, 14336)
    assert not llama.tie_word_embeddings and llama.num_params() == 8_030_261_248


def test_a_tokenizer_larger_than_the_preset_vocabulary_is_refused(abstract_init):
    class Big:
        vocab_size, bos_id, eos_id, pad_id = 200_000, 0, 1, 2

    with pytest.raises(JmarlError, match=r"^policies.models.q.model.preset: the tokenizer has 200000 ids but "
                                         r"preset 'qwen3-0.6b' embeds 151936"):
        policies.build_model(ModelSpec(preset="qwen3-0.6b"), Big(), jax.random.key(0),
                             setting="policies.models.q.model")
    with pytest.raises(JmarlError, match="^model.preset: a preset model needs a tokenizer"):
        policies.build_model(ModelSpec(preset="qwen3-0.6b"), None, jax.random.key(0))


def test_unknown_preset_names_the_setting_and_lists_the_presets():
    listed = ", ".join(preset_names())
    with pytest.raises(JmarlError) as err:
        make({"preset": "qwen3-1.8b"})
    assert str(err.value) == (
        f"model.preset: unknown preset 'qwen3-1.8b'; presets: {listed} (or a mapping of architecture fields "
        "such as {model_type: qwen3, hidden_size: 64, num_layers: 2}, or set model.path to a local checkpoint)"
        " — did you mean 'qwen3-1.7b'?"
    )
    hetero = {"mode": "heterogeneous", "models": {"a": {"model": {"preset": "lama3.2-1b"}, "tokenizer": "char"},
                                                  "b": {"model": {"preset": "qwen3-0.6b"}, "tokenizer": "char"}}}
    with pytest.raises(JmarlError, match=r"^policies.models.a.model.preset: unknown preset 'lama3.2-1b'.*"
                                         r"or set policies.models.a.model.path to a local checkpoint\) "
                                         r"— did you mean 'llama3.2-1b'\?$"):
        config_from_dict({**BASE, "tokenizer": None, "algo": {"name": "hacpo"}, "env": {"name": "math"},
                          "policies": hetero})


def test_preset_mappings_still_validate_field_by_field():
    assert make({"preset": {"num_layers": 1}}).model.preset == ArchConfig(num_layers=1)
    with pytest.raises(JmarlError, match=r"^model.preset.num_heads \(4\) must be a multiple"):
        make({"preset": {"num_heads": 4, "num_kv_heads": 3}})
    with pytest.raises(JmarlError, match="^unknown key 'model.preset.hiden_size' — did you mean"):
        make({"preset": {"hiden_size": 8}})
    with pytest.raises(JmarlError, match="^model.preset: expected str or mapping .section. or null, got int 3"):
        make({"preset": 3})


def test_preset_name_and_settings_round_trip_through_yaml():
    config = make({"preset": "qwen3-4b", "remat": True, "attention": "splash"},
                  train={"memory_check": "on", "device_memory": "80GiB", "compilation_cache": "off"})
    assert config.model.remat == "full"  # true is stored as the policy it means
    assert config_from_dict(parse_yaml(dump_yaml(config), "dump")) == config
    assert "preset: qwen3-4b" in dump_yaml(config)


@pytest.mark.slow
def test_cli_unknown_preset_is_one_line_with_status_2_and_print_config_takes_a_name():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    run = functools.partial(subprocess.run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    bad = run([sys.executable, "-m", "jmarl.run", "--config", QUICKSTART, "model.preset=nope"])
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: model.preset: unknown preset 'nope'; presets: qwen3-0.6b, ")
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stdout + bad.stderr
    good = run([sys.executable, "-m", "jmarl.run", "--config", QUICKSTART, "model.preset=qwen3-8b",
                "model.remat=dots", "--print-config"])
    assert good.returncode == 0, good.stderr
    printed = config_from_dict(parse_yaml(good.stdout, "stdout"))
    assert printed == load_config(ROOT / QUICKSTART, ["model.preset=qwen3-8b", "model.remat=dots"])
    assert printed.model.preset == "qwen3-8b" and printed.model.remat == "dots"


# ------------------------------------------------------------------------------ remat and attention


def test_settings_match_the_model_configs_choices():
    assert typing.get_args(AttentionName) == ATTENTION_IMPLS
    assert typing.get_args(RematName) == ("auto", *REMAT_POLICIES)


@pytest.mark.parametrize("value, stored", [(True, "full"), (False, "none"), ("dots", "dots"), ("auto", "auto")])
def test_remat_accepts_policies_and_booleans(value, stored):
    assert make({"preset": {}, "remat": value}).model.remat == stored
    assert make({"preset": {}}).model.remat == "auto"


def test_bad_remat_and_attention_values():
    with pytest.raises(JmarlError, match="^model.remat: must be one of 'auto', 'none', 'full', 'dots'; "
                                         "got 'ful' — did you mean 'full'\\?"):
        make({"preset": {}, "remat": "ful"})
    with pytest.raises(JmarlError, match="^model.remat: expected bool or one of 'auto'.*got int 1"):
        make({"preset": {}, "remat": 1})
    with pytest.raises(JmarlError, match="^model.attention: must be one of 'auto', 'xla', 'cudnn', 'splash', "
                                         "'blockwise', 'pallas'; got 'flash'"):
        make({"preset": {}, "attention": "flash"})


def test_remat_auto_resolves_by_parameter_count():
    assert policies.resolve_remat("auto", REMAT_AUTO_MIN_PARAMS) == "full"
    assert policies.resolve_remat("auto", REMAT_AUTO_MIN_PARAMS - 1) == "none"
    assert policies.resolve_remat(True, 10) == "full" and policies.resolve_remat(False, 10**10) == "none"
    assert policies.resolve_remat("dots", 10) == "dots" and policies.resolve_remat("none", 10**10) == "none"
    tiny, _ = policies.build_model(make({"preset": {"num_layers": 1}}).model, TOKENIZER, jax.random.key(0))
    assert tiny.remat == "none" and tiny.num_params() < REMAT_AUTO_MIN_PARAMS
    forced, _ = policies.build_model(make({"preset": {"num_layers": 1}, "remat": "full", "attention": "xla"}).model,
                                     TOKENIZER, jax.random.key(0))
    assert forced.remat == "full" and forced.attention == "xla"


def _shape(**fields) -> ModelConfig:
    """A ModelConfig of a Qwen3-like shape (a description only: nothing is allocated)."""
    shape = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                 num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=True)
    return ModelConfig(**{**shape, **fields})


def test_model_config_default_remat_is_auto_by_parameter_count():
    """A ModelConfig built without `remat` (the functional API: jax.grad through
    models.token_logprobs) gets the trainer's rule: full layer remat from 1e8 parameters up."""
    big = _shape()
    assert big.num_params() >= REMAT_AUTO_MIN_PARAMS and big.remat == "full"
    tiny = _shape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16)
    assert tiny.num_params() < REMAT_AUTO_MIN_PARAMS and tiny.remat == "none"
    # the boundary is the trainer's: the same function decides both
    for config in (big, tiny):
        assert config.remat == policies.resolve_remat("auto", config.num_params())
    # an explicit setting wins at any size; replace(remat="auto") resolves on the new shape
    assert _shape(remat="none").remat == "none" and _shape(remat=False).remat == "none"
    assert tiny.replace(remat="dots").remat == "dots"
    assert big.replace(num_layers=1, vocab_size=64, remat="auto").remat == "none"
    assert config_from_hf(config_to_hf(big)).remat == "full"
    with pytest.raises(JmarlError, match=r"^ModelConfig.remat: must be auto, none, full, dots, true or false; got 'ful'"):
        _shape(remat="ful")


def test_checkpoint_path_takes_numerics_remat_and_attention(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("qwen3")
    spec = make({"path": path, "compute_dtype": "bfloat16", "attention": "blockwise"}, tokenizer=None).model
    config, params = policies.build_model(spec, None, jax.random.key(0))
    assert (config.param_dtype, config.compute_dtype, config.attention, config.remat) == (
        "float32", "bfloat16", "blockwise", "none")
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    stored, _ = models.load_hf(path, "bfloat16")
    assert stored.param_dtype == stored.compute_dtype == "bfloat16"
    split, split_params = models.load_hf(path, "float32", compute_dtype="bfloat16")
    assert (split.param_dtype, split.compute_dtype) == ("float32", "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(split_params)} == {jnp.dtype(jnp.float32)}


# ------------------------------------------------------------------------------ fp32 master parameters


@pytest.mark.parametrize("mode", ["shared", "per_agent"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_trained_parameters_are_refused(mode, dtype):
    with pytest.raises(JmarlError) as err:
        make({"preset": "qwen3-1.7b", "param_dtype": dtype, "compute_dtype": "bfloat16"},
             policies={"mode": mode})
    message = str(err.value)
    assert message.startswith(f"model.param_dtype: {dtype} parameters barely train with AdamW")
    assert ("keep float32 master parameters and compute in bfloat16: "
            "model.param_dtype=float32 model.compute_dtype=bfloat16") in message
    assert message.endswith(f"(or policies.mode=lora to train float32 adapters on a frozen {dtype} base)")


def test_low_precision_heterogeneous_policy_is_refused_by_name():
    models_ = {"qwen": {"model": {"preset": {}}, "tokenizer": "char"},
               "llama": {"model": {"preset": {"model_type": "llama"}, "param_dtype": "bfloat16"},
                         "tokenizer": "char"}}
    with pytest.raises(JmarlError, match="^policies.models.llama.model.param_dtype: bfloat16 parameters .*"
                                         "policies.models.llama.model.param_dtype=float32 "
                                         "policies.models.llama.model.compute_dtype=bfloat16$"):
        config_from_dict({"env": {"name": "math"}, "algo": {"name": "hacpo"},
                          "policies": {"mode": "heterogeneous", "models": models_}})


@pytest.mark.slow
def test_lora_on_a_bf16_base_trains_float32_adapters():
    config = make({"preset": {"num_layers": 1}, "param_dtype": "bfloat16", "compute_dtype": "bfloat16"},
                  policies={"mode": "lora"})
    mcfg, base = policies.build_model(config.model, TOKENIZER, jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
    adapters = init_lora(base, jax.random.key(1), rank=4, target_modules=("q_proj", "v_proj"))
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    state = init_train_state(adapters, optax.adamw(1e-3))  # no low-precision leaves: accepted
    assert low_precision_leaves(state.params) == []
    # A trained adapter changes the merged (bf16) kernel; the gradient reaching it is float32.
    grown = jax.tree.map(lambda x: x, adapters)
    q = grown["layers"]["attn"]["q_proj"]["kernel"]
    q["b"] = jnp.full_like(q["b"], 0.05)
    merged = merge_lora(base, grown, rank=4, alpha=8.0)
    w0, w1 = base["layers"]["attn"]["q_proj"]["kernel"], merged["layers"]["attn"]["q_proj"]["kernel"]
    assert w1.dtype == jnp.bfloat16 and not np.array_equal(np.asarray(w0, np.float32), np.asarray(w1, np.float32))
    assert merged["layers"]["attn"]["k_proj"]["kernel"] is base["layers"]["attn"]["k_proj"]["kernel"]
    grads = jax.grad(lambda ad: jnp.sum(merge_lora(base, ad, rank=4, alpha=8.0)["layers"]["attn"]["q_proj"]["kernel"]
                                        .astype(jnp.float32)))(grown)
    assert grads["layers"]["attn"]["q_proj"]["kernel"]["a"].dtype == jnp.float32


def test_init_train_state_refuses_low_precision_unless_allowed():
    params = {"w": jnp.ones((2, 2), jnp.float32), "emb": {"table": jnp.ones((3,), jnp.bfloat16)},
              "count": jnp.zeros((), jnp.int32)}
    assert low_precision_leaves(params) == [("['emb']['table']", "bfloat16")]
    with pytest.raises(JmarlError, match=r"^init_train_state: 1 trainable parameter\(s\) are stored below float32 "
                                         r"\(first: \['emb'\]\['table'\] is bfloat16\).*allow_low_precision=True$"):
        init_train_state(params, optax.adamw(1e-3))
    state = init_train_state(params, optax.adamw(1e-3), allow_low_precision=True)
    assert state.params["emb"]["table"].dtype == jnp.bfloat16
    fp32 = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, params)
    assert int(init_train_state(fp32, optax.adamw(1e-3)).step) == 0
    with pytest.raises(JmarlError, match="is float16"):  # also under jit / vmap (tracers have dtypes)
        jax.jit(lambda p: init_train_state(p, optax.sgd(0.1)))({"h": jnp.ones((2,), jnp.float16)})
    with pytest.raises(TypeError):  # keyword-only
        init_train_state(params, optax.sgd(0.1), True)


# ------------------------------------------------------------------------------ train.* memory fields


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("16e9", 16 * 10**9),
        ("1.5 GiB", 3 * 2**29), ("512MiB", 512 * 2**20), ("2KB", 2000), ("3kib", 3072), ("100B", 100),
        (" 7 ", 7), ("1TiB", 2**40), (".5KB", 500), (17179869184, 17179869184), (1.6e10, 16 * 10**9),
    ],
)
def test_parse_bytes_forms(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "eighty", "80 GiGs", "0", "0GB", "-1GB", "1e400", "GB", "8 0GB", True, None,
                                  float("nan")])
def test_parse_bytes_errors_list_the_forms(text):
    with pytest.raises(JmarlError, match=f"^cannot read {repr(text).replace('(', '.').replace(')', '.')} as a size "
                                         "in bytes .*80GiB, 80GB, 1.5GiB"):
        parse_bytes(text)


def test_train_memory_fields_validate():
    train = make({"preset": {}}).train
    assert (train.memory_check, train.device_memory, train.memory_headroom, train.compilation_cache) == (
        "auto", None, 0.1, "auto")
    assert train.device_memory_bytes() is None
    set_ = make({"preset": {}}, train={"memory_check": "on", "device_memory": "16e9", "memory_headroom": 0,
                                       "compilation_cache": "/tmp/xla"}).train
    assert (set_.memory_check, set_.device_memory_bytes(), set_.memory_headroom, set_.compilation_cache) == (
        "on", 16 * 10**9, 0.0, "/tmp/xla")
    # YAML reads on/off as booleans: both spellings mean the same
    loaded = load_config(ROOT / QUICKSTART, ["train.memory_check=off", "train.compilation_cache=off",
                                             "train.device_memory=80000000000"])
    assert loaded.train.memory_check == "off" and loaded.train.compilation_cache == "off"
    assert loaded.train.device_memory_bytes() == 80 * 10**9
    assert load_config(ROOT / QUICKSTART, ["train.memory_check=on"]).train.memory_check == "on"


@pytest.mark.parametrize(
    "train, message",
    [
        ({"memory_check": "sometimes"}, "train.memory_check: must be one of 'auto', 'on', 'off'; got 'sometimes'"),
        ({"device_memory": "80 gigs"}, "train.device_memory: cannot read '80 gigs' as a size in bytes .*"
                                       "or null to read it from the device"),
        ({"device_memory": 0}, "train.device_memory: cannot read 0 as a size in bytes"),
        ({"device_memory": [80]}, "train.device_memory: expected str or int or float or null, got list"),
        ({"memory_headroom": 1.0}, "train.memory_headroom: must be >= 0.0 and < 1.0, got 1.0"),
        ({"memory_headroom": -0.1}, "train.memory_headroom: must be >= 0.0 and < 1.0, got -0.1"),
        ({"compilation_cache": ""}, "train.compilation_cache: must be 'auto', 'off' or a directory path"),
        ({"compilation_cache": 3}, "train.compilation_cache: expected str or bool, got int 3"),
    ],
)
def test_train_memory_field_errors(train, message):
    with pytest.raises(JmarlError, match="^" + message):
        make({"preset": {}}, train=train)
