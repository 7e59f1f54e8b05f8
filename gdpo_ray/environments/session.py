"""One rollout's environment instance: its tool calls, its next user messages, its rewards, each
answered whatever the environment's code does. It runs in the process that owns the instance
(``gdpo_ray.environments.process``), which the rollout actor kills when a call runs past
``generation.tool_timeout``: no time limit is kept here.

- a call that parsed badly, names no tool, or whose arguments the method does not take is
  answered with the reason (kind ``error``), and the method is not called;
- a method that raises anything (``SystemExit`` included: it is the tool's, not the run's) is
  answered with the exception's type and text (kind ``error``);
- the answer is the method's return value as text (``str``; None is ""), converted here, so a
  value whose text cannot be made (an int of more than 4,300 digits) is the tool's error, and one
  longer than ``MAX_ANSWER_CHARS`` is cut, saying so; an ``async`` method runs to its end.

An environment whose tools are per rollout (``spec.EnvironmentSpec.dynamic``) gets every call as
``call_tool(name, arguments)`` and reports unknown tools itself; ``schemas()`` reads its
``tool_schemas()``. One with several user turns answers ``next_message()`` (``next_message``:
its text, or None when the conversation is over or the method failed, with the failure).

Rewards: ``get_rewards()`` (a dict, several columns, or NeMo-Gym's ``reward_components`` shape)
or ``get_reward()`` (one value), given the rollout's messages where they take ``completion``; an
exception or a value that is not a number makes the rollout's environment rewards NaN with the
error text, and the run goes on. The names given are reported to the owner, whose schema check
(``gdpo_ray.environments.columns``) stops the run where they differ from the declared columns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
from typing import Any, Callable, Sequence

from gdpo_ray.environments.columns import given
from gdpo_ray.rewards import NOT_APPLICABLE, failure_text
from gdpo_ray.tool_format import ToolCall, ToolCallError

#: characters of an error text kept
ERROR_CHARS = 500
#: characters of a tool's answer kept (the rest is cut, and the model told how much)
MAX_ANSWER_CHARS = 100_000


@dataclasses.dataclass(frozen=True)
class ToolAnswer:
    text: str  # what the model reads in the tool turn
    kind: str | None = None  # None: the tool answered; "error"; "timeout"


def run(fn: Callable[[], Any]) -> Any:
    """``fn()``'s value (an ``async`` method's run to its end)."""
    value = fn()
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def as_text(value: Any) -> str:
    """A tool's value as the model reads it (raises what ``str`` raises)."""
    text = "" if value is None else str(value)
    if not isinstance(text, str):  # a __str__ returning another type raises in str() already
        raise TypeError(f"the value's text is a {type(text).__name__}")
    if len(text) > MAX_ANSWER_CHARS:
        return text[:MAX_ANSWER_CHARS] + f"... [cut: {len(text) - MAX_ANSWER_CHARS} more characters]"
    return text


