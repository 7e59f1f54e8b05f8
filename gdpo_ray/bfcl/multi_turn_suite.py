"""``bfcl:multi_turn_<base|miss_func|miss_param|long_context>``: BFCL v4's multi-turn categories
(200 items each, as ``bfcl-eval`` 2026.3.23 ships them), scored by BFCL's multi-turn checker's
rules, reimplemented here over ``gdpo_ray.bfcl.apis`` (BFCL's own API classes,
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

Generation (``gdpo-ray eval POLICY --suite bfcl:multi_turn_base``) runs through the tool loop
with the ``bfcl_multi_turn`` environment (``gdpo_ray.bfcl.multi_turn_env``), as BFCL's
function-calling mode runs a model: the item's first turn is the prompt, its tools (BFCL's
function docs) go to the chat template as ``tools=``, each call runs on the item's APIs, each
later turn's message follows the model's answer without a call (a ``miss_func`` turn that adds
functions has BFCL's message "I have updated some more functions you can choose from. What about
now?" and their docs). A generated completion's conversation is read back into the result
layout (``result_of``: per user turn, per assistant message its calls as call strings; a call
that does not parse is not a call), so a generated trajectory and a completions file are scored
by the same checker. ``BFCLMultiTurn.max_turns`` bounds the model turns of a whole conversation
(BFCL stops a turn after 20 steps), the suite's ``max_tokens`` its tokens, and a conversation
stopped before its last turn is ``force_terminated``.

Split: ``multi_turn_base`` trains on some scenarios and holds the rest out
(``gdpo_ray.bfcl.data``: ``is_held_out``, ``HELD_OUT_RULE``; ``task:bfcl_multi_turn``
is the training side); the four categories are variants of the same 200 scenarios (item
``multi_turn_<category>_<n>`` is scenario n), so the split is by scenario number.
``bfcl:multi_turn_base`` evaluates the held-out items only; ``bfcl:<category>:all`` every item,
``bfcl:<category>:held_out`` / ``:train`` one side.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from gdpo_ray.bfcl.apis import call_string, tool_docs
from gdpo_ray.bfcl.data import HELD_OUT_RULE, is_held_out, load_category
from gdpo_ray.bfcl.multi_turn_check import check
from gdpo_ray.bfcl.multi_turn_env import added_functions_message
from gdpo_ray.eval.suite import Completion, EvalItem, Suite
from gdpo_ray.tool_format import ToolCall, parse_tool_calls

CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
SPLITS = ("held_out", "train", "all")


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


def multi_turn_item(entry: Mapping[str, Any], category: str) -> MultiTurnItem:
    tools, added = tool_docs(entry["involved_classes"], entry.get("missed_function"))
    turns = [[dict(m) for m in messages] for messages in entry["question"]]
    for turn in added:
        turns[turn] = [{"role": "user", "content": added_functions_message()}]
    return MultiTurnItem(entry["id"], category, turns, tools, added, entry["ground_truth"], dict(entry))


def result_of(messages: Sequence[Mapping[str, Any]]) -> list[list[list[str]]]:
    """A generated conversation (after the prompt) in BFCL's result layout: a turn per user
    message and one before the first, a step per assistant message, its calls as BFCL's
    function-calling handlers write them (a call that does not parse is left out)."""
    result: list[list[list[str]]] = [[]]
    for m in messages:
        if m.get("role") == "user":
            result.append([])
        elif m.get("role") == "assistant":
            result[-1].append([call_string(c.name, c.arguments) for c in parse_tool_calls(m.get("content") or "")
                               if isinstance(c, ToolCall)])
    return result


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
    max_tokens = 4096  # a whole conversation: every turn's calls, tool answers and replies
    environment = "gdpo_ray.bfcl.multi_turn_env:BfclMultiTurn"
    max_turns = 100

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
        return [EvalItem(it.id, [dict(m) for m in it.turns[0]], it.category, it) for it in self._items]

    def environment_row(self, item: EvalItem) -> dict:
        return {"bfcl_entry": json.dumps(item.reference.entry)}

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, Any]]:
        """Per completion (a generated conversation, ``result_of``; or a file's text: the
        trajectory as JSON, ``completion_text``) ``accuracy`` and BFCL's ``reason`` ("" when
        valid)."""
        ref: MultiTurnItem = item.reference
        out = []
        for c in completions:
            result = result_of(c.messages) if c.messages is not None else trajectory_of(c.text)
            verdict = check(ref.entry, ref.ground_truth, result)
            out.append({"accuracy": float(verdict.valid), "reason": verdict.reason})
        return out
