"""Tool calls in a model's turn: parsed, never evaluated.

Two layouts, both inside ``<tool_call>…</tool_call>`` blocks (the blocks found as
``gdpo_ray.rewards.toolrl.tool_call_blocks`` finds them, in linear time):

- the chat templates' (Qwen2.5, Hermes): one call per block, ``{"name": …, "arguments": {…}}``,
  the JSON on one line or spread over several;
- ToolRL's: one block with a call per line, ``{"name": …, "parameters": {…}}``.

Each call is parsed on its own: a call that is not a JSON object with a string ``name`` and an
object of arguments (``arguments`` may also be a JSON string of one, as some templates write
it) becomes a ``ToolCallError`` with the reason, which the rollout sends back to the model as the
tool's answer; the other calls of the turn still run.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gdpo_ray.rewards.toolrl import depth_ok, tool_call_blocks

#: characters of a bad call quoted back in its error
QUOTE = 80


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call that did not parse: ``error`` is what the model is told."""

    text: str
    error: str


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """The turn's calls in order (an empty list: the model answered without calling a tool)."""
    out: list[ToolCall | ToolCallError] = []
    for block in tool_call_blocks(text):
        whole = _loads(block)
        if whole is not _BAD:  # one call (any layout of its JSON)
            out.append(_call(whole, block))
            continue
        out += [_call(_loads(line), line) for line in block.splitlines() if line.strip()]
    return out


_BAD = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's limit
        return _BAD


def _call(value: Any, text: str) -> ToolCall | ToolCallError:
    quoted = text.strip()[:QUOTE]
    if value is _BAD:
        return ToolCallError(text, f"the tool call is not valid JSON: {quoted!r}")
    if not depth_ok(value):
        return ToolCallError(text, f"the tool call is nested too deeply: {quoted!r}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCallError(text, f'the tool call is not an object with a "name": {quoted!r}')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # a JSON string of the arguments
        arguments = _loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return ToolCallError(text, f'the arguments of {value["name"]!r} are not a JSON object: {quoted!r}')
    return ToolCall(value["name"], arguments)
