"""Tool environments: calls parsed (never evaluated), run under a time limit, their failures
answered to the model and counted, environment rewards with their errors; classes checked
before any actor starts."""

import math

import pytest

from gdpo_ray.environments.session import ToolSession
from gdpo_ray.environments.spec import load_environment, tool_names, with_environment_columns
from gdpo_ray.tool_format import ToolCall, ToolCallError, parse_tool_calls
from tests.unit.trl_style_environments import Calculator, Counter, Sleepy

ENVS = "tests.unit.trl_style_environments"
HERE = "tests.unit.test_environments"


class Graded:
    """Ours beyond TRL: names its columns before any rollout (``reward_columns``, not a tool) and
    scores the conversation it is given (``get_rewards(completion)``)."""

    @classmethod
    def reward_columns(cls):
        return {"answered": 1.0, "brief": 0.25}

    def reset(self, **row):
        pass

    def note(self, text: str) -> str:
        """Notes a text.

        Args:
            text: The text.
        """
        return text

    def get_rewards(self, completion):
        last = completion[-1]["content"] if completion else ""
        return {"answered": float(bool(last)), "brief": float(len(last) < 10)}


class BadColumns(Graded):
    @classmethod
    def reward_columns(cls):
        return {"answered": "high"}


def test_tool_calls_in_the_templates_layout_and_toolrls():
    hermes = ('<tool_call>\n{"name": "add", "arguments": {"value": 2}}\n</tool_call>\n'
              '<tool_call>\n{\n  "name": "recall",\n  "arguments": {}\n}\n</tool_call>')
    assert parse_tool_calls(hermes) == [ToolCall("add", {"value": 2}), ToolCall("recall", {})]
    toolrl = ('<think>x</think>\n<tool_call>\n{"name": "add", "parameters": {"value": 1}}\n'
              '{"name": "divide", "parameters": {"by": 2}}\n</tool_call>')
    assert parse_tool_calls(toolrl) == [ToolCall("add", {"value": 1}), ToolCall("divide", {"by": 2})]
    # arguments as a JSON string (some templates), none at all
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"value\\": 3}"}</tool_call>'
                            '<tool_call>{"name": "recall"}</tool_call>') == [
        ToolCall("add", {"value": 3}), ToolCall("recall", {})]
    assert parse_tool_calls("The answer is 4.") == []
    assert parse_tool_calls("<tool_call>{unclosed") == []  # no closing tag: no block, no call


def test_a_bad_call_is_an_error_for_the_model_and_the_others_still_run():
    calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"value": 1}}\n'
                             'add(value=2)\n[1, 2]\n{"name": "add", "arguments": [1]}\n</tool_call>'
                             '<tool_call>' + "[" * 200 + "]" * 200 + '</tool_call>')
    assert calls[0] == ToolCall("add", {"value": 1})
    assert [type(c) for c in calls[1:]] == [ToolCallError] * 4
    assert [c.error.split(":")[0] for c in calls[1:]] == [
        "the tool call is not valid JSON", 'the tool call is not an object with a "name"',
        "the arguments of 'add' are not a JSON object", "the tool call is nested too deeply"]
    assert "add(value=2)" in calls[1].error  # quoted back


def test_tools_are_the_public_methods_and_their_schemas_are_built(tmp_path):
    spec = load_environment(f"{ENVS}:Calculator")
    assert spec.tools == ("add", "divide", "recall") == tuple(tool_names(Calculator))
    assert spec.reward_getter == "get_rewards"
    add = spec.schemas[0]["function"]
    assert add["name"] == "add" and add["description"] == "Adds a number to the memory."
    assert add["parameters"]["properties"]["value"] == {"type": "number", "description": "The number to add."}
    counter = load_environment(f"{ENVS}:Counter")
    assert counter.reward_getter == "get_reward" and counter.tools == ("bump", "unit")
    assert load_environment(f"{ENVS}:Sleepy").tools == ("nap",)


@pytest.mark.parametrize("name, message", [
    ("NoTools", "has no tool: its public methods"),
    ("NoReset", "has no reset method: add `def reset"),
    ("Undocumented", "the tool 'act' cannot be described to the model"),
    ("NeedsArguments", r"cannot be made with no arguments .* as NeedsArguments\(\)"),
    ("Missing", "has no attribute 'Missing' \\(environment"),
    ("time", "not a class"),
])
def test_a_bad_environment_class_is_refused_with_the_fix(name, message):
    path = f"{ENVS}:{name}" if name != "time" else "time:sleep"
    with pytest.raises(ValueError, match=message):
        load_environment(path)
    with pytest.raises(ValueError, match="must be 'module:Class'"):
        load_environment("Calculator")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module' of environment"):
        load_environment("no_such_module:Env")


