"""Plain NumPy (float64, loop-based) reference implementations of jmarl.algos, for the tests.

Written independently from the formulas in docs/algorithms.md, without segment operations, so that
the tests compare two different derivations of the same numbers. The group filters' ranking keys
are exact rationals rounded once to float32, the rounding docs/algorithms.md states the tie rule on.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np

CLAMP = 20.0


def members(groups, g):
    return [i for i in range(len(groups)) if groups[i] == g]


def group_std(values, ddof):
    n = len(values)
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / max(n - ddof, 1))


def group_advantages(rewards, groups, num_groups, baseline="mean", normalize="std", ddof=1, eps=1e-6):
    rewards = [float(r) for r in rewards]
    out = np.zeros(len(rewards))
    for g in range(num_groups):
        idx = members(groups, g)
        vals = [rewards[i] for i in idx]
        if len(idx) < 2 or max(vals) == min(vals):
            continue
        std = group_std(vals, ddof)
        for i in idx:
            if baseline == "mean":
                b = sum(vals) / len(vals)
            elif baseline == "max":
                b = max(vals)
            elif baseline == "loo":
                b = (sum(vals) - rewards[i]) / (len(vals) - 1)
            else:
                b = 0.0
            a = rewards[i] - b
            out[i] = a / (std + eps) if normalize == "std" else a
    return out


def f32_round(x: Fraction) -> np.float32:
    """The float32 nearest to the exact rational x (ties to even): one correctly rounded step."""
    guess = np.float32(float(x))  # within one float32 step of the answer (float64 then float32 rounds twice)
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]

    def distance_then_odd(c: np.float32) -> tuple[Fraction, bool]:
        return abs(Fraction(float(c)) - x), int(np.asarray(c).view(np.uint32)) % 2 == 1

    return min(candidates, key=distance_then_odd)


def ranking_keys(rewards, groups, g, ddof):
    """(variance with ddof, mean, population variance / range^2 or 0, all equal?) of group g, exact
    rationals each rounded once to float32 (the rounding the documented tie rule is stated on)."""
    vals = [Fraction(float(rewards[i])) for i in members(groups, g)]
    n = len(vals)
    mean = sum(vals) / n
    square_dev = sum((v - mean) ** 2 for v in vals)
    spread = max(vals) - min(vals)
    range_normalised = square_dev / n / spread**2 if spread else Fraction(0)
    return f32_round(square_dev / max(n - ddof, 1)), f32_round(mean), f32_round(range_normalised), spread == 0


def filter_groups(rewards, groups, num_groups, drop_zero_variance=False, var_frac=0.0, mean_frac=0.0, ddof=1,
                  variance_rank="std"):
    present = [g for g in range(num_groups) if members(groups, g)]
    keys = {g: ranking_keys(rewards, groups, g, ddof) for g in present}
    dropped = set()
    if drop_zero_variance:
        dropped |= {g for g in present if keys[g][3]}
    spread = 2 if variance_rank == "range_normalised" else 0
    for frac, key in ((var_frac, spread), (mean_frac, 1)):
        k = int(math.floor(frac * len(present)))
        ranked = sorted(present, key=lambda g: (keys[g][key], g))  # equal keys: lower id dropped first
        dropped |= set(ranked[:k])
    return np.array([0 <= groups[i] < num_groups and groups[i] not in dropped for i in range(len(groups))])


def top_k_groups(rewards, groups, num_groups, k, ddof=1):
    present = [g for g in range(num_groups) if members(groups, g)]
    variance = {g: ranking_keys(rewards, groups, g, ddof)[0] for g in present}
    chosen = set(sorted(present, key=lambda g: (-variance[g], g))[:k])  # equal keys: lower id kept
    return np.array([groups[i] in chosen for i in range(len(groups))])


def kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    x = min(max(-d, -CLAMP), CLAMP)
    return math.exp(x) - x - 1.0


def aggregate(per_token, mask, aggregation, norm_length=None):
    n, t = mask.shape
    rows = [i for i in range(n) if mask[i].any()]
    num_rows = max(len(rows), 1)
    if aggregation == "token_mean":
        total = sum(per_token[i, j] for i in range(n) for j in range(t) if mask[i, j])
        return total / max(int(mask.sum()), 1)
    if aggregation == "seq_mean_token_mean":
        return sum(sum(per_token[i, j] for j in range(t) if mask[i, j]) / mask[i].sum() for i in rows) / num_rows
    total = sum(per_token[i, j] for i in range(n) for j in range(t) if mask[i, j])
    if aggregation == "seq_mean_token_sum_norm":
        return total / (num_rows * (t if norm_length is None else norm_length))
    return total / num_rows  # seq_sum


def seq_ratio(lp_row, old_row, mask_row):
    diffs = [lp_row[j] - old_row[j] for j in range(len(mask_row)) if mask_row[j]]
    mean = sum(diffs) / len(diffs) if diffs else 0.0
    return math.exp(min(max(mean, -CLAMP), CLAMP))


def policy_loss(lp, old, adv, mask, ratio="token", clip_low=0.2, clip_high=0.2, dual_clip=None,
                aggregation="token_mean", norm_length=None, ref=None, kl_coef=0.0, kl_kind="k3"):
    """Returns (loss, metrics) with metrics pg_loss, clip_fraction, dual_clip_fraction, ratio_mean, approx_kl, ref_kl."""
    lp, old, mask = np.asarray(lp, np.float64), np.asarray(old, np.float64), np.asarray(mask, bool)
    adv = np.asarray(adv, np.float64)
    n, t = mask.shape
    per_token = np.zeros((n, t))
    kls = np.zeros((n, t))
    clipped = dual = ratio_sum = approx = 0.0
    for i in range(n):
        s = seq_ratio(lp[i], old[i], mask[i])
        for j in range(t):
            if not mask[i, j]:
                continue
            a = adv[i, j] if adv.ndim == 2 else adv[i]
            if ratio == "token":
                rho = math.exp(min(max(lp[i, j] - old[i, j], -CLAMP), CLAMP))
            elif ratio in ("sequence", "sequence_token"):
                rho = s
            else:
                rho = 1.0
            ratio_sum += rho
            d = min(max(lp[i, j] - old[i, j], -CLAMP), CLAMP)
            approx += math.exp(d) - 1 - d
            if ratio == "none":
                loss = -rho * a
            else:
                plain = -rho * a
                capped = -min(max(rho, 1 - clip_low), 1 + clip_high) * a
                loss = max(plain, capped)
                was_clipped = capped > plain
                if dual_clip is not None and a < 0 and loss > -dual_clip * a:
                    loss = -dual_clip * a
                    dual += 1
                elif was_clipped:
                    clipped += 1
            per_token[i, j] = loss
            if ref is not None:
                kls[i, j] = kl(lp[i, j], ref[i, j], kl_kind)
    count = max(int(mask.sum()), 1)
    pg = aggregate(per_token, mask, aggregation, norm_length)
    total = pg + (kl_coef * aggregate(kls, mask, aggregation, norm_length) if ref is not None else 0.0)
    metrics = {
        "pg_loss": pg,
        "loss": total,
        "clip_fraction": clipped / count,
        "dual_clip_fraction": dual / count,
        "ratio_mean": ratio_sum / count,
        "approx_kl": approx / count,
        "ref_kl": float(kls[mask].sum()) / count if ref is not None else 0.0,
    }
    return total, metrics


# ------------------------------------------------------------------------------- MAGRPO


def joint_actions(num_agents, num_generations, mode):
    if mode == "aligned":
        return [[g] * num_agents for g in range(num_generations)]
    return [list(c) for c in itertools.product(range(num_generations), repeat=num_agents)]


def completion_returns(joint_returns, joint, num_generations, aggregate_mode):
    n = len(joint[0])
    out = np.zeros((n, num_generations))
    for k in range(n):
        for g in range(num_generations):
            hits = [joint_returns[j] for j in range(len(joint)) if joint[j][k] == g]
            if hits:
                out[k, g] = sum(hits) if aggregate_mode == "sum" else sum(hits) / len(hits)
    return out


def tree_returns(rewards, parent, gamma):
    def ret(j):
        kids = [c for c in range(len(parent)) if parent[c] == j]
        if not kids:
            return rewards[j]
        return rewards[j] + gamma * sum(ret(c) for c in kids) / len(kids)

    return np.array([ret(j) for j in range(len(rewards))])


def returns_to_go(rewards, next_index, gamma):
    def ret(i):
        return rewards[i] + (gamma * ret(next_index[i]) if next_index[i] >= 0 else 0.0)

    return np.array([ret(i) for i in range(len(rewards))])


# ------------------------------------------------------------------------------- HACPO


def omega(p_num, p_den, lo=0.1, hi=10.0):
    if p_den > 0:
        r = p_num / p_den
    else:
        r = hi if p_num > 0 else 1.0
    return min(max(r, lo), hi)


def capability_advantages(rewards, groups, source, cap, learner, num_groups, max_reward=None, ddof=1, eps=1e-6):
    out = np.zeros(len(rewards))
    for g in range(num_groups):
        idx = members(groups, g)
        vals = [float(rewards[i]) for i in idx]
        if len(idx) < 2 or max(vals) == min(vals):
            continue
        mu = sum(omega(cap[learner], cap[source[i]]) * rewards[i] for i in idx) / len(idx)
        top = max(vals) if max_reward is None else max_reward
        if mu > top:
            own = [float(rewards[i]) for i in idx if source[i] == learner]
            mu = sum(own) / len(own) if own else sum(vals) / len(vals)
        sigma = group_std(vals, ddof) + eps
        for i in idx:
            out[i] = (rewards[i] - mu) / sigma
    return out


def hacpo_loss(lp, old, adv, mask, is_cross, source_seq_lp, weight, m, *, delta=0.2, delta_step=0.025,
               alpha=1.0, clip_low=3e-4, clip_high=4e-4, stepwise=True):
    lp, old, mask = np.asarray(lp, np.float64), np.asarray(old, np.float64), np.asarray(mask, bool)
    rows = [i for i in range(mask.shape[0]) if mask[i].any()]
    low = min(1 - delta + m * delta_step, 1.0)
    total = 0.0
    for i in rows:
        toks = [j for j in range(mask.shape[1]) if mask[i, j]]
        if is_cross[i]:
            mean_lp = sum(lp[i, j] for j in toks) / len(toks)
            s = math.exp(min(max(mean_lp - source_seq_lp[i], -CLAMP), CLAMP))
            if stepwise:
                c = min(max(s, low), 1.0)
                total += -(c ** (1 + alpha)) * weight[i] * adv[i]
            else:
                a = weight[i] * adv[i]
                total += max(-s * a, -min(max(s, 1 - clip_low), 1 + clip_high) * a)
        else:
            s = seq_ratio(lp[i], old[i], mask[i])
            total += max(-s * adv[i], -min(max(s, 1 - clip_low), 1 + clip_high) * adv[i])
    return total / max(len(rows), 1)
