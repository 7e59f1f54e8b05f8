"""``bfcl:multi_turn_<base|miss_func|miss_param|long_context>``: BFCL v4's multi-turn categories
(200 items each, as ``bfcl-eval`` 2026.3.23 ships them), scored by BFCL's multi-turn checker's
rules, reimplemented here over ``gdpo_ray.environments.bfcl_apis`` (BFCL's own API classes,
with model calls parsed, never evaluated). ``tests/unit/test_bfcl_multi_turn.py`` proves every
verdict and reason equal to bfcl-eval's own ``multi_turn_checker`` (``scripts/test-bfcl-checker.sh``).

A model's trajectory is BFCL's result layout: per user turn a list of steps (one model
response each), each step a list of call strings such as ``"cd(folder='document')"``. It is
judged as BFCL's eval runner and ``multi_turn_checker`` judge it (``check``):

1. not a list: ``multi_turn:inference_error``; another number of turns than the ground truth
   (the model was stopped during inference): ``multi_turn:force_terminated``;
2. empty steps are dropped (no calls, or one empty string; a step that is not a list of strings
   does not decode, and is dropped too);
3. turn by turn, every model step of the turn runs on the model's state and the turn's
   ground-truth calls on the ground truth's state (both carry over from turn to turn); then
   - a turn whose ground truth has calls but whose model has no step:
     ``multi_turn:empty_turn_model_response``;
   - a turn whose ground truth is empty (miss_func / miss_param: the request cannot be done yet)
     is not checked: the model's calls there still run and change its state, and calling
     nothing is not required (BFCL's ``multi_turn_irrelevance_checker`` is not used by its runner);
   - state: every public attribute (no leading ``_``) of every ground-truth instance must equal
     (``==``) the model instance's: ``multi_turn:instance_state_mismatch``;
   - response: the turn's ground-truth results must all be among the model's results of all
     turns so far, as a multiset (order free, each result used once):
     ``multi_turn:execution_response_mismatch``;
4. the first failure is the verdict's reason; a trajectory that passes every turn is valid.

Prompt pieces (``MultiTurnItem``) for generation: the user turns (a ``miss_func`` turn that
adds the missed functions has BFCL's message "I have updated some more functions you can choose
from. What about now?"), the tool docs given from the start and those added per turn
(``bfcl_apis.tool_docs``). ``EvalItem.prompt`` is the first turn with the ``tool_calling``
preset's system prompt listing the tools.

Split: ``multi_turn_base`` trains on some scenarios and holds the rest out (``is_held_out``,
``HELD_OUT_RULE``); the four categories are variants of the same 200 scenarios (item
``multi_turn_<category>_<n>`` is scenario n), so the split is by scenario number.
``bfcl:multi_turn_base`` evaluates the held-out items only; ``bfcl:<category>:all`` every item,
``bfcl:<category>:held_out`` / ``:train`` one side.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping, Sequence

from gdpo_ray.environments.bfcl_apis import ApiState, tool_docs
from gdpo_ray.eval.bfcl import load_category
from gdpo_ray.eval.suite import Completion, EvalItem, Suite

CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
SPLITS = ("held_out", "train", "all")
HELD_OUT_FRACTION = 5
HELD_OUT_RULE = ("scenario n (the number ending the item id) is held out when "
                 "int(sha256(f'bfcl-multi-turn-{n}').hexdigest(), 16) % 5 == 0")


def scenario_of(item_id: str) -> int:
    """The scenario number of an item id (``multi_turn_long_context_17`` -> 17)."""
    return int(item_id.rsplit("_", 1)[1])


def is_held_out(item_id: str) -> bool:
    """Whether the item's scenario is held out from training (``HELD_OUT_RULE``: 41 of the
    200 scenarios, in every category)."""
    digest = hashlib.sha256(f"bfcl-multi-turn-{scenario_of(item_id)}".encode()).hexdigest()
    return int(digest, 16) % HELD_OUT_FRACTION == 0


# --- the checker's rules ------------------------------------------------------------------------

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


# --- items and prompts --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MultiTurnItem:
    """What generation and scoring need of one item: ``turns`` (per turn its user messages,
    chat format), ``tools`` (the docs given from the first turn), ``added_tools`` (turn -> the
    docs given from that turn on: miss_func), ``ground_truth`` (per turn the calls) and
    ``entry`` (BFCL's prompt entry: id, involved_classes, initial_config, ...)."""

    id: str
    category: str
    turns: list[list[dict]]
    tools: list[dict]
    added_tools: dict[int, list[dict]]
    ground_truth: list[list[str]]
    entry: dict


def added_functions_message() -> str:
    """BFCL's user message of a turn that adds the missed functions (function calling)."""
    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC

    return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC


def multi_turn_item(entry: Mapping[str, Any], category: str) -> MultiTurnItem:
    tools, added = tool_docs(entry["involved_classes"], entry.get("missed_function"))
    turns = [[dict(m) for m in messages] for messages in entry["question"]]
    for turn in added:
        turns[turn] = [{"role": "user", "content": added_functions_message()}]
    return MultiTurnItem(entry["id"], category, turns, tools, added, entry["ground_truth"], dict(entry))


def prompt_of(item: MultiTurnItem) -> list[dict]:
    """The first turn's chat messages, after a system prompt listing the tools (the
    ``tool_calling`` preset's, as ``gdpo_ray.eval.bfcl`` writes it)."""
    from gdpo_ray.tasks import TOOL_SYSTEM

    system = TOOL_SYSTEM.format(tools="\n".join(json.dumps(d) for d in item.tools))
    messages = [dict(m) for m in item.turns[0]]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = system + "\n\n" + messages[0]["content"]
    else:
        messages.insert(0, {"role": "system", "content": system})
    return messages


def completion_text(result: Sequence[Sequence[Sequence[str]]]) -> str:
    """A trajectory (the module docstring's layout) as the text of a ``Completion``: its JSON."""
    return json.dumps(result)


def trajectory_of(text: str) -> Any:
    """A completion's trajectory: its text as JSON (None when it is not JSON); a line of BFCL's
    own result files (``{"id": ..., "result": [...]}``) gives its ``result``."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value["result"] if isinstance(value, dict) and "result" in value else value


class BFCLMultiTurn(Suite):
    """One multi-turn category (``split``: the items of ``SPLITS``; by default the held-out ones
    of multi_turn_base and every item of the others)."""

    metrics = ("accuracy",)
    max_tokens = 1024

    def __init__(self, category: str, split: str | None = None, length_limit: int | None = None) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown BFCL multi-turn category {category!r}; use one of {', '.join(CATEGORIES)}")
        split = split or ("held_out" if category == "multi_turn_base" else "all")
        if split not in SPLITS:
            raise ValueError(f"bfcl:{category}:{split}: the split must be one of {', '.join(SPLITS)} "
                             f"(held_out: {HELD_OUT_RULE})")
        self.category, self.split = category, split
        default = "held_out" if category == "multi_turn_base" else "all"
        self.name = f"bfcl:{category}" + ("" if split == default else f":{split}")
        if length_limit is not None:
            self.length_limit = length_limit
        keep = {"all": lambda i: True, "held_out": is_held_out, "train": lambda i: not is_held_out(i)}[split]
        self._items = [multi_turn_item(e, category) for e in load_category(category) if keep(e["id"])]

    def all_items(self) -> list[EvalItem]:
        return [EvalItem(it.id, prompt_of(it), it.category, it) for it in self._items]

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, Any]]:
        """Per completion (its text: the trajectory as JSON, ``completion_text``) ``accuracy``
        and BFCL's ``reason`` ("" when valid)."""
        ref: MultiTurnItem = item.reference
        out = []
        for c in completions:
            verdict = check(ref.entry, ref.ground_truth, trajectory_of(c.text))
            out.append({"accuracy": float(verdict.valid), "reason": verdict.reason})
        return out
