"""The ``agent`` preset's parts: its environment, task, format reward, eval suite, and the warm
start's trajectories, token for token those the rollout loop builds."""

import json

import numpy as np
import pytest

from actors.turn_loop import run_batched

from gdpo_ray.environments.arithmetic import Arithmetic
from gdpo_ray.environments.spec import load_environment
from gdpo_ray.eval.suite import Completion
from gdpo_ray.models.demo_agent import ENVIRONMENT, RECIPE, call_text, teacher_turns
from gdpo_ray.rewards import get
from gdpo_ray.tasks import tool_arithmetic

CALL = call_text("multiply", 37, 12)


def test_the_environment_computes_and_scores_its_end_state():
    env = Arithmetic()
    assert env.reset(prompt="What is 37 times 12 plus 5?", ground_truth="449") is None
    assert env.multiply(37, 12) == 444 and env.get_rewards() == {"tool_success": 0.0}
    assert env.add(444, 5) == 449 and env.get_rewards() == {"tool_success": 1.0}
    for bad in (3.0, "3", True):
        with pytest.raises(TypeError, match="expected an integer"):
            env.add(bad, 1)
    env.reset(ground_truth="2")
    assert env.results == [] and env.get_rewards() == {"tool_success": 0.0}
    spec = load_environment(ENVIRONMENT)
    assert spec.tools == ("add", "multiply") and spec.reward_getter == "get_rewards"
    assert spec.schemas[1]["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "The first integer."},
        "b": {"type": "integer", "description": "The second integer."}}


def test_the_task_rows_and_their_gold_calls():
    rows = tool_arithmetic(300, 0)
    assert len({r["id"] for r in rows}) == 300
    kinds = set()
    for r in rows:
        steps, value = json.loads(r["steps"]), None
        for tool, a, b in steps:
            a = value if a is None else a
            value = a * b if tool == "multiply" else a + b
        assert str(value) == r["ground_truth"]
        question = r["prompt"][0]["content"]
        kinds.add((len(steps), steps[0][0]))
        assert question.startswith(f"What is {steps[0][1]} ") and question.endswith(f"{steps[-1][2]}?")
    assert kinds == {(1, "multiply"), (1, "add"), (2, "multiply")}
    assert tool_arithmetic(4, 0) == rows[:4] and tool_arithmetic(4, 1) != rows[:4]


@pytest.mark.parametrize("completion, expected", [
    ([{"role": "assistant", "content": CALL}, {"role": "tool", "name": "multiply", "content": "444"},
      {"role": "assistant", "content": "<answer>444</answer>"}], 1.0),
    ("<answer>444</answer>", 1.0),  # no call: still well formed (tool_success and answer judge it)
    ([{"role": "assistant", "content": CALL}, {"role": "tool", "content": "444"},
      {"role": "assistant", "content": "The answer is 444."}], 0.0),  # the answer without tags
    ([{"role": "assistant", "content": "Let me call. " + CALL}, {"role": "tool", "content": "444"},
      {"role": "assistant", "content": "<answer>444</answer>"}], 0.0),  # text beside the call
    ([{"role": "assistant", "content": "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}\n</tool_call>"},
      {"role": "tool", "content": "error"}, {"role": "assistant", "content": "<answer>1</answer>"}], 0.0),  # bad JSON
    ([{"role": "assistant", "content": CALL}], 0.0),  # ended on a call (max_turns)
    ([{"role": "assistant", "content": "<answer>444</answer> and more"}], 0.0),
    ([], 0.0),
])
def test_tool_turn_format(completion, expected):
    assert get("tool_turn_format")([None], [completion]) == [expected]


def test_tool_turn_format_over_several_user_turns():
    """An environment with several user turns (``next_message``): each user turn's calls, then
    its reply; ``answer_tag: null`` takes any reply without a call."""
    fmt, tagged = get("tool_turn_format", answer_tag=None), get("tool_turn_format")
    tool = {"role": "tool", "content": "ok"}
    conversation = [{"role": "assistant", "content": CALL}, tool, {"role": "assistant", "content": "Moved it."},
                    {"role": "user", "content": "Now sort it."}, {"role": "assistant", "content": CALL}, tool,
                    {"role": "assistant", "content": "Sorted."}]
    assert fmt([None], [conversation]) == [1.0] and tagged([None], [conversation]) == [0.0]
    calls_in_reply = conversation[:2] + [{"role": "assistant", "content": "Moved. " + CALL}] + conversation[3:]
    assert fmt([None], [calls_in_reply]) == [0.0]
    assert fmt([None], [conversation[:4]]) == [0.0]  # the last user turn has no reply


