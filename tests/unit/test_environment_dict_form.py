"""TRL's dict form of ``data.tool_environment``: ``{name: 'module:Class'}``, each row naming its
class in its ``environment`` column. A rollout gets its class's tools and instance; a reward
column that its class does not give does not apply to it (NaN of kind ``n/a``), which is no
failure: not in the failure rate, not toward the stop rule, out of its group's statistics."""

import math

import numpy as np
import pytest

from actors.engines import SamplingParams
from actors.tool_loop import ToolEnvironment
from actors.turn_loop import run_batched
from gdpo_ray.metrics import reward_metrics
from gdpo_ray.model_files import resolve_model_path
from gdpo_ray.reward_watch import RewardWatch
from gdpo_ray.rewards import NOT_APPLICABLE, failure_kind
from tests.unit.scripted_engine import ScriptedEngine

ENVS = "tests.unit.trl_style_environments"
SETTING = {"calc": f"{ENVS}:Calculator", "count": f"{ENVS}:Counter"}
NAMES = ["state", "memory_used", "Counter"]


@pytest.fixture()
def tools():
    from transformers import AutoTokenizer

    env = ToolEnvironment(SETTING, AutoTokenizer.from_pretrained(resolve_model_path("tiny")), 3, 5.0)
    yield env
    env.close()


def test_each_row_gets_its_class_its_tools_and_only_its_columns(tools):
    rows = [{"prompt": "p", "environment": "calc", "target": 0}, {"prompt": "p", "environment": "count"},
            {"prompt": "p", "environment": "search"}]
    (calc, observation), (count, none), (bad, _) = tools.start(rows)
    assert observation == "The memory starts at 0." and none is None
    assert [s["function"]["name"] for s in tools.schemas_of(calc)] == ["add", "divide", "recall"]
    assert [s["function"]["name"] for s in tools.schemas_of(count)] == ["bump", "unit"]
    assert tools.schemas == []  # no tools common to every rollout
    assert bad.failed == ("error", "the row's 'environment' is 'search', not one of data.tool_environment's "
                                   "['calc', 'count']")
    columns = tools.rewards([calc, count, bad], NAMES)
    state, state_kinds, state_errors = columns["state"]
    counter, counter_kinds, counter_errors = columns["Counter"]
    assert state[0] == 1.0 and math.isnan(state[1]) and state_kinds == ["", NOT_APPLICABLE, "error"]
    assert state_errors[1] == "a rollout of 'count', which gives no 'state'"
    assert counter[1] == 0.0 and counter_kinds == [NOT_APPLICABLE, "", "error"]  # the bad row failed
    assert counter_errors[0] == "a rollout of 'calc', which gives no 'Counter'"
    processes = [calc.session.process, count.session.process]
    tools.release([calc, count, bad])
    assert [tools._idle[name] for name in ("calc", "count")] == [[processes[0]], [processes[1]]]
    (again, _), = tools.start([{"prompt": "p", "environment": "count"}])
    assert again.session.process is processes[1] and again.environment == "count"


def test_a_multi_turn_rollout_calls_its_own_classes_tools(tools):
    engine = ScriptedEngine(resolve_model_path("tiny"), script=[
        '<tool_call>\n{"name": "bump", "arguments": {}}\n</tool_call>', "Done."])
    (t, _), = tools.start([{"prompt": "p", "environment": "count"}])
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "p"}], add_generation_prompt=True,
                                                  tokenize=False)
    run_batched(engine, tools, [engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]], [t],
                SamplingParams(max_tokens=500))
    assert t.tool_calls == 1 and t.tool_errors == 0 and t.messages[1]["content"] == "1"
    assert tools.rewards([t], ["Counter"])["Counter"] == ([1.0], [""], [""])


