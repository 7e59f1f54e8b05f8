"""Degeneracy diagnostics of a training step: where the rewards give GDPO less signal than they
seem to (pure numpy: rewards and ``AdvantageDetails`` in, numbers and names out). The state kept
across steps (a share's baseline, the warnings already logged) is ``RewardWatch``'s
(``gdpo_ray/reward_watch.py``); docs/training.md#degeneracy-diagnostics says what to do.

rewards: [N, K] in contiguous groups of ``details.group_sizes`` (as ``signal_metrics``), NaN = not
computed. Per step:

- Cancelling pairs (``Diagnosis.cancelling``; ``diag/cancelling_pairs``, the count): two rewards
  whose weighted, group-normalized parts of S sum to 0 in every group where either varies
  (``gdpo_ray.metrics.cancelling_pairs``). A constant total in each group, r_b = c - r_a, makes
  A_b = -A_a exactly (the same spread, the sign flipped), so equal weights give S = 0.
- No-spread columns (``Diagnosis.no_spread_columns``; ``diag/no_spread_columns``): a reward with
  zero spread (its computed values equal, or only one computed) in more than ``NO_SPREAD_LIMIT``
  of the groups where it was computed; it contributes exactly 0 in those groups. Groups where it
  was not computed at all (another environment's rows, a failure everywhere) are not counted:
  failures are ``RewardWatch.check_failures``'s.
- Near ties (``Diagnosis.near_tie_columns``; ``rewards/<name>/near_tie_groups``, the share of the
  step's groups, and ``diag/near_tie_columns``), for rewards of known scale [lo, hi] (a judge's
  criteria): groups where the reward varies, but by less than ``NEAR_TIE_FRACTION`` (hi - lo).
  Per-group normalization divides by that small std, so two judge scores 7.3 and 7.4 of 10 get the
  advantages (-0.71, 0.71), as 0 and 10 would: the judge's noise becomes full-size signal. A
  reward is named when near ties are more than ``NEAR_TIE_LIMIT`` of the groups where it varies.
- Collapsing share (``share_ratios``; ``adv/<name>/share_ratio``): the reward's share of the
  variance of S (``adv/<name>/share``) over its mean share in the run's first
  ``SHARE_BASELINE_STEPS`` steps with signal; ``RewardWatch`` names it when the ratio stays below
  ``SHARE_COLLAPSE_RATIO`` for ``SHARE_COLLAPSE_STEPS`` steps in a row.

Degenerate cases: a step where no group carries signal (S = 0 everywhere) has all shares 0; it
neither enters a baseline nor counts towards a collapse (``Diagnosis.signal`` is False). A
reward of weight 0 has share 0, so no baseline and no ratio (NaN).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from gdpo_ray.advantages import AdvantageDetails
from gdpo_ray.metrics import cancelling_pairs, group_spread, variance_shares

#: a reward is a no-spread column when it has zero spread in more than this share of the groups
#: where it was computed: then most of the step's groups get nothing from it
NO_SPREAD_LIMIT = 0.5
#: a spread below this fraction of the scale's range (hi - lo) is a near tie: 0.5 on a 0-10 judge
#: scale, under the smallest step (1) of an integer judge's scale
NEAR_TIE_FRACTION = 0.05
#: a reward is a near-tie column when near ties are more than this share of the groups where it
#: varies: most of its advantage in the step is then the judge's noise
NEAR_TIE_LIMIT = 0.5
#: steps with signal whose mean share is a reward's baseline
SHARE_BASELINE_STEPS = 5
#: a baseline share below this has no ratio (NaN): a reward that carried under 5% of the variance
#: from the start cannot collapse much, and dividing by a tiny share is noise
SHARE_BASELINE_MIN = 0.05
#: a share below this fraction of its baseline has collapsed ...
SHARE_COLLAPSE_RATIO = 0.1
#: ... when it stays there this many steps with signal in a row (one step's share is noisy)
SHARE_COLLAPSE_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """One step's degeneracy diagnostics; the arrays are per reward, in the order of ``names``."""

    names: list[str]
    groups: int  # B, the step's groups
    cancelling: list[tuple[str, str]]  # pairs that cancel in every group where either varies
    computed_groups: np.ndarray  # [K] groups with at least one computed value of the reward
    no_spread_groups: np.ndarray  # [K] of those, the groups where it has zero spread
    varied_groups: np.ndarray  # [K] groups where two of its computed values differ
    near_tie_groups: dict[str, int]  # reward of known scale -> varied groups with a spread < NEAR_TIE_FRACTION range
    means: np.ndarray  # [K] mean of the computed values (NaN where none)
    shares: np.ndarray  # [K] share of the variance of S (adv/<name>/share)
    signal: bool  # some group carries signal (S is not 0 everywhere): the shares mean something

    def no_spread_columns(self) -> list[str]:
        """Rewards with zero spread in more than ``NO_SPREAD_LIMIT`` of the groups computing them."""
        return [n for n, none, of in zip(self.names, self.no_spread_groups, self.computed_groups)
                if of and none > NO_SPREAD_LIMIT * of]

    def near_tie_columns(self) -> list[str]:
        """Rewards of known scale whose near ties are more than ``NEAR_TIE_LIMIT`` of the groups
        where they vary."""
        varied = dict(zip(self.names, self.varied_groups))
        return [n for n, ties in self.near_tie_groups.items() if ties and ties > NEAR_TIE_LIMIT * varied[n]]

    def metrics(self) -> dict[str, float]:
        """``diag/{cancelling_pairs,no_spread_columns,near_tie_columns}`` (counts) and, per reward
        of known scale, ``rewards/<name>/near_tie_groups`` (the share of the step's groups)."""
        out = {"diag/cancelling_pairs": float(len(self.cancelling)),
               "diag/no_spread_columns": float(len(self.no_spread_columns())),
               "diag/near_tie_columns": float(len(self.near_tie_columns()))}
        for name, ties in self.near_tie_groups.items():
            out[f"rewards/{name}/near_tie_groups"] = ties / self.groups if self.groups else 0.0
        return out