def test_the_teacher_slips_at_its_rates_and_is_right_when_clean():
    rng = np.random.default_rng(0)
    steps = [["multiply", 37, 12], ["add", None, 5]]
    assert teacher_turns(steps, rng, 1.0, 1.0, 1.0) == [
        (CALL, ("multiply", "444")), (call_text("add", 444, 5), ("add", "449")), ("<answer>449</answer>", None)]
    draws = [teacher_turns(steps, rng, RECIPE["p_call"], RECIPE["p_tool"], RECIPE["p_format"]) for _ in range(4000)]
    called = [d for d in draws if len(d) > 1]
    assert abs(len(called) / 4000 - RECIPE["p_call"]) < 0.03
    assert all(d == [("<answer>37</answer>", None)] or d == [("The answer is 37.", None)]
               for d in draws if len(d) == 1)  # no call: the first number
    right_tool = np.mean([d[0][1][0] == "multiply" for d in called])
    assert abs(right_tool - RECIPE["p_tool"]) < 0.03
    assert abs(np.mean([d[-1][0].startswith("<answer>") for d in draws]) - RECIPE["p_format"]) < 0.03
    # a wrong first tool is carried on: 37 + 12 = 49, then the second call on 49
    assert any(d[0] == (call_text("add", 37, 12), ("add", "49")) and d[1][0] in (
        call_text("add", 49, 5), call_text("multiply", 49, 5)) for d in called)


def test_the_warm_start_trains_on_the_tokens_the_rollout_loop_builds(tmp_path):
    """The teacher's turns replayed through the real loop (the environment's tools answer them)
    give exactly the warm start's example: prompt, turns, tool turns and the loss mask."""
    from actors.engines import SamplingParams
    from actors.tool_loop import ToolEnvironment, with_observation
    from gdpo_ray.environments.tool_turns import ToolTurns
    from gdpo_ray.models.demo_agent import build_untrained, prompt_ids, trajectory_example
    from tests.unit.scripted_engine import ScriptedEngine

    rows, schemas = build_untrained(tmp_path, RECIPE | {"rows": 32})
    row = next(r for r in rows if len(json.loads(r["steps"])) == 2)
    turns = teacher_turns(json.loads(row["steps"]), np.random.default_rng(0), 1.0, 1.0, 1.0)
    engine = ScriptedEngine(tmp_path, script=[text for text, _ in turns])
    tools = ToolEnvironment(ENVIRONMENT, engine.tokenizer, 4, 5)
    (trajectory, observation), = tools.start([row])
    ids = prompt_ids(engine.tokenizer, with_observation(row["prompt"], observation), schemas)
    run_batched(engine, tools, [ids], [trajectory], SamplingParams(max_tokens=200))
    prompt, target, mask = trajectory_example(ids, turns, engine.tokenizer, ToolTurns(engine.tokenizer))
    assert prompt == ids and trajectory.tokens == target and trajectory.mask == mask
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == [a for _, (_, a) in turns[:2]]
    assert tools.rewards([trajectory], ["tool_success"]) == {"tool_success": ([1.0], [""], [""])}
    assert get("tool_turn_format")([None], [trajectory.messages]) == [1.0]
    assert "You can call: add(a, b), multiply(a, b)." in engine.tokenizer.decode(ids)
    tools.close()


def test_the_eval_suite_scores_conversations_and_texts():
    from gdpo_ray.eval.suites import make_suite

    suite = make_suite("task:tool_arithmetic")
    item = suite.items()[0]
    assert suite.environment == ENVIRONMENT and len(suite.items()) == 128
    right = [{"role": "assistant", "content": "<tool_call>x</tool_call>"},
             {"role": "tool", "name": "add", "content": item.reference},
             {"role": "assistant", "content": f"<answer>{item.reference}</answer>"}]
    guessed = [{"role": "assistant", "content": f"<answer>{item.reference}</answer>"}]
    scores = suite.score(item, [Completion("", 3, "stop", right), Completion("", 1, "stop", guessed),
                                Completion(f"<answer>{item.reference}</answer>")])
    assert scores[0] == {"accuracy": 1.0, "format_ratio": 0.0, "tool_success": 1.0}  # "x" is no call
    assert scores[1] == {"accuracy": 1.0, "format_ratio": 1.0, "tool_success": 0.0}
    assert scores[2]["accuracy"] == 1.0 and np.isnan(scores[2]["tool_success"])