def test_not_applicable_is_no_failure_in_the_metrics_and_the_stop_rule():
    assert failure_kind("n/a: a rollout of 'count', which gives no 'state'") == NOT_APPLICABLE
    rewards = np.array([[1.0, np.nan], [0.0, np.nan], [np.nan, 2.0], [np.nan, np.nan]], np.float32)
    errors = [["", "n/a: x"], ["", "n/a: x"], ["n/a: y", ""], ["n/a: y", "error: it raised"]]
    m = reward_metrics(rewards, ["a", "b"], errors)
    assert m["rewards/a/failure_rate"] == 0.0 and m["rewards/a/not_applicable"] == 2.0
    assert m["rewards/b/failure_rate"] == 0.5 and m["rewards/b/not_applicable"] == 2.0
    assert m["rewards/a/mean"] == 0.5 and m["rewards/b/mean"] == 2.0
    watch = RewardWatch(["a", "b"], limit=0.5, steps=2)
    watch.check_failures(0, rewards, errors)
    assert watch.streaks == {"a": 0, "b": 1}  # b failed on half the rows it applies to
    watch.check_failures(1, rewards[:3], errors[:3])
    assert watch.streaks == {"a": 0, "b": 0}
    # without error texts every NaN counts (the old reading, kept for callers without them)
    assert reward_metrics(rewards, ["a", "b"])["rewards/a/failure_rate"] == 0.5


def test_the_pool_keeps_not_applicable_apart_from_failures():
    from actors.reward import RewardPool

    pool = RewardPool([{"name": "state", "fn": "environment"}, {"name": "Counter", "fn": "environment"},
                       {"name": "gated", "fn": "environment", "condition": {"on": "state", "min": 1}}], num_workers=1)
    try:
        given = {"state": ([1.0, math.nan], ["", NOT_APPLICABLE], ["", "a rollout of 'count', which gives no 'state'"]),
                 "Counter": ([math.nan, 2.0], [NOT_APPLICABLE, ""], ["a rollout of 'calc', which gives no 'Counter'", ""]),
                 "gated": ([0.5, 0.5], ["", ""], ["", ""])}
        out = pool.score(["p", "p"], ["c", "c"], {}, given=given)
    finally:
        pool.close()
    assert out.errors[1][0] == "n/a: a rollout of 'count', which gives no 'state'"
    assert out.errors[1][2] == "n/a: on 'state', which does not apply"  # nor does the reward it gates
    assert out.metrics["rewards/state/failure_rate"] == 0.0 and out.metrics["rewards/gated/failure_rate"] == 0.0
    assert out.metrics["rewards/state/errors"] == 0.0 and out.values[0, 2] == 0.5 and math.isnan(out.values[1, 2])


def test_the_setting_is_checked_before_any_actor_starts(tmp_path):
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.preflight import check_environment_rows
    from actors.prompts import PromptSource

    def config(setting, rewards):
        return GDPOConfig().llm(model_path="tiny").data(prompts="task:addition", tool_environment=setting).training(
            rewards=[{"name": "f", "fn": "length", "params": {"limit": 9}}, *rewards])

    declared = config(SETTING, [{"name": "state", "fn": "environment"},
                                 {"name": "Counter", "fn": "environment", "weight": 2.0}])
    declared.validate()  # declaring the get_reward() column still works, with its weight
    assert [(r["name"], r.get("weight", 1.0)) for r in declared.rewards] == [("f", 1.0), ("state", 1.0), ("Counter", 2.0)]
    added = config(SETTING, [{"name": "state", "fn": "environment"}])
    added.validate()  # as TRL adds it: named after the class, weight 1, after the declared ones
    assert added.rewards[1:] == [{"name": "state", "fn": "environment"}, {"name": "Counter", "fn": "environment"}]
    with pytest.raises(ValueError, match="must be 'module:Class', or a mapping of names"):
        config({}, []).validate()
    with pytest.raises(ValueError, match=r"rewards \['score'\] are declared as the environments'"):
        config({"count": f"{ENVS}:Counter", "tools": f"{ENVS}:NoReward"},
               [{"name": "Counter", "fn": "environment"}, {"name": "score", "fn": "environment"}]).validate()
    rows = [{"prompt": "a", "environment": "calc"}, {"prompt": "b", "environment": "serach"}]
    c = config(SETTING, [])
    with pytest.raises(ValueError, match=r"row 2: environment is 'serach', not one of data.tool_environment's \['calc', 'count'\]"):
        check_environment_rows(c, PromptSource(rows))
    with pytest.raises(ValueError, match="each row names its class in an 'environment' column"):
        check_environment_rows(c, PromptSource([{"prompt": "a"}]))