class ToolSession:
    """``instance`` (an environment object) for one rollout; ``tools``: its tool names
    (``dynamic``: none, every call goes to its ``call_tool``)."""

    def __init__(self, instance: Any, tools: Sequence[str], dynamic: bool = False) -> None:
        self.instance, self.tools, self.dynamic = instance, frozenset(tools), dynamic
        self.converses = callable(getattr(instance, "next_message", None))

    def reset(self, row: dict[str, Any]) -> str | None:
        """``instance.reset(**row)``: None, or text for the last user message. Raises the
        environment's own exception (any: the caller names it)."""
        value = run(lambda: self.instance.reset(**row))
        return None if value is None else as_text(value)

    def schemas(self) -> list[dict]:
        """``instance.tool_schemas()`` (dynamic tools, after ``reset``), checked: a list of dicts."""
        value = run(self.instance.tool_schemas)
        if not isinstance(value, (list, tuple)) or not all(isinstance(d, dict) for d in value):
            raise TypeError(f"tool_schemas() returned {type(value).__name__}, not a list of JSON schemas (dicts)")
        return list(value)

    def next_message(self) -> tuple[str | None, str | None]:
        """(the next user message or None, the failure of ``next_message`` or None)."""
        try:
            value = run(self.instance.next_message)
            return (None if value is None else as_text(value)), None
        except BaseException as err:  # noqa: BLE001 - the conversation ends; the failure is counted
            return None, f"next_message raised {failure_text(err)}"

    def call(self, call: ToolCall | ToolCallError) -> ToolAnswer:
        if isinstance(call, ToolCallError):
            return ToolAnswer(f"Error: {call.error}", "error")
        if self.dynamic:
            return self._run(lambda: self.instance.call_tool(call.name, dict(call.arguments)))
        if call.name not in self.tools:
            return ToolAnswer(f"Error: there is no tool {call.name!r}; the tools are "
                              f"{', '.join(sorted(self.tools))}", "error")
        method = getattr(self.instance, call.name)
        try:
            inspect.signature(method).bind(**call.arguments)
        except TypeError as err:
            return ToolAnswer(f"Error: bad arguments for {call.name}: {err}", "error")
        return self._run(lambda: method(**call.arguments))

    @staticmethod
    def _run(fn: Callable[[], Any]) -> ToolAnswer:
        try:
            return ToolAnswer(as_text(run(fn)))
        except BaseException as err:  # noqa: BLE001 - SystemExit too: the tool's failure is the model's to read
            return ToolAnswer(f"Error: {failure_text(err)}", "error")

    def rewards(self, names: Sequence[str], getter: str, partial: str | None = None,
                column: str | None = None, completion: list | None = None, keys: bool = False) -> Any:
        """The environment's reward columns ``names`` from ``instance.<getter>()`` (``get_rewards``:
        a dict with every name, or NeMo-Gym's shape, ``gdpo_ray.environments.columns.given``;
        ``get_reward``: one number for the one name, or for ``column``): per column (value, failure
        kind, error text), the kind "" where computed, else "error" (the value is then NaN). A getter
        with a ``completion`` parameter gets ``completion``: the rollout's messages after the prompt
        (ours). ``partial`` (TRL's dict form: the name of this rollout's class): a column it does not
        give is ``NOT_APPLICABLE``, not an error. ``keys``: -> (columns, the names it gave, sorted;
        None where it gave no dict), for the owner's schema check (``columns.Schema``)."""
        try:
            method = getattr(self.instance, getter)
            takes = _takes_completion(method)
            value = run(lambda: method(completion=list(completion or [])) if takes else method())
            value = {column or names[0]: value} if getter == "get_reward" else given(value)
            if not isinstance(value, dict):
                out = failed(names, "error", f"get_rewards returned {type(value).__name__}, not a dict of "
                                             f"the reward names {list(names)} to numbers")
                return (out, None) if keys else out
            out = [self._value(value, name, getter, partial) for name in names]
            return (out, tuple(sorted(map(str, value)))) if keys else out
        except BaseException as err:  # noqa: BLE001 - recorded as the reward's error
            out = failed(names, "error", f"{getter} raised {failure_text(err)}")
            return (out, None) if keys else out

    @staticmethod
    def _value(value: dict, name: str, getter: str, partial: str | None) -> tuple[float, str, str]:
        v = value.get(name)
        if partial is not None and name not in value:
            return math.nan, NOT_APPLICABLE, f"a rollout of {partial!r}, which gives no {name!r}"
        if isinstance(v, (int, float)) and math.isfinite(v):  # a bool is 0 or 1
            return float(v), "", ""
        return (math.nan, "error", f"{getter} gave {name!r} = {v!r}, not a finite number"[:ERROR_CHARS]
                + ("" if name in value else f" (its keys: {sorted(map(str, value))})"[:ERROR_CHARS]))


def _takes_completion(method: Callable) -> bool:
    try:
        return "completion" in inspect.signature(method).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): called as TRL calls it
        return False


def failed(names: Sequence[str], kind: str, why: str) -> list[tuple[float, str, str]]:
    return [(math.nan, kind, why)] * len(names)
