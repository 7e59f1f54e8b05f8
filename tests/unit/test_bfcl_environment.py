"""The ``bfcl_multi_turn`` environment through the real rollout loop: a policy that plays an
item's gold calls (as JSON tool calls, one assistant message per user turn, then a reply) gets
every reward and BFCL's verdict; the eval reads its conversation back into BFCL's result layout
and scores it as the checker does; a policy that goes wrong is scored as the checker scores the
same trajectory."""

import asyncio
import inspect
import json

import pytest

if __import__("importlib").util.find_spec("bfcl_eval") is None:
    pytest.skip("needs bfcl-eval's data: pip install --no-deps bfcl-eval==2026.3.23", allow_module_level=True)

from actors.engines import SamplingParams  # noqa: E402
from actors.tool_loop import ToolEnvironment  # noqa: E402
from actors.turn_loop import run_batched  # noqa: E402
from gdpo_ray.bfcl import multi_turn_suite as mt  # noqa: E402
from gdpo_ray.bfcl.apis import ApiState, parse_call  # noqa: E402
from gdpo_ray.bfcl.multi_turn_check import check  # noqa: E402
from gdpo_ray.bfcl.multi_turn_env import BfclMultiTurn, added_functions_message, schema_of  # noqa: E402
from gdpo_ray.eval.suite import Completion, EvalItem  # noqa: E402
from gdpo_ray.model_files import resolve_model_path  # noqa: E402
from gdpo_ray.models.demo_agent import CHAT_TEMPLATE as TOOLS_TEMPLATE  # noqa: E402
from tests.unit.scripted_engine import ScriptedEngine  # noqa: E402

ENV = "gdpo_ray.bfcl.multi_turn_env:BfclMultiTurn"


def tool_message(entry, calls):
    """The gold calls of a turn as one assistant message of JSON tool calls (positional
    arguments named, as a model writes them)."""
    state, blocks = ApiState.of(entry), []
    for call in calls:
        name, args, kwargs = parse_call(call)
        params = list(inspect.signature(getattr(state._methods[name][1], name)).parameters)
        blocks.append("<tool_call>\n" + json.dumps({"name": name, "arguments": {**dict(zip(params, args)), **kwargs}})
                      + "\n</tool_call>")
    return "\n".join(blocks)


def script_of(entry, turns):
    """Per user turn: its calls' message (where it has calls), then a reply without calls."""
    out = []
    for calls in turns:
        out += ([tool_message(entry, calls)] if calls else []) + ["Done."]
    return out


def play(entry, script, max_turns=100):
    engine = ScriptedEngine(resolve_model_path("tiny"), script=script)
    tools = ToolEnvironment(ENV, engine.tokenizer, max_turns, 30)
    (trajectory, observation), = tools.start([{"prompt": entry["question"][0], "bfcl_entry": json.dumps(entry)}])
    assert observation is None and trajectory.session is not None, trajectory.failed
    text = engine.tokenizer.apply_chat_template(entry["question"][0], add_generation_prompt=True, tokenize=False,
                                                tools=tools.schemas_of(trajectory))
    run_batched(engine, tools, [engine.tokenizer(text, add_special_tokens=False)["input_ids"]], [trajectory],
                SamplingParams(max_tokens=200_000))
    names = ["state", "response", "valid"]
    rewards = {name: column[0][0] for name, column in tools.rewards([trajectory], names).items()}
    tools.close()
    return trajectory, rewards


@pytest.fixture(scope="module")
def suites():
    return {c: mt.BFCLMultiTurn(c, "all") for c in mt.CATEGORIES}


@pytest.mark.parametrize("category", mt.CATEGORIES)
def test_gold_calls_through_the_loop_get_every_reward_and_the_checkers_verdict(category, suites):
    for item in suites[category]._items[:4]:
        entry = item.entry
        trajectory, rewards = play(entry, script_of(entry, entry["ground_truth"]))
        assert rewards == {"state": 1.0, "response": 1.0, "valid": 1.0}, (item.id, rewards)
        user_turns = [m["content"] for m in trajectory.messages if m["role"] == "user"]
        assert len(user_turns) == len(entry["question"]) - 1
        for turn, added in item.added_tools.items():  # miss_func: BFCL's message and the docs
            assert user_turns[turn - 1] == added_functions_message() + "\n" + "\n".join(json.dumps(d) for d in added)
        eval_item = EvalItem(item.id, item.turns[0], category, item)
        completion = Completion("", len(trajectory.tokens), trajectory.finish_reason, trajectory.messages)
        assert suites[category].score(eval_item, [completion]) == [{"accuracy": 1.0, "reason": ""}]
        assert trajectory.tool_errors == 0 and trajectory.turns == len(script_of(entry, entry["ground_truth"]))


def test_a_policy_that_goes_wrong_is_scored_as_the_checker_scores_it(suites):
    item = suites["multi_turn_base"]._items[0]
    entry, gold = item.entry, item.entry["ground_truth"]
    wrong = [list(gold[0]), [], *[list(t) for t in gold[2:]]]  # the second turn answered without its calls
    trajectory, rewards = play(entry, script_of(entry, wrong))
    layout = mt.result_of(trajectory.messages)
    verdict = check(entry, gold, layout)
    assert not verdict.valid and verdict.reason == "multi_turn:empty_turn_model_response" and verdict.turn == 1
    assert rewards["valid"] == 0.0 and 0 < rewards["state"] < 1
    assert suites["multi_turn_base"].score(EvalItem(item.id, [], "multi_turn_base", item), [
        Completion("", 0, "stop", trajectory.messages)]) == [{"accuracy": 0.0, "reason": verdict.reason}]
    # stopped before its last turn (max_turns): BFCL's force_terminated
    trajectory, rewards = play(entry, script_of(entry, gold), max_turns=3)
    assert check(entry, gold, mt.result_of(trajectory.messages)).reason == "multi_turn:force_terminated"
    assert rewards["valid"] == 0.0


