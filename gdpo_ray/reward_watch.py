"""The rewards of a run watched step by step, so that what silently costs signal is loud.

- Failures (``RewardWatch.check_failures``, before the step's advantages): a failed reward is
  NaN, left out of its group's statistics (DESIGN.md §1), so a reward that fails everywhere would
  silently train on the others. A reward's first error text is logged (then a count each step it
  fails), and the run stops with ``RewardFailure`` when a reward failed on at least ``limit`` of a
  step's rollouts for ``steps`` steps in a row.
- Degeneracy (``RewardWatch.diagnose``, after the step's advantages): the diagnostics of
  ``gdpo_ray.diagnostics`` (cancelling pairs, no-spread columns, near ties within a judge's scale,
  a collapsing share) as metrics every step, and a warning naming the rewards and what to do,
  logged once per pair or reward and kind for the run (the metrics follow it afterwards). The
  share baseline is kept here: the mean share of the first ``SHARE_BASELINE_STEPS`` steps with
  signal since this watch was built (a resumed run starts a new one).
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np

from gdpo_ray import diagnostics
from gdpo_ray.advantages import AdvantageDetails
from gdpo_ray.metrics import failed as step_failures

logger = logging.getLogger(__name__)


class RewardFailure(RuntimeError):
    """A reward failed on (almost) every rollout for several steps: the run stops."""


class RewardWatch:
    """``names``: the K rewards in order; ``limit`` (``training.reward_failure_limit``): the share of
    a step's rollouts at which a step counts as failed; ``steps`` (``reward_failure_steps``): how
    many such steps in a row stop the run; ``scales``: {reward: (lo, hi)} for rewards of known
    scale (a judge's criteria), the only ones with near-tie diagnostics; ``estimator``
    (``training.estimator``): the *_no_std estimators only center, so near ties stay small there
    and are counted but not warned about."""

    def __init__(self, names: Sequence[str], limit: float, steps: int,
                 scales: Mapping[str, tuple[float, float]] = {}, estimator: str = "gdpo") -> None:
        self.names, self.limit, self.steps = list(names), limit, steps
        self.scales = diagnostics.check_scales(scales, self.names)
        self.warn_near_ties = not estimator.endswith("_no_std")
        self.first_errors: dict[str, str] = {}  # reward -> its first error text (logged once)
        self.streaks: dict[str, int] = {}  # reward -> steps in a row at the limit
        self.warned: set[tuple[str, ...]] = set()  # (kind, reward[, reward]) already logged
        self.first_shares: list[np.ndarray] = []  # [K] shares of the first steps with signal
        self.share_baseline: np.ndarray | None = None  # [K] their mean, once there are enough
        self.low_share_streaks = np.zeros(len(self.names), np.int64)  # steps in a row below the ratio

    def check_failures(self, step: int, rewards: np.ndarray, errors: Sequence[Sequence[str]]) -> None:
        """rewards: [N, K] (NaN = not computed); errors: [N][K] error texts ("" = computed). The
        rate is over the rows a reward applies to (not another environment's rows)."""
        from gdpo_ray.rewards import NOT_APPLICABLE, failure_kind

        bad, applicable = step_failures(rewards, errors)
        for k, name in enumerate(self.names):
            failed = [row[k] for row in errors if row[k] and failure_kind(row[k]) != NOT_APPLICABLE]
            rate = float(bad[:, k].sum() / applicable[k]) if applicable[k] else 0.0
            if failed:
                if name not in self.first_errors:
                    self.first_errors[name] = failed[0]
                    logger.warning("reward %r failed on %d of %d rollouts of step %d; first error: "
                                   "%s", name, len(failed), len(errors), step, failed[0])
                else:
                    logger.warning("reward %r failed on %d of %d rollouts of step %d",
                                   name, len(failed), len(errors), step)
            streak = self.streaks.get(name, 0) + 1 if rate >= self.limit else 0
            self.streaks[name] = streak
            if streak >= self.steps:
                first = failed[0] if failed else "NaN values (the function returned None)"
                raise RewardFailure(
                    f"reward {name!r} failed on {rate:.0%} of the rollouts for {streak} steps in "
                    f"a row (reward_failure_limit {self.limit}); its error: {first}. "
                    f"Fix the reward (`gdpo-ray check CONFIG` scores dataset rows with every "
                    f"reward without training), or raise training.reward_failure_limit above 1 "
                    f"to train on anyway")

    def diagnose(self, step: int, rewards: np.ndarray, details: AdvantageDetails) -> dict[str, float]:
        """The step's degeneracy metrics (``gdpo_ray.diagnostics``): ``diag/{cancelling_pairs,
        no_spread_columns,near_tie_columns,collapsed_shares}``, ``rewards/<name>/near_tie_groups``
        (rewards of known scale) and ``adv/<name>/share_ratio``; each kind's warning is logged the
        first time a pair or reward shows it. rewards: [N, K] in contiguous groups of
        ``details.group_sizes``."""
        d = diagnostics.diagnose(rewards, details, self.names, self.scales)
        for a, b in d.cancelling:
            self._once(("cancelling", a, b),
                       "rewards %r and %r cancel in every group of step %d where either varies: their "
                       "weighted, group-normalized advantages sum to 0 (a constant total, e.g. %s = 1 - %s, "
                       "makes one the other's negative; with equal weights S = 0), so GDPO gets no signal "
                       "from the pair. They carry one signal: drop one, or merge them into one reward "
                       "(different weights only leave one reward of weight w_a - w_b). "
                       "diag/cancelling_pairs counts such pairs each step", a, b, step, b, a)
        for name in d.no_spread_columns():
            k = self.names.index(name)
            self._once(("no_spread", name),
                       "reward %r has no spread in %d of the %d groups of step %d where it was computed "
                       "(all its values equal; its mean in the step %.3g): it contributes nothing there. "
                       "At the top of its range (every rollout meets it, learned) harder prompts bring its "
                       "signal back; at the bottom (none does) easier prompts or a partial-credit reward; "
                       "a larger training.group_size makes a varying group likelier either way "
                       "(training.dynamic_sampling drops only the groups where no reward varies). "
                       "rewards/%s/zero_spread_groups follows it", name, d.no_spread_groups[k],
                       d.computed_groups[k], step, d.means[k], name)
        if self.warn_near_ties:
            for name in d.near_tie_columns():
                k, (lo, hi) = self.names.index(name), self.scales[name]
                self._once(("near_tie", name),
                           "reward %r varies by less than %.0f%% of its scale [%g, %g] in %d of the %d "
                           "groups of step %d where it varies: per-group normalization turns these near "
                           "ties (judge noise) into full-size advantages. Use a coarser scale with "
                           "anchored levels, average several judge samples, lower its weight, or use "
                           "training.estimator gdpo_no_std (centering only). "
                           "rewards/%s/near_tie_groups follows it", name, 100 * diagnostics.NEAR_TIE_FRACTION,
                           lo, hi, d.near_tie_groups[name], d.varied_groups[k], step, name)
        return d.metrics() | self._share_ratios(step, d)

    def _share_ratios(self, step: int, d: diagnostics.Diagnosis) -> dict[str, float]:
        """``adv/<name>/share_ratio`` against the baseline (NaN until it exists), and the
        warning of a share that stays under ``SHARE_COLLAPSE_RATIO`` of it."""
        if d.signal and self.share_baseline is None:
            self.first_shares.append(d.shares)
            if len(self.first_shares) == diagnostics.SHARE_BASELINE_STEPS:
                self.share_baseline = np.mean(self.first_shares, axis=0)
        if self.share_baseline is None or not d.signal:  # no ratio: no baseline yet, or no shares this step
            ratios = np.full(len(self.names), np.nan)
        else:
            ratios = diagnostics.share_ratios(d.shares, self.share_baseline)
            low = ratios < diagnostics.SHARE_COLLAPSE_RATIO  # False where NaN
            self.low_share_streaks = np.where(low, self.low_share_streaks + 1, 0)
        collapsed = self.low_share_streaks >= diagnostics.SHARE_COLLAPSE_STEPS
        for k in np.flatnonzero(collapsed):
            name = self.names[k]
            self._once(("share", name),
                       "reward %r carries %.3g of the advantage variance at step %d, under %g of its "
                       "share in the run's first %d steps with signal (%.3g), for %d steps in a row: the "
                       "other rewards now decide the advantages. See rewards/%s/zero_spread_groups (it "
                       "may be learned, or out of reach) and adv/%s/share; raise its weight if it should "
                       "still count. adv/%s/share_ratio follows it", name, d.shares[k], step,
                       diagnostics.SHARE_COLLAPSE_RATIO, diagnostics.SHARE_BASELINE_STEPS,
                       self.share_baseline[k], self.low_share_streaks[k], name, name, name)
        out = {f"adv/{name}/share_ratio": float(r) for name, r in zip(self.names, ratios)}
        out["diag/collapsed_shares"] = float(collapsed.sum())
        return out

    def _once(self, key: tuple[str, ...], message: str, *args) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(message, *args)
