"""``BfclMultiTurn``: BFCL's multi-turn items as a tool environment, for training and evaluation.

Each rollout is one BFCL item (its ``bfcl_entry``: the prompt entry with ``ground_truth``, a JSON
string in a dataset row, ``task:bfcl_multi_turn``): the tools are the methods of the item's
involved classes (BFCL's own executable APIs, from its initial configuration, ``apis``),
described by BFCL's function docs (``tool_schemas``); a call runs as BFCL runs it, written as
BFCL's function-calling handlers write it (``call_string``), parsed, never evaluated. The
conversation has the item's user turns: when the model answers without a call, the next turn's
message follows (``next_message``; a ``miss_func`` turn that adds functions gives BFCL's message
and the added functions' docs, one JSON per line, since the tools the prompt listed cannot
change mid-conversation), until the last turn is answered.

Rewards (``get_rewards``), against the gold trajectory, as BFCL's checker compares
(``multi_turn_check``): ``state`` and ``response``, the shares of the item's turns with ground-truth
calls whose state check and whose response check pass (every such turn checked, so a
trajectory that goes wrong late keeps the credit of its first turns), and ``valid``, BFCL's
verdict on the whole trajectory (1 or 0: the eval's accuracy). The calls of each user turn are
kept in BFCL's result layout (``result``), which the eval scores.
"""

from __future__ import annotations

import json
from typing import Any

from gdpo_ray.bfcl.apis import ApiState, call_string, tool_docs
from gdpo_ray.bfcl.multi_turn_check import check, turn_checks


def added_functions_message() -> str:
    """BFCL's user message of a turn that adds the missed functions (function calling)."""
    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC

    return DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC


def entry_of(row: dict[str, Any]) -> dict[str, Any]:
    """The row's BFCL entry (``bfcl_entry``: a JSON string or a mapping)."""
    entry = row.get("bfcl_entry")
    if isinstance(entry, str):
        entry = json.loads(entry)
    if not isinstance(entry, dict) or "involved_classes" not in entry or "question" not in entry:
        raise ValueError("a bfcl_multi_turn row needs a 'bfcl_entry' column: BFCL's prompt entry with its "
                         "ground_truth (task:bfcl_multi_turn makes such rows)")
    return entry


def schema_of(doc: dict) -> dict:
    """A BFCL function doc as a chat template's tool (JSON schema types: BFCL's "dict" is "object")."""
    return {"type": "function", "function": json.loads(json.dumps(doc).replace('"type": "dict"', '"type": "object"'))}


class BfclMultiTurn:
    """One BFCL multi-turn item per rollout (see the module docstring)."""

    def reset(self, **row: Any) -> None:
        self.entry = entry_of(row)
        self.state = ApiState.of(self.entry)
        self.docs, self.added = tool_docs(self.entry["involved_classes"], self.entry.get("missed_function"))
        self.turn, self.result = 0, [[]]

    def tool_schemas(self) -> list[dict]:
        return [schema_of(d) for d in self.docs]

    def call_tool(self, name: str, arguments: dict) -> str:
        call = call_string(name, arguments)
        self.result[self.turn].append([call])  # one step per call: BFCL's checker flattens a turn's steps
        return self.state.execute(call)

    def next_message(self) -> str | None:
        self.turn += 1
        if self.turn >= len(self.entry["question"]):
            return None
        self.result.append([])
        if self.turn in self.added:
            return added_functions_message() + "\n" + "\n".join(json.dumps(d) for d in self.added[self.turn])
        return "\n".join(m["content"] for m in self.entry["question"][self.turn])

    def get_rewards(self) -> dict[str, float]:
        gold = self.entry["ground_truth"]
        turns = self.result + [[]] * (len(gold) - len(self.result))
        checks = turn_checks(self.entry, gold, turns)
        share = (lambda k: sum(c[k] for c in checks) / len(checks)) if checks else (lambda k: 1.0)
        return {"state": share(0), "response": share(1), "valid": float(check(self.entry, gold, self.result).valid)}
