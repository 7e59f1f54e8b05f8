"""BFCL's multi-turn checker's rules (``check``), reimplemented over ``apis`` (BFCL's own
API classes, model calls parsed, never evaluated); proven equal to bfcl-eval's own checker by
``tests/unit/test_bfcl_multi_turn.py``. The rules, as ``gdpo_ray.bfcl.multi_turn_suite`` lists
them: the result's layout (per user turn a list of steps, each a list of call strings), empty
steps dropped, then turn by turn the model's and the ground truth's calls run on their own
states; a turn with ground-truth calls needs a model step, equal public state and every
ground-truth result among the model's results so far (a multiset).

``turn_checks`` scores the same comparisons turn by turn without stopping at the first failure:
the ``bfcl_multi_turn`` environment's partial rewards.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from gdpo_ray.bfcl.apis import ApiState


@dataclasses.dataclass(frozen=True)
class Verdict:
    valid: bool
    reason: str = ""  # BFCL's error_type ("" when valid)
    message: str = ""  # what failed, for a report
    turn: int | None = None  # the turn that failed, where one did


def is_empty_step(step: Any) -> bool:
    """BFCL's empty response: no calls, or one empty call."""
    return len(step) == 0 or (len(step) == 1 and len(step[0]) == 0)


def decoded_turns(result: Sequence[Any]) -> list[list[list[str]]]:
    """Per turn, the steps that count (a list of strings, not empty); other turns have none."""
    return [[step for step in turn if isinstance(step, list) and all(isinstance(c, str) for c in step)
             and not is_empty_step(step)] if isinstance(turn, list) else [] for turn in result]


def check(entry: Mapping[str, Any], ground_truth: Sequence[Sequence[str]], result: Any) -> Verdict:
    """BFCL's verdict on ``result`` (the module docstring's layout) for the item ``entry`` (a
    BFCL prompt entry: id, involved_classes, initial_config) with ``ground_truth``."""
    if not isinstance(result, list):
        return Verdict(False, "multi_turn:inference_error",
                       "the model's result is not a list of turns")
    if len(result) != len(ground_truth):
        return Verdict(False, "multi_turn:force_terminated",
                       f"{len(result)} turns in the result, {len(ground_truth)} in the ground truth")
    return check_turns(entry, ground_truth, decoded_turns(result))


def check_turns(entry: Mapping[str, Any], ground_truth: Sequence[Sequence[str]],
                turns: Sequence[Sequence[Sequence[str]]]) -> Verdict:
    """``multi_turn_checker``'s rules on decoded turns (one per ground-truth turn)."""
    model, gold = ApiState.of(entry), ApiState.of(entry)
    model_results: list[str] = []
    for index, (gold_calls, steps) in enumerate(zip(ground_truth, turns)):
        for step in steps:
            model_results += model.run(step)
        gold_results = gold.run(gold_calls)
        if not gold_calls:
            continue
        if not steps:
            return Verdict(False, "multi_turn:empty_turn_model_response",
                           f"no model response in turn {index}", index)
        difference = state_difference(model, gold)
        if difference:
            return Verdict(False, "multi_turn:instance_state_mismatch",
                           f"turn {index}: {difference}", index)
        missing = missing_results(gold_results, model_results)
        if missing:
            return Verdict(False, "multi_turn:execution_response_mismatch",
                           f"turn {index}: the model's results so far lack {json.dumps(missing)[:300]}", index)
    return Verdict(True)


def state_difference(model: ApiState, gold: ApiState) -> str | None:
    """The first class whose public attributes differ (as BFCL compares them: every public
    attribute of the ground-truth instance against the model's, by ``!=``), or None."""
    for class_name, gold_instance in gold.instances.items():
        model_instance = model.instances[class_name]
        differ = [name for name, value in vars(gold_instance).items() if not name.startswith("_")
                  and (not hasattr(model_instance, name) or getattr(model_instance, name) != value)]
        if differ:
            return f"{class_name}'s {', '.join(differ)} differ from the ground truth's"
    return None


def missing_results(gold_results: Sequence[str], model_results: Sequence[str]) -> list[str]:
    """The ground-truth results not among the model's, as a multiset (each model result
    matches one ground-truth result at most)."""
    left = list(model_results)
    missing = []
    for result in gold_results:
        if result in left:
            left.remove(result)
        else:
            missing.append(result)
    return missing


def turn_checks(entry: Mapping[str, Any], ground_truth: Sequence[Sequence[str]],
                turns: Sequence[Sequence[Sequence[str]]]) -> list[tuple[bool, bool]]:
    """Per ground-truth turn with calls, (state equal, every ground-truth result among the
    model's so far), checked as ``check_turns`` checks them but on every such turn (a turn
    without a model step fails both)."""
    model, gold = ApiState.of(entry), ApiState.of(entry)
    model_results: list[str] = []
    out = []
    for gold_calls, steps in zip(ground_truth, list(turns) + [[]] * (len(ground_truth) - len(turns))):
        for step in steps:
            model_results += model.run(step)
        gold_results = gold.run(gold_calls)
        if gold_calls:
            answered = bool(steps)
            out.append((answered and state_difference(model, gold) is None,
                        answered and not missing_results(gold_results, model_results)))
    return out
