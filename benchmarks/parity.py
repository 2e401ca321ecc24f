"""The parity gate: the same safetensors weights, loaded by jmarl and by `transformers`, give the
same logits, token log-probs, GRPO loss and gradients. A benchmark whose gate fails reports
nothing (`check_parity` raises `ParityError`).

The GRPO loss on both sides (jmarl's is `jmarl.algos.policy_loss` with GRPO's defaults; the PyTorch
one below is a minimal re-implementation of the same formula): token ratio
r = exp(clamp(lp - lp_old, -20, 20)) on completion tokens, per-token loss
max(-r A, -clip(r, 0.8, 1.2) A), mean over each row's completion tokens, mean over rows.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.common import PROMPT_LEN


class ParityError(RuntimeError):
    """jmarl and the PyTorch reference disagree beyond tolerance; no figures are reported."""


@dataclass(frozen=True)
class GrpoBatch:
    """One GRPO training batch (host arrays). N rows of T = prompt + completion tokens.

    tokens int32[N, T]; attention_mask bool[N, T] (all real tokens); loss_mask bool[N, T] (the
    completion positions); old_logprobs float32[N, T]; advantages float32[N].
    """

    tokens: np.ndarray
    attention_mask: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    advantages: np.ndarray

    def as_dict(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens, "attention_mask": self.attention_mask, "loss_mask": self.loss_mask,
                "old_logprobs": self.old_logprobs, "advantages": self.advantages}

    def packed(self) -> dict[str, np.ndarray]:
        """The batch as jmarl's learner lays it out (`jmarl.train.packing`): each distinct prompt
        once with its completions after it, [N, C] completion fields (C = T - prompt length here)."""
        from jmarl.train.packing import pack, plain_samples

        return pack([plain_samples(self.as_dict())])[0]


def make_batch(vocab_size: int, rows: int, prompt_len: int, new_tokens: int, *, group_size: int = 8,
               seed: int = 0) -> GrpoBatch:
    """A random batch: `rows / group_size` prompts repeated `group_size` times, random
    completions, group-normalised advantages of random rewards, and behaviour log-probs of a
    slightly different policy (uniform log-prob plus noise), so some ratios clip."""
    rng = np.random.default_rng(seed)
    groups = max(rows // group_size, 1)
    prompts = np.repeat(rng.integers(3, vocab_size, (groups, prompt_len)), rows // groups, axis=0)[:rows]
    completions = rng.integers(3, vocab_size, (rows, new_tokens))
    tokens = np.concatenate([prompts, completions], axis=1).astype(np.int32)
    t = prompt_len + new_tokens
    loss_mask = np.zeros((rows, t), bool)
    loss_mask[:, prompt_len:] = True
    rewards = rng.random(rows).reshape(groups, -1)
    if rewards.shape[1] > 1:
        adv = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-6)
    else:  # group size 1 has no group baseline: the centred rewards
        adv = rewards - rewards.mean()
    old = (-np.log(vocab_size) + 0.3 * rng.standard_normal((rows, t))).astype(np.float32)
    return GrpoBatch(tokens, np.ones((rows, t), bool), loss_mask, old, adv.reshape(-1).astype(np.float32))


# ----------------------------------------------------------------------------------------- PyTorch
def torch_token_logprobs(model, tokens, attention_mask):
    """float32[N, T] log p(tokens[:, t] | tokens[:, :t]) from a HF causal LM; column 0 is 0."""
    import torch

    logits = model(input_ids=tokens, attention_mask=attention_mask, use_cache=False).logits.float()
    picked = torch.gather(logits[:, :-1], -1, tokens[:, 1:, None])[..., 0]
    lp = picked - torch.logsumexp(logits[:, :-1], dim=-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def torch_grpo_loss(logprobs, old_logprobs, advantages, loss_mask, clip_low: float = 0.2, clip_high: float = 0.2):
    """The GRPO loss of the module docstring in PyTorch (same formula as `jmarl.algos.policy_loss` with GRPO's defaults)."""
    import torch

    diff = torch.where(loss_mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(diff.clamp(-20.0, 20.0))
    adv = advantages[:, None]
    per_token = torch.maximum(-ratio * adv, -ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    per_token = torch.where(loss_mask, per_token, torch.zeros_like(per_token))
    per_row = per_token.sum(-1) / loss_mask.sum(-1).clamp(min=1)
    rows = loss_mask.any(-1).sum().clamp(min=1)
    return per_row.sum() / rows


def torch_batch(batch: GrpoBatch) -> dict[str, Any]:
    """The batch as torch tensors (int64 ids, long attention mask, bool loss mask)."""
    import torch

    return {
        "tokens": torch.tensor(batch.tokens, dtype=torch.int64),
        "attention_mask": torch.tensor(batch.attention_mask, dtype=torch.int64),
        "loss_mask": torch.tensor(batch.loss_mask),
        "old_logprobs": torch.tensor(batch.old_logprobs),
        "advantages": torch.tensor(batch.advantages),
    }


def torch_loss_of(model, tb: dict[str, Any]):
    """Scalar GRPO loss of a HF model on a `torch_batch`."""
    lp = torch_token_logprobs(model, tb["tokens"], tb["attention_mask"])
    return torch_grpo_loss(lp, tb["old_logprobs"], tb["advantages"], tb["loss_mask"])


# ------------------------------------------------------------------------------------------- jmarl
def jmarl_loss_fn(config, temperature: float = 1.0):
    """`loss_fn(params, frozen, batch) -> (loss, metrics)` for
    `jmarl.train.step.make_update` over a `GrpoBatch.packed()` batch: what jmarl's trainer
    runs (`jmarl.train.packing.packed_logprobs` and `jmarl.algos.policy_loss`)."""
    from jmarl import algos
    from jmarl.train.packing import packed_logprobs

    cfg = algos.grpo.GRPOConfig()

    def loss_fn(params, frozen, batch):
        lp = packed_logprobs(config, params, batch, temperature)
        return algos.policy_loss(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
                                 clip_low=cfg.clip_low, clip_high=cfg.clip_high, aggregation=cfg.aggregation)

    return loss_fn


def _grads_in_jmarl_layout(torch_model, directory: str):
    """The torch model's `.grad`s as a jmarl params tree (written as a checkpoint, read by load_hf)."""
    import torch

    from jmarl.models import load_hf

    grads = copy.deepcopy(torch_model)
    with torch.no_grad():
        for (name, p), (_, g) in zip(torch_model.named_parameters(), grads.named_parameters()):
            g.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    grads.save_pretrained(directory, safe_serialization=True)
    return load_hf(directory)[1]


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max(|b|), the error relative to the reference's scale."""
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def check_parity(torch_model, config, params, *, rows: int = 4, prompt_len: int = PROMPT_LEN,
                 new_tokens: int = 64, tol: float = 2e-3) -> dict[str, float]:
    """Gate: logits, token log-probs, GRPO loss and every parameter gradient of jmarl (`config`,
    `params` from `load_hf`) and of the torch model agree within `tol` (relative to the
    reference's largest magnitude; fp32). Returns the errors; raises `ParityError` otherwise."""
    import jax
    import jax.numpy as jnp

    from jmarl import models
    from jmarl.train.packing import packed_logprobs

    batch = make_batch(config.vocab_size, rows, prompt_len, new_tokens, group_size=rows, seed=1)
    tb = torch_batch(batch)
    torch_model = copy.deepcopy(torch_model).float().train()
    torch_model.zero_grad()
    logits_t = torch_model(input_ids=tb["tokens"], attention_mask=tb["attention_mask"]).logits.detach().numpy()
    lp_t = torch_token_logprobs(torch_model, tb["tokens"], tb["attention_mask"])
    loss_t = torch_grpo_loss(lp_t, tb["old_logprobs"], tb["advantages"], tb["loss_mask"])
    loss_t.backward()
    with tempfile.TemporaryDirectory() as d:
        grads_t = _grads_in_jmarl_layout(torch_model, d)

    jb = {k: jnp.asarray(v) for k, v in batch.as_dict().items()}
    logits_j = np.asarray(jax.jit(lambda p, b: models.apply(config, p, b["tokens"], b["attention_mask"]))(params, jb))
    lp_j = np.asarray(jax.jit(lambda p, b: models.token_logprobs(config, p, b["tokens"], b["attention_mask"]))(params, jb))
    packed = {k: jnp.asarray(v) for k, v in batch.packed().items()}
    loss_fn = jmarl_loss_fn(config)
    lp_packed = np.asarray(jax.jit(lambda p, b: packed_logprobs(config, p, b))(params, packed))
    (loss_j, _), grads_j = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, None, packed)

    errors = {
        "logits_rel_err": _rel_err(logits_j, logits_t),
        "logprobs_rel_err": max(_rel_err(lp_j, lp_t.detach().numpy()),
                                _rel_err(lp_packed[:, :new_tokens], lp_t.detach().numpy()[:, prompt_len:])),
        "loss_abs_err": abs(float(loss_j) - float(loss_t.detach())),
        "grads_rel_err": max(_rel_err(np.asarray(a), np.asarray(b))
                             for a, b in zip(jax.tree.leaves(grads_j), jax.tree.leaves(grads_t))),
    }
    if jax.tree.structure(grads_j) != jax.tree.structure(grads_t):
        raise ParityError("parity gate failed: jmarl and torch gradients have different parameter trees")
    bad = {k: v for k, v in errors.items() if not np.isfinite(v) or v > tol}
    if bad:
        raise ParityError(f"parity gate failed (tolerance {tol}): {bad}; all errors: {errors}")
    return errors