def test_the_environment_on_its_own():
    entry = mt.BFCLMultiTurn("multi_turn_base", "all")._items[0].entry
    env = BfclMultiTurn()
    with pytest.raises(ValueError, match="needs a 'bfcl_entry' column"):
        env.reset(prompt="x")
    env.reset(prompt="x", bfcl_entry=entry)  # a mapping is taken as it is
    names = [s["function"]["name"] for s in env.tool_schemas()]
    assert "cd" in names and "post_tweet" in names
    assert all(s["function"]["parameters"]["type"] == "object" for s in env.tool_schemas())
    assert schema_of({"name": "f", "parameters": {"type": "dict", "properties": {}}})["function"]["parameters"] == {
        "type": "object", "properties": {}}
    assert env.call_tool("cd", {"folder": "document"}) == '{"current_working_directory": "document"}'
    assert env.call_tool("no_such_tool", {}).startswith("Error during execution:")
    # a JSON argument is a value, never code: the folder is named "__import__('os')"
    assert env.call_tool("cd", {"folder": "__import__('os')"}) == \
        '{"error": "cd: \'__import__(\'os\')\': No such file or directory"}'
    assert env.result == [[["cd(folder='document')"], ["no_such_tool()"], ["cd(folder=\"__import__('os')\")"]]]
    assert env.next_message() == entry["question"][1][0]["content"]
    for _ in entry["question"][2:]:
        env.next_message()
    assert env.next_message() is None


def test_the_training_rows_are_the_scenarios_eval_does_not_hold_out():
    from gdpo_ray.bfcl.data import is_held_out
    from gdpo_ray.tasks import task_rows

    rows = task_rows("task:bfcl_multi_turn")
    entries = [json.loads(r["bfcl_entry"]) for r in rows]
    assert len(rows) == 159 and len({e["id"] for e in entries}) == 159
    assert not any(is_held_out(e["id"]) for e in entries) and all(e["ground_truth"] for e in entries)
    assert all(r["prompt"] == e["question"][0] for r, e in zip(rows, entries))
    assert [r["id"] for r in task_rows("task:bfcl_multi_turn", 161)][159:] == [f"{entries[0]['id']}-1",
                                                                                f"{entries[1]['id']}-1"]


def test_eval_generation_through_a_rollout_actor_reads_the_conversation_back(suites):
    """``RolloutActor.complete`` with the suite's environment, its rows and per-rollout tools:
    the gold policy's conversation scores 1, as BFCL's checker scores it."""
    from actors.rollout import RolloutActor

    suite = suites["multi_turn_miss_func"]
    item = next(it for it in suite.items() if it.reference.added_tools)
    entry = item.reference.entry
    actor = RolloutActor(str(resolve_model_path("tiny")), rewards=None, group_size=2,
                         engine="tests.unit.scripted_engine:ScriptedEngine",
                         engine_kwargs={"script": script_of(entry, entry["ground_truth"])},
                         environment=suite.environment, max_turns=suite.max_turns, max_prompt_tokens=100_000,
                         tools_in_system_prompt="never")
    # the tiny model's ChatML template ignores tools: one that lists them, so the check below sees them
    actor.tokenizer.chat_template = TOOLS_TEMPLATE
    try:
        (done,) = asyncio.run(actor.complete([item.prompt], 1, {"max_tokens": 200_000}, rows=[suite.environment_row(item)]))[0]
        text, tokens, reason, messages = done.text, done.tokens, done.finish_reason, done.messages
        contexts = actor.engine.contexts
    finally:
        asyncio.run(actor.shutdown())
    assert reason == "stop" and tokens > 0 and "<tool_call>" in text
    assert suite.score(item, [Completion(text, tokens, reason, messages)]) == [{"accuracy": 1.0, "reason": ""}]
    schemas = [schema_of(d) for d in item.reference.tools]
    tools = actor.tokenizer.apply_chat_template(item.prompt, add_generation_prompt=True, tokenize=False, tools=schemas)
    assert schemas and all(s["function"]["name"] in tools for s in schemas)  # the rollout's tools, listed
    assert contexts[0] == actor.tokenizer(tools, add_special_tokens=False)["input_ids"]


class OnlyCallTool:
    def reset(self, **row):
        pass

    def call_tool(self, name, arguments):
        return ""


class CallToolAndMethods(OnlyCallTool):
    def tool_schemas(self):
        return []

    def lookup(self, key: str) -> str:
        """Looks a key up.

        Args:
            key: The key.
        """
        return key


@pytest.mark.parametrize("name, message", [
    ("OnlyCallTool", "defines only one of call_tool and tool_schemas"),
    ("CallToolAndMethods", r"has call_tool and tool methods \(lookup\)"),
])
def test_an_environment_with_tools_per_row_is_checked(name, message):
    from gdpo_ray.environments.spec import load_environment

    with pytest.raises(ValueError, match=message):
        load_environment(f"tests.unit.test_bfcl_environment:{name}")
    spec = load_environment(ENV)
    assert spec.dynamic and spec.converses and spec.tools == () and spec.schemas == ()
