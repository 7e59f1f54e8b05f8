"""Per-step metrics of a GDPO batch (pure: numpy in, a flat dict of floats out).

Names are namespaced as in the paper's plots: ``rewards/<name>/mean``, ``adv/<name>/std``,
``distinct_advantage_groups``, ``response_length/max``, ``staleness/mean``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gdpo_ray.advantages import AdvantageDetails


def reward_metrics(rewards: np.ndarray, names: Sequence[str]) -> dict[str, float]:
    """rewards: [N, K] (NaN = not computed) -> mean/std over the computed values, failure rate."""
    out = {}
    for k, name in enumerate(names):
        column = rewards[:, k]
        valid = column[~np.isnan(column)]
        out[f"rewards/{name}/mean"] = float(valid.mean()) if valid.size else float("nan")
        out[f"rewards/{name}/std"] = float(valid.std()) if valid.size else float("nan")
        out[f"rewards/{name}/failure_rate"] = float(1 - valid.size / max(1, column.size))
    return out


def advantage_metrics(details: AdvantageDetails, names: Sequence[str], decimals: int = 6) -> dict[str, float]:
    """Spread of each reward's group-normalized advantage, of the final advantage, and the number
    of distinct advantage groups (groups whose sorted final advantages differ at ``decimals``)."""
    out = {}
    per_column = details.reward_advantages
    labels = names if per_column.shape[1] == len(names) else ["total"]
    for k, name in enumerate(labels):
        out[f"adv/{name}/std"] = float(per_column[:, k].std())
    adv = np.asarray(details.advantages, dtype=np.float64)
    out["adv/final/std"] = float(adv.std())
    out["adv/final/mean_abs"] = float(np.abs(adv).mean())
    bounds = np.concatenate(([0], np.cumsum(details.group_sizes)))
    distinct = {tuple(np.round(np.sort(adv[a:b]), decimals)) for a, b in zip(bounds[:-1], bounds[1:])}
    out["distinct_advantage_groups"] = float(len(distinct))
    out["zero_advantage_groups"] = float(details.zero_spread.all(axis=1).sum())
    return out


def length_metrics(lengths: np.ndarray, finish_reasons: Sequence[str]) -> dict[str, float]:
    return {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clip_ratio": float(np.mean([r == "length" for r in finish_reasons]))}


def staleness_metrics(step: int, versions: np.ndarray) -> dict[str, float]:
    """step: the policy version being trained; versions: [B] the version of each group."""
    lag = step - versions
    return {"staleness/mean": float(lag.mean()), "staleness/max": float(lag.max())}
