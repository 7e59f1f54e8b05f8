"""Per-step metrics of a GDPO batch (pure: numpy in, a flat dict of floats out).

Names are namespaced as in the paper's plots: ``rewards/<name>/mean``, ``adv/<name>/std``,
``distinct_advantage_groups``, ``response_length/max``, ``staleness/mean``.

Why a reward does not move (``signal_metrics``), per reward k of the step's batch:
- ``adv/<name>/share``: reward k's share of the variance of the weighted sum before batch
  normalization, w_k Cov(A_k, S) / Var(S) = sum_ij c_k,ij S_ij / sum_ij S_ij^2 with c_k reward
  k's weighted part of S (``AdvantageDetails.contributions``; S has zero mean in every group).
  The shares sum to 1; a reward that works against the others has a negative share; all 0 when
  no group carries signal.
- ``rewards/<name>/zero_spread_groups``: the fraction of groups in which reward k has zero spread
  (all valid values equal, or fewer than two valid): there it contributes nothing.
- ``rewards/<name>/gate_open``, for a conditioned reward: the fraction of rollouts (with a
  computed gate) whose gate reward reaches the condition's threshold.
- ``adv/cancelled_groups``: the fraction of groups in which a reward of non-zero weight varies
  but the weighted sum has no spread (the rewards cancel: no signal from the group).
``cancelling_pairs`` names the pairs of rewards that cancel in every group where either varies
(the paper's §3.1 erratum case, r2 = 1 - r1 with equal weights): GDPO gets no signal from them.
The step's degeneracy diagnostics built on these (cancelling pairs, no-spread columns, near ties
within a judge's scale, a collapsing share) are ``gdpo_ray.diagnostics``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from gdpo_ray.advantages import AdvantageDetails
from gdpo_ray.normalization import RESIDUE_ULPS


def not_applicable(errors: Sequence[Sequence[str]] | None, shape: tuple[int, int]) -> np.ndarray:
    """[N, K] bool: the (row, reward)s that do not apply to their row (``reward_errors`` texts
    of kind ``NOT_APPLICABLE``: another environment's column), NaN but no failure."""
    from gdpo_ray.rewards import NOT_APPLICABLE, failure_kind

    if errors is None:
        return np.zeros(shape, bool)
    return np.array([[failure_kind(e) == NOT_APPLICABLE for e in row] for row in errors], bool).reshape(shape)


def failed(rewards: np.ndarray, errors: Sequence[Sequence[str]] | None) -> tuple[np.ndarray, np.ndarray]:
    """([N, K] bool: the (row, reward)s that failed, NaN where they apply; [K]: how many rows each
    reward applies to)."""
    missing = not_applicable(errors, rewards.shape)
    return np.isnan(rewards) & ~missing, (~missing).sum(axis=0)


def reward_metrics(rewards: np.ndarray, names: Sequence[str],
                   errors: Sequence[Sequence[str]] | None = None) -> dict[str, float]:
    """rewards: [N, K] (NaN = not computed) -> mean and unbiased std (ddof = 1, as the pool's and
    the advantages') over the computed values, failure rate over the rows a reward applies to
    (``errors``: the ``reward_errors`` texts, which mark those it does not), and with errors the
    number of rows it does not apply to (``not_applicable``)."""
    out = {}
    bad, applicable = failed(rewards, errors)
    for k, name in enumerate(names):
        column = rewards[:, k]
        valid = column[~np.isnan(column)]
        out[f"rewards/{name}/mean"] = float(valid.mean()) if valid.size else float("nan")
        out[f"rewards/{name}/std"] = float(valid.std(ddof=1)) if valid.size > 1 else float("nan")
        out[f"rewards/{name}/failure_rate"] = float(bad[:, k].sum() / applicable[k]) if applicable[k] else 0.0
        if errors is not None:
            out[f"rewards/{name}/not_applicable"] = float(column.size - applicable[k])
    return out


def sampled_reward_metrics(kept: np.ndarray, dropped: np.ndarray, names: Sequence[str]) -> dict[str, float]:
    """Under dynamic sampling, ``rewards/<name>/sampled_mean``: the mean over every rollout the
    step sampled, the dropped groups' (``dropped``, [M, K]; M may be 0) with the trained ones
    (``kept``, [N, K]). ``rewards/<name>/mean`` is the trained batch's, which leaves out the groups
    whose rewards did not vary: a reward every rollout of an item meets, or none does."""
    sampled = np.concatenate([kept, dropped]) if dropped.size else kept
    out = {}
    for k, name in enumerate(names):
        valid = sampled[:, k][~np.isnan(sampled[:, k])]
        out[f"rewards/{name}/sampled_mean"] = float(valid.mean()) if valid.size else float("nan")
    return out


def failure_metrics(errors: Sequence[Sequence[str]], names: Sequence[str]) -> dict[str, float]:
    """errors: [N][K] ``reward_errors`` texts -> per reward, the rollouts it failed on by class:
    ``rewards/<name>/{errors,timeouts,infra_failures}`` (raised, timed out, the scoring
    infrastructure failed after its retries; ``failure_kind``)."""
    from gdpo_ray.rewards import failure_kind

    out = {}
    for k, name in enumerate(names):
        kinds = [failure_kind(row[k]) for row in errors]
        for kind, label in (("error", "errors"), ("timeout", "timeouts"), ("infra", "infra_failures")):
            out[f"rewards/{name}/{label}"] = float(kinds.count(kind))
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
    out["zero_advantage_groups"] = float((details.zero_spread.all(axis=1) | details.cancelled).sum())
    return out


def signal_metrics(rewards: np.ndarray, details: AdvantageDetails, names: Sequence[str],
                   gates: Mapping[str, tuple[int, float]] = {}) -> dict[str, float]:
    """rewards: [N, K] in contiguous groups of ``details.group_sizes``; gates: {conditioned
    reward: (column of its gate, threshold)} (see the module docstring)."""
    shares = variance_shares(details)
    spread_zero = _zero_spread_per_reward(rewards, details.group_sizes)
    out = {"adv/cancelled_groups": float(details.cancelled.mean())}
    for k, name in enumerate(names):
        out[f"adv/{name}/share"] = float(shares[k])
        out[f"rewards/{name}/zero_spread_groups"] = float(spread_zero[:, k].mean())
    for name, (gate, threshold) in gates.items():
        column = rewards[:, gate]
        computed = column[~np.isnan(column)]
        out[f"rewards/{name}/gate_open"] = float((computed >= threshold).mean()) if computed.size else float("nan")
    return out


def variance_shares(details: AdvantageDetails) -> np.ndarray:
    """[K] each reward's share of the variance of S, sum_ij c_k,ij S_ij / sum_ij S_ij^2 (all 0
    when no group carries signal: S is 0 everywhere)."""
    summed = np.asarray(details.summed, np.float64)
    power = float(summed @ summed)
    k = details.contributions.shape[1]
    return details.contributions.T @ summed / power if power > 0 else np.zeros(k)


def group_spread(rewards: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rewards: [N, K] in contiguous groups of ``sizes`` -> ([B, K] computed (non-NaN) values per
    group and reward, [B, K] their spread max - min: NaN where none was computed)."""
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    with np.errstate(invalid="ignore"):
        spread = np.fmax.reduceat(rewards, starts, axis=0) - np.fmin.reduceat(rewards, starts, axis=0)
    return np.add.reduceat(~np.isnan(rewards), starts, axis=0), spread


def _zero_spread_per_reward(rewards: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """[B, K] bool: all valid values of the reward in the group equal, or fewer than two valid."""
    count, spread = group_spread(rewards, sizes)
    return (count < 2) | (spread == 0)


def cancelling_pairs(details: AdvantageDetails, names: Sequence[str]) -> list[tuple[str, str]]:
    """Pairs of rewards whose weighted parts of S cancel (|c_k + c_l| within a few float32 ulps
    of their size: the rewards come as float32) in every group where either varies, in at least
    one group."""
    c = np.abs(details.contributions)
    starts = np.concatenate(([0], np.cumsum(details.group_sizes)[:-1]))
    largest = np.maximum.reduceat(c, starts, axis=0)  # [B, K]
    pairs = []
    for k in range(c.shape[1]):
        for m in range(k + 1, c.shape[1]):
            scale = largest[:, k] + largest[:, m]
            varied = scale > 0
            both = np.abs(details.contributions[:, k] + details.contributions[:, m])
            left = np.maximum.reduceat(both, starts)
            cancelled = left <= RESIDUE_ULPS * np.finfo(np.float32).eps * scale
            if varied.any() and cancelled[varied].all():
                pairs.append((names[k], names[m]))
    return pairs


def rollout_metrics(lengths: np.ndarray, finish_reasons: Sequence[str],
                    turns: np.ndarray | None = None) -> dict[str, float]:
    """Response lengths and finish reasons; for multi-turn rollouts (``turns``: [N, 4] of
    ``gdpo_ray.groups.TURN_COUNTS``) the mean turns and tool calls per rollout and the step's
    failed and abandoned tool calls."""
    out = {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
           "response_length/min": float(lengths.min()),
           "response_length/clip_ratio": float(np.mean([r == "length" for r in finish_reasons]))}
    if turns is not None:
        out |= {"rollout/turns/mean": float(turns[:, 0].mean()), "rollout/tool_calls/mean": float(turns[:, 1].mean()),
                "rollout/tool_errors": float(turns[:, 2].sum()), "rollout/tool_timeouts": float(turns[:, 3].sum())}
    return out


def staleness_metrics(step: int, versions: np.ndarray) -> dict[str, float]:
    """step: the policy version being trained; versions: [B] the version of each group."""
    lag = step - versions
    return {"staleness/mean": float(lag.mean()), "staleness/max": float(lag.max())}


def latency_metrics(finished_at: Sequence[float | None], now: float) -> dict[str, float]:
    """Seconds from each group's last token (``finished_at``, wall clock; None: not known) to
    ``now``, the start of the update that trains it: its scoring, its way to the buffer and
    its wait there. Mean and 95th percentile over the step's groups (none known: nothing)."""
    waits = np.array([now - f for f in finished_at if f is not None], dtype=np.float64)
    if not waits.size:
        return {}
    return {"timing/group_latency_mean_s": float(waits.mean()),
            "timing/group_latency_p95_s": float(np.percentile(waits, 95))}


def throughput_metrics(tokens: float, samples: int, step_s: float) -> dict[str, float]:
    """Per second of the step's wall time: response tokens and samples (rollouts) trained."""
    per_s = lambda x: x / step_s if step_s > 0 else float("nan")
    return {"throughput/tokens_per_s": per_s(tokens), "throughput/samples_per_s": per_s(float(samples))}


class timed:
    """``with timed(timers, name):`` stores the block's wall seconds as ``timers[name]``."""

    def __init__(self, timers: dict, name: str) -> None:
        self.timers, self.name = timers, name

    def __enter__(self):
        import time

        self.start = time.perf_counter()

    def __exit__(self, *exc):
        import time

        self.timers[self.name] = time.perf_counter() - self.start
