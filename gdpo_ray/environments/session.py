"""One rollout's environment: its instance, its tool calls under a time limit, its rewards.

The instance's tools are its public methods (``gdpo_ray.environments.spec``). A call runs on a
daemon thread and is waited for ``timeout_s``:

- a call that parsed badly, names no tool, or whose arguments the method does not take is
  answered with the reason (kind ``error``), and the method is not called;
- a method that raises is answered with the exception's type and text (kind ``error``);
- a method still running after ``timeout_s`` is abandoned (kind ``timeout``): Python cannot stop
  a thread, so the instance's state is unknown from then on, and every later call of the rollout
  is answered that the environment stopped responding (kind ``error``), without calling it;
- the answer is the method's return value as text (``str``; None is ""); an ``async`` method
  runs to its end on the call's thread.

An environment whose tools are per rollout (``spec.EnvironmentSpec.dynamic``) gets every call as
``call_tool(name, arguments)`` and reports unknown tools itself; ``schemas()`` reads its
``tool_schemas()``. One with several user turns answers ``next_message()`` (``next_message``:
its text, or None when the conversation is over or the method failed, with the failure).

Rewards: ``get_rewards()`` (a dict, several columns) or ``get_reward()`` (one value); an
exception, a hang or a value that is not a number makes the rollout's environment rewards NaN
with the error text, and the run goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
from typing import Any, Callable, Sequence

from gdpo_ray.rewards import NOT_APPLICABLE
from gdpo_ray.tool_format import ToolCall, ToolCallError

#: characters of an exception's text sent back to the model
ERROR_CHARS = 500


@dataclasses.dataclass(frozen=True)
class ToolAnswer:
    text: str  # what the model reads in the tool turn
    kind: str | None = None  # None: the tool answered; "error"; "timeout"


class Hung(Exception):
    """A call still running when its time was up (``run_with_timeout``)."""


def run_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()``'s value or exception, on a daemon thread; raises ``Hung`` after ``timeout_s``
    (the thread is abandoned: Python cannot stop it)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            value = fn()
            box["value"] = asyncio.run(value) if inspect.iscoroutine(value) else value  # an async tool
        except BaseException as err:  # noqa: BLE001 - handed to the caller as it is
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True, name="gdpo-tool")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Hung
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:ERROR_CHARS]


class ToolSession:
    """``instance`` (a fresh environment object) for one rollout; ``tools``: its tool names
    (``dynamic``: none, every call goes to its ``call_tool``)."""

    def __init__(self, instance: Any, tools: Sequence[str], timeout_s: float, dynamic: bool = False) -> None:
        self.instance, self.tools, self.timeout_s = instance, frozenset(tools), timeout_s
        self.dynamic = dynamic
        self.converses = callable(getattr(instance, "next_message", None))
        self.hung: str | None = None  # the call that hung, once one has

    def reset(self, row: dict[str, Any]) -> str | None:
        """``instance.reset(**row)``: None, or text for the last user message. Raises the
        environment's own exception, or TimeoutError when it hangs."""
        try:
            value = run_with_timeout(lambda: self.instance.reset(**row), self.timeout_s)
        except Hung:
            self.hung = "reset"
            raise TimeoutError(f"reset did not return within {self.timeout_s:g} s") from None
        return None if value is None else str(value)

    def schemas(self) -> list[dict]:
        """``instance.tool_schemas()`` (dynamic tools, after ``reset``), checked: a list of dicts."""
        value = self._timed("tool_schemas", self.instance.tool_schemas)
        if not isinstance(value, (list, tuple)) or not all(isinstance(d, dict) for d in value):
            raise TypeError(f"tool_schemas() returned {type(value).__name__}, not a list of JSON schemas (dicts)")
        return list(value)

    def next_message(self) -> tuple[str | None, str | None]:
        """(the next user message or None, the failure of ``next_message`` or None)."""
        if self.hung is not None:
            return None, None
        try:
            value = self._timed("next_message", self.instance.next_message)
        except TimeoutError as err:
            return None, str(err)
        except Exception as err:  # noqa: BLE001 - the conversation ends; the failure is counted
            return None, f"next_message raised {_error_text(err)}"
        return (None if value is None else str(value)), None

    def _timed(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return run_with_timeout(fn, self.timeout_s)
        except Hung:
            self.hung = what
            raise TimeoutError(f"{what} did not return within {self.timeout_s:g} s") from None

    def call(self, call: ToolCall | ToolCallError) -> ToolAnswer:
        if isinstance(call, ToolCallError):
            return ToolAnswer(f"Error: {call.error}", "error")
        if self.hung is not None:
            return ToolAnswer(f"Error: the environment stopped responding (its {self.hung} call did "
                              "not return); no tool can be called", "error")
        if self.dynamic:
            return self._run(call.name, lambda: self.instance.call_tool(call.name, dict(call.arguments)))
        if call.name not in self.tools:
            return ToolAnswer(f"Error: there is no tool {call.name!r}; the tools are "
                              f"{', '.join(sorted(self.tools))}", "error")
        method = getattr(self.instance, call.name)
        try:
            inspect.signature(method).bind(**call.arguments)
        except TypeError as err:
            return ToolAnswer(f"Error: bad arguments for {call.name}: {err}", "error")
        return self._run(call.name, lambda: method(**call.arguments))

    def _run(self, name: str, fn: Callable[[], Any]) -> ToolAnswer:
        try:
            value = run_with_timeout(fn, self.timeout_s)
        except Hung:
            self.hung = name
            return ToolAnswer(f"Error: {name} did not return within {self.timeout_s:g} s", "timeout")
        except Exception as err:  # noqa: BLE001 - the tool's failure is the model's to read
            return ToolAnswer(f"Error: {_error_text(err)}", "error")
        return ToolAnswer("" if value is None else str(value))

    def rewards(self, names: Sequence[str], getter: str, partial: str | None = None,
                column: str | None = None) -> list[tuple[float, str, str]]:
        """The environment's reward columns ``names`` from ``instance.<getter>()`` (``get_rewards``:
        a dict with every name; ``get_reward``: one number for the one name, or for ``column``):
        per column (value, failure kind, error text), the kind "" where computed, else "error"
        or "timeout" (the value is then NaN). ``partial`` (TRL's dict form: the name of this
        rollout's class): a column it does not give is ``NOT_APPLICABLE``, not an error."""
        if self.hung is not None:
            return _failed(names, "error", f"the environment stopped responding (its {self.hung} call did not return)")
        try:
            value = run_with_timeout(getattr(self.instance, getter), self.timeout_s)
        except Hung:
            self.hung = getter
            return _failed(names, "timeout", f"{getter} did not return within {self.timeout_s:g} s")
        except Exception as err:  # noqa: BLE001 - recorded as the reward's error
            return _failed(names, "error", f"{getter} raised {_error_text(err)}")
        if getter == "get_reward":
            value = {column or names[0]: value}
        if not isinstance(value, dict):
            return _failed(names, "error", f"get_rewards returned {type(value).__name__}, not a dict of "
                                           f"the reward names {list(names)} to numbers")
        out = []
        for name in names:
            v = value.get(name)
            if partial is not None and name not in value:
                out.append((math.nan, NOT_APPLICABLE, f"a rollout of {partial!r}, which gives no {name!r}"))
            elif isinstance(v, (int, float)) and math.isfinite(v):  # a bool is 0 or 1
                out.append((float(v), "", ""))
            else:
                out.append((math.nan, "error", f"{getter} gave {name!r} = {v!r}, not a finite number"
                            + ("" if name in value else f" (its keys: {sorted(map(str, value))})")))
        return out


def _failed(names: Sequence[str], kind: str, why: str) -> list[tuple[float, str, str]]:
    return [(math.nan, kind, why)] * len(names)
