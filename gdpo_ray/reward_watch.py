"""The rewards of a run watched step by step, so that what silently costs signal is loud.

- Failures (``RewardWatch.check_failures``, before the step's advantages): a failed reward is
  NaN, left out of its group's statistics (DESIGN.md §1), so a reward that fails everywhere would
  silently train on the others. A reward's first error text is logged (then a count each step it
  fails), and the run stops with ``RewardFailure`` when a reward failed on at least ``limit`` of a
  step's rollouts for ``steps`` steps in a row.
- Cancelling rewards (``RewardWatch.warn_cancelling``): two rewards whose weighted,
  group-normalized advantages sum to 0 in every group give GDPO no signal; logged once per pair.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from gdpo_ray.advantages import AdvantageDetails
from gdpo_ray.metrics import cancelling_pairs, failed as step_failures

logger = logging.getLogger(__name__)


class RewardFailure(RuntimeError):
    """A reward failed on (almost) every rollout for several steps: the run stops."""


class RewardWatch:
    """``names``: the K rewards in order; ``limit`` (``training.reward_failure_limit``): the share of
    a step's rollouts at which a step counts as failed; ``steps`` (``reward_failure_steps``): how
    many such steps in a row stop the run."""

    def __init__(self, names: Sequence[str], limit: float, steps: int) -> None:
        self.names, self.limit, self.steps = list(names), limit, steps
        self.first_errors: dict[str, str] = {}  # reward -> its first error text (logged once)
        self.streaks: dict[str, int] = {}  # reward -> steps in a row at the limit
        self.warned_cancelling: set[tuple[str, str]] = set()

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

    def warn_cancelling(self, details: AdvantageDetails) -> None:
        """Once per pair: two rewards that cancel in every group give GDPO no signal."""
        for pair in cancelling_pairs(details, self.names):
            if pair not in self.warned_cancelling:
                self.warned_cancelling.add(pair)
                logger.warning(
                    "rewards %r and %r cancel in every group of this step (their weighted, "
                    "group-normalized advantages sum to 0, e.g. one is 1 - the other with equal "
                    "weights): GDPO gets no signal from them; change a weight or drop one", *pair)