def session(cls=Calculator):
    spec = load_environment(f"{ENVS}:{cls.__name__}")
    return ToolSession(spec.new(), spec.tools)


def test_calls_run_on_the_rollouts_own_instance_and_failures_are_answered():
    s, other = session(), session()
    assert s.reset({"target": 3, "prompt": "p"}) == "The memory starts at 0."
    other.reset({"target": 1})
    assert s.call(ToolCall("add", {"value": 6})).text == "memory = 6"
    assert s.call(ToolCall("divide", {"by": 2})) .text == "memory = 3"
    assert other.call(ToolCall("recall", {})).text == "0.0"  # its own instance
    cases = {
        "divide by 0": (ToolCall("divide", {"by": 0}), "Error: ZeroDivisionError: float division by zero"),
        "no such tool": (ToolCall("multiply", {"by": 2}), "Error: there is no tool 'multiply'; the tools are add, divide, recall"),
        "private": (ToolCall("_helper", {}), "Error: there is no tool '_helper'"),
        "reset is no tool": (ToolCall("reset", {}), "Error: there is no tool 'reset'"),
        "unknown argument": (ToolCall("add", {"value": 1, "amount": 1}), "Error: bad arguments for add: got an unexpected keyword argument 'amount'"),
        "missing argument": (ToolCall("add", {}), "Error: bad arguments for add: missing a required argument: 'value'"),
        "unparsed": (ToolCallError("x", "the tool call is not valid JSON: 'x'"), "Error: the tool call is not valid JSON: 'x'"),
    }
    for label, (call, text) in cases.items():
        answer = s.call(call)
        assert answer.text.startswith(text) and answer.kind == "error", label
    assert s.call(ToolCall("recall", {})).text == "3.0"  # nothing above changed the memory
    assert s.rewards(["state", "memory_used"], "get_rewards") == [(1.0, "", ""), (1.0, "", "")]
    assert other.rewards(["state", "memory_used"], "get_rewards") == [(0.0, "", ""), (0.0, "", "")]


def test_environment_rewards_that_fail_are_nan_with_the_reason():
    s = session(Sleepy)
    s.reset({})
    ((value, kind, error),) = s.rewards(["done"], "get_rewards")
    assert math.isnan(value) and (kind, error) == ("error", "get_rewards raised RuntimeError: scoring backend down")
    c = session()
    c.reset({"target": 0})
    state, answer = c.rewards(["state", "answer"], "get_rewards")
    assert state == (1.0, "", "") and math.isnan(answer[0]) and answer[1] == "error"
    assert answer[2] == "get_rewards gave 'answer' = None, not a finite number (its keys: ['memory_used', 'state'])"
    counter = session(Counter)
    counter.reset({})
    counter.call(ToolCall("bump", {}))
    assert counter.call(ToolCall("bump", {})).text == "2"  # async: run to its end
    assert counter.call(ToolCall("unit", {})).text == "items"
    assert counter.rewards(["Counter"], "get_reward") == [(2.0, "", "")]


def test_a_class_that_names_its_columns_gets_them_and_is_given_the_conversation():
    spec = load_environment(f"{HERE}:Graded")
    assert spec.tools == ("note",) and spec.reward_getter == "get_rewards"  # reward_columns is no tool
    assert with_environment_columns([{"name": "brief", "fn": "environment"}], f"{HERE}:Graded") == [
        {"name": "brief", "fn": "environment"}, {"name": "answered", "fn": "environment", "weight": 1.0}]
    with pytest.raises(ValueError, match=r"reward_columns\(\) must map column names to weights \(numbers\); "
                                         r"got 'answered': 'high'"):
        with_environment_columns([], f"{HERE}:BadColumns")
    s = ToolSession(Graded(), spec.tools)
    s.reset({})
    said = [{"role": "assistant", "content": "A long answer, surely."}]
    assert s.rewards(["answered", "brief"], "get_rewards", completion=said) == [(1.0, "", ""), (0.0, "", "")]
    assert s.rewards(["answered", "brief"], "get_rewards") == [(0.0, "", ""), (1.0, "", "")]  # none: []


def test_a_verifiers_environment_without_the_extra_names_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gdpo_ray.environments.verifiers_env", None)  # as without `verifiers`
    with pytest.raises(ValueError, match=r"'verifiers:my-taskset' needs the verifiers package .*pip install "
                                         r"-c constraints/cpu.txt 'gdpo-ray\[verifiers\]'"):
        load_environment("verifiers:my-taskset")
