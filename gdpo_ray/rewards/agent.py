"""``tool_turn_format``: the shape of a multi-turn tool rollout, turn by turn.

A rollout of a tool environment is a conversation (``completions[i]``: the assistant and tool
messages after the prompt, and the user messages of an environment with several user turns). It
is well formed when, for each user turn, every assistant turn but the last is tool calls that
parse (``<tool_call>`` blocks, each call a JSON object with a ``name`` and its ``arguments``:
``gdpo_ray.tool_format.parse_tool_calls``, as the rollout reads them) and nothing else, and the last
is the reply without a call: the final answer in ``<answer>…</answer>`` and nothing else
(``answer_tag``; None: any text without a call): 1, else 0. A plain string completion is one
assistant turn.
"""

from __future__ import annotations

import re
from typing import Any

from gdpo_ray.rewards.adapters import RewardFn
from gdpo_ray.tool_format import OPEN, ToolCallError, only_tool_calls, parse_tool_calls


def tool_turn_format(answer_tag: str | None = "answer") -> RewardFn:
    """1 where, in each user turn, every assistant turn but the last is only tool calls that
    parse and the last is only the answer in ``<answer_tag>`` (None: any text without a call),
    else 0."""
    final = (re.compile(rf"\s*<{answer_tag}>[^<]*</{answer_tag}>\s*") if answer_tag
             else re.compile(rf"(?s)(?!.*{OPEN}).*"))

    def tool_turn_format(prompts, completions, **_columns) -> list[float]:
        return [float(all(_well_formed(turns, final) for turns in _user_turns(c))) for c in completions]

    return tool_turn_format


def _user_turns(completion: Any) -> list[list[str]]:
    """The assistant's messages of each user turn (a new turn at each user message)."""
    if isinstance(completion, str):
        return [[completion]]
    turns: list[list[str]] = [[]]
    for m in completion:
        if isinstance(m, dict) and m.get("role") == "user":
            turns.append([])
        elif isinstance(m, dict) and m.get("role") == "assistant":
            turns[-1].append(m.get("content") or "")
    return turns


def _well_formed(turns: list[str], final: re.Pattern) -> bool:
    if not turns or not final.fullmatch(turns[-1]):
        return False
    for turn in turns[:-1]:
        calls = parse_tool_calls(turn)
        if not only_tool_calls(turn) or not calls or any(isinstance(c, ToolCallError) for c in calls):
            return False
    return True