def check_scales(scales: Mapping[str, tuple[float, float]], names: Sequence[str]) -> dict[str, tuple[float, float]]:
    """The scales as {reward: (lo, hi)} floats; a ValueError names a reward that is not one of
    ``names`` or a scale that is not two numbers lo < hi."""
    out = {}
    for name, scale in scales.items():
        if name not in names:
            raise ValueError(f"a scale is given for reward {name!r}, which is not one of the rewards "
                             f"{list(names)}; give scales only for the run's rewards")
        lo, hi = (float(v) for v in scale)
        if not lo < hi:
            raise ValueError(f"the scale of reward {name!r} is {list(scale)}; a scale is [lo, hi] with "
                             f"lo < hi, e.g. [0, 10]")
        out[name] = (lo, hi)
    return out


def diagnose(rewards: np.ndarray, details: AdvantageDetails, names: Sequence[str],
             scales: Mapping[str, tuple[float, float]] = {}) -> Diagnosis:
    """The step's diagnostics (see the module docstring); ``scales``: {reward: (lo, hi)} for the
    rewards of known scale (a judge's), the others get no near-tie count."""
    names, scales = list(names), check_scales(scales, names)
    rewards = np.asarray(rewards, np.float64)
    count, spread = group_spread(rewards, details.group_sizes)  # [B, K] each
    computed = count > 0
    no_spread = computed & ((count < 2) | (spread == 0))
    varied = (count >= 2) & (spread > 0)
    near = {}
    for k, name in enumerate(names):
        if name not in scales:
            continue
        lo, hi = scales[name]
        near[name] = int((varied[:, k] & (spread[:, k] < NEAR_TIE_FRACTION * (hi - lo))).sum())
    valid = ~np.isnan(rewards)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(valid, rewards, 0.0).sum(axis=0) / valid.sum(axis=0)
    summed = np.asarray(details.summed, np.float64)
    return Diagnosis(names=names, groups=len(details.group_sizes), cancelling=cancelling_pairs(details, names),
                     computed_groups=computed.sum(axis=0), no_spread_groups=no_spread.sum(axis=0),
                     varied_groups=varied.sum(axis=0), near_tie_groups=near, means=means,
                     shares=variance_shares(details), signal=bool(summed @ summed > 0))


def share_ratios(shares: np.ndarray, baseline: np.ndarray) -> np.ndarray:
    """[K] shares / baseline, NaN where the baseline is below ``SHARE_BASELINE_MIN`` (a reward that
    carried little of the variance from the start, or worked against the others)."""
    shares, baseline = np.asarray(shares, np.float64), np.asarray(baseline, np.float64)
    out = np.full(shares.shape, np.nan)
    ok = baseline >= SHARE_BASELINE_MIN
    out[ok] = shares[ok] / baseline[ok]
    return out
