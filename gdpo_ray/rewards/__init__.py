"""Reward functions: the registry, the built-ins of the paper's three tasks, user adapters.

A reward function is called as TRL's GRPOTrainer calls it, with keywords:
``fn(prompts=, completions=, completion_ids=, trainer_state=, **columns) -> list[float | None]``
(None = could not be computed, stored as NaN; see ``adapters`` for chat completions and
functions that name only some keywords). Columns are the dataset row's and the rollout's
(``response_length``, tokens).

``get(name, **params)`` (``registry``) returns a ready function: a built-in by name, a user function by
import path ``package.module:function`` (its params bound as keywords), or a verl-style
``compute_score`` by ``verl:package.module:function``. Built-ins:
``toolrl_format``, ``toolrl_correctness``, ``math_correctness``, ``exact_answer``, ``tool_turn_format``, ``length``, ``regex``,
``code_passrate``, ``code_bug``. ``from_verl`` adapts verl's ``compute_score``.
"""

from __future__ import annotations

from gdpo_ray.rewards.adapters import (CALL_KEYWORDS, ROLLOUT_COLUMNS, RewardFn, RewardInfraError,
                                       TrainerState, call_reward, completion_text, failure_text, from_verl,
                                       required_columns, takes_environments, to_floats)
from gdpo_ray.rewards.registry import REWARDS, get
from gdpo_ray.rewards.spec import Condition, RewardSpec, apply_conditions, check_specs, reward_specs

#: the classes of a failed (row, reward), the prefix of its ``reward_errors`` text
FAILURE_KINDS = ("error", "timeout", "infra", "condition")
#: the prefix of a (row, reward) that does not apply to the row, NaN but not a failure: a column
#: of another environment than the row's (``data.tool_environment`` as a mapping, TRL's dict form)
NOT_APPLICABLE = "n/a"


def failure_kind(error: str) -> str:
    """The class of a ``reward_errors`` text ("" where the reward was computed): error (the
    reward raised), timeout, infra (the scoring infrastructure failed, after retries) or
    condition (the gate of a conditioned reward could not be computed); ``NOT_APPLICABLE`` ("n/a")
    where the reward does not apply to the row, which is no failure."""
    if not error:
        return ""
    kind = error.split(":", 1)[0]
    return kind if kind in FAILURE_KINDS or kind == NOT_APPLICABLE else "error"


__all__ = ["CALL_KEYWORDS", "FAILURE_KINDS", "NOT_APPLICABLE", "REWARDS", "ROLLOUT_COLUMNS", "Condition", "RewardFn",
           "RewardInfraError", "RewardSpec", "TrainerState", "apply_conditions", "call_reward",
           "check_specs", "completion_text", "failure_kind", "failure_text", "from_verl", "get",
           "required_columns", "takes_environments", "to_floats"]
