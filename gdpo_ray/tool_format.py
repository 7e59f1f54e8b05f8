"""The tool-call format: ``<tool_call>…</tool_call>`` blocks, read and written here only.

A model calls a tool by writing a JSON call object inside ``<tool_call>`` and ``</tool_call>``,
in one of two layouts:

- the chat templates' (Qwen2.5, Hermes): one call per block, ``{"name": …, "arguments": {…}}``,
  the JSON on one line or spread over several;
- ToolRL's: one block with a call per line, ``{"name": …, "parameters": {…}}``.

Two readings, for two uses:

- ``parse_tool_calls`` (the rollout's tool loop, the ``tool_turn_format`` reward, the BFCL
  multi-turn suite reading a conversation back): either layout, each call on its own. A call
  that is not a JSON object with a string ``name`` and an object of arguments (``arguments``
  first, else ``parameters``; ``arguments`` may also be a JSON string of one, as some templates
  write it) is a ``ToolCallError`` with the reason, which the rollout sends back to the model as
  the tool's answer; the other calls of the turn still run.
- ``calls_in`` (the ToolRL rewards, the ``tool_calls`` and BFCL suites: an answer judged
  whole): ToolRL's layout, one call object per non-empty line (``parameters`` first, else
  ``arguments``, an object), or a JSON list of call objects (a gold answer); one call that
  does not parse makes the whole answer ``Unparsable``.

The blocks are each opening tag with the first closing tag after it (``tool_call_blocks``).
Model output is hostile input: every scan here is linear in its length (no regex that
backtracks over it), and a call nested deeper than ``MAX_DEPTH`` lists and objects does not
parse (the checkers recurse over a call), never raising an exception of another kind.

Writing: ``tool_call_block`` (calls as one block, a JSON object per line), for the supervised
data, the tasks' gold answers, the demo models' teachers and the system message's example.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Iterable

OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: the deepest nesting of lists and objects a call may have (the call object is level 1, its
#: arguments level 2): deeper, it does not parse
MAX_DEPTH = 100
#: characters of a bad call quoted back in its error
QUOTE = 80
_SPACE = re.compile(r"\s*")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call that did not parse: ``error`` is what the model is told."""

    text: str
    error: str


class Unparsable(ValueError):
    """An answer whose calls are not one JSON call object per line (or a JSON list of them)."""


# --- reading ------------------------------------------------------------------------------------

def tool_call_blocks(text: str) -> list[str]:
    """The contents of the <tool_call>…</tool_call> blocks: each opening tag with the first
    closing tag after it, left to right (``re.findall(r"<tool_call>(.*?)</tool_call>", text,
    re.DOTALL)``, without its quadratic search when closing tags are missing)."""
    out, start = [], text.find(OPEN)
    while start != -1:
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:  # no closing tag after this opening one, so none after any later one
            break
        out.append(text[start + len(OPEN):end])
        start = text.find(OPEN, end + len(CLOSE))
    return out


def only_tool_calls(text: str) -> bool:
    """Whether ``text`` is one or more blocks and nothing else (whitespace around them)."""
    pos, blocks = 0, 0
    while True:
        pos = _SPACE.match(text, pos).end()
        if pos == len(text):
            return blocks > 0
        if not text.startswith(OPEN, pos):
            return False
        end = text.find(CLOSE, pos + len(OPEN))
        if end == -1:
            return False
        pos, blocks = end + len(CLOSE), blocks + 1


def depth_ok(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests lists and dicts at most ``limit`` levels deep (iteratively: it
    may be as deep as the JSON parser allows)."""
    stack = [(value, 1)]
    while stack:
        v, level = stack.pop()
        if isinstance(v, (list, tuple, dict)):
            if level > limit:
                return False
            stack.extend((c, level + 1) for c in (v.values() if isinstance(v, dict) else v))
    return True


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


def calls_in(text_or_calls: Any) -> list[tuple[str, dict]] | None:
    """The (name, arguments) calls of a gold answer or a completion, in ToolRL's layout; None
    when there is no tool-call block. Raises ``Unparsable`` (and nothing else) when a call does
    not parse."""
    if isinstance(text_or_calls, list):
        return _listed_calls(text_or_calls)
    text = str(text_or_calls)
    if OPEN not in text and text.lstrip()[:1] == "[":
        try:
            values = json.loads(text)
        except (ValueError, RecursionError) as err:
            raise Unparsable(f"not a JSON list of calls: {text[:QUOTE]!r}") from err
        return _listed_calls(values)
    blocks = tool_call_blocks(text)
    if not blocks:
        return None
    return [call for block in blocks for call in _lines_of_calls(block)]


_BAD = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's limit
        return _BAD


def _call(value: Any, text: str, toolrl: bool = False) -> ToolCall | ToolCallError:
    """One call object read; ``toolrl``: ToolRL's reading (``parameters`` first, no arguments
    as a JSON string)."""
    quoted = text.strip()[:QUOTE]
    if value is _BAD:
        return ToolCallError(text, f"the tool call is not valid JSON: {quoted!r}")
    if not depth_ok(value):
        return ToolCallError(text, f"the tool call is nested too deeply: {quoted!r}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCallError(text, f'the tool call is not an object with a "name": {quoted!r}')
    first, second = ("parameters", "arguments") if toolrl else ("arguments", "parameters")
    arguments = value.get(first, value.get(second, {}))
    if isinstance(arguments, str) and not toolrl:  # a JSON string of the arguments
        arguments = _loads(arguments) if arguments.strip() else {}
        if not depth_ok(arguments, MAX_DEPTH - 1):
            return ToolCallError(text, f"the tool call is nested too deeply: {quoted!r}")
    if not isinstance(arguments, dict):
        return ToolCallError(text, f'the arguments of {value["name"]!r} are not a JSON object: {quoted!r}')
    return ToolCall(value["name"], arguments)


def _lines_of_calls(block: str) -> list[tuple[str, dict]]:
    """ToolRL's block: one call object per non-empty line."""
    calls = []
    for line in block.splitlines():
        if line.strip():
            call = _call(_loads(line), line, toolrl=True)
            if isinstance(call, ToolCallError):
                raise Unparsable(call.error)
            calls.append((call.name, call.arguments))
    return calls


def _listed_calls(values: list) -> list[tuple[str, dict]]:
    """A JSON list of call objects (a gold answer), read as ToolRL's lines."""
    try:
        lines = [json.dumps(c) for c in values]
    except (TypeError, ValueError, RecursionError) as err:
        raise Unparsable(f"not a list of JSON call objects: {str(values)[:QUOTE]!r}") from err
    return _lines_of_calls("\n".join(lines))


# --- writing ------------------------------------------------------------------------------------

def in_block(text: str) -> str:
    """``text`` between the tags, each on its own line."""
    return f"{OPEN}\n{text}\n{CLOSE}"


def tool_call_block(calls: Iterable[tuple[str, Any]], key: str = "arguments") -> str:
    """The (name, arguments) ``calls`` as one block, a JSON object per line; ``key``
    "arguments" (the chat templates' layout: write one call per block) or "parameters"
    (ToolRL's)."""
    return in_block("\n".join(json.dumps({"name": name, key: arguments}, ensure_ascii=False)
                              for name, arguments in calls))
