"""An environment's reward columns as one schema: ``get_rewards()`` may return NeMo-Gym's
``reward_components`` shape (the components are the columns, the total is not); a name that one
rollout gives and another does not, or that the config does not declare, stops the run with an
error naming both sides, at start-up where it can be read and at the first rollout otherwise,
never a silent drop."""

import dataclasses
import math

import pytest

from actors.prompts import PromptSource
from gdpo_ray.environments.columns import Schema, SchemaError, given
from gdpo_ray.environments.session import ToolSession
from gdpo_ray.model_files import resolve_model_path
from gdpo_ray.rewards.spec import RewardSpec
from gdpo_ray.tool_format import ToolCall

HERE = "tests.unit.test_environment_components"


class Weather:
    """NeMo-Gym's multi-reward example as an environment: its verify response, the total
    ``reward`` beside the named ``reward_components``; the row's ``drop`` leaves one out."""

    def reset(self, **row):
        self.drop, self.extra, self.city = row.get("drop"), row.get("extra"), None

    def get_weather(self, city: str) -> str:
        """The weather of a city.

        Args:
            city: The city.
        """
        self.city = city
        return "sunny"

    def get_rewards(self):
        components = {"correctness": float(self.city == "Paris"), "format": 1.0, "schema_valid": 1.0}
        components.pop(self.drop, None)
        if self.extra:
            components[self.extra] = 0.5
        return {"reward": sum(components.values()), "reward_components": components, "predicted_calls": []}


@dataclasses.dataclass
class VerifyResponse:  # NeMo-Gym's BaseMultiRewardVerifyResponse, as an object
    reward: float
    reward_components: dict


class Typed(Weather):
    def get_rewards(self):
        return VerifyResponse(1.0, {"correctness": 1.0, "format": 0.0, "schema_valid": 0.0})


def test_the_components_are_the_columns_and_the_total_is_not():
    nemo = {"reward": 2.0, "reward_components": {"correctness": 1.0, "format": 1.0}, "correctness": 1.0}
    assert given(nemo) == {"correctness": 1.0, "format": 1.0}
    assert given(VerifyResponse(1.0, {"a": 0.0})) == {"a": 0.0}
    assert given({"state": 1.0}) == {"state": 1.0}  # our own shape: the dict itself
    with pytest.raises(TypeError, match="reward_components None"):
        given({"reward": 1.0, "reward_components": None})
    session = ToolSession(Typed(), ["get_weather"])
    session.reset({})
    names = ["correctness", "format", "schema_valid"]
    assert session.rewards(names, "get_rewards", keys=True) == (
        [(1.0, "", ""), (0.0, "", ""), (0.0, "", "")], ("correctness", "format", "schema_valid"))
    assert session.rewards(names, "get_rewards") == [(1.0, "", ""), (0.0, "", ""), (0.0, "", "")]  # the old shape


def test_a_schema_that_differs_is_an_error_naming_both():
    one = Schema(["format", "state"])
    one.check("Calc", ("state", "format"), "row 1")  # the order does not matter
    with pytest.raises(SchemaError) as extra:
        one.check("Calc", ["format", "state", "tries"], "row 2")
    assert str(extra.value) == (
        "environment Calc's rewards gave the columns ['format', 'state', 'tries'] (row 2), and the config "
        "declares ['format', 'state'] (fn: environment); ['tries'] not declared: their values would be "
        "dropped; declare each ({name: tries, fn: environment}; weight 0 records it without training on it) "
        "or stop returning it")
    with pytest.raises(SchemaError, match=r"\['state'\] declared but not given: every rollout's value would be NaN"):
        one.check("Calc", ["format"], "row 3")
    # TRL's dict form: a class gives some of the declared columns, the same ones in every rollout
    partial = Schema(["format", "state", "Counter"], partial=True)
    partial.check("Calc", ["state"], "row 1")
    partial.check("Counter", ["Counter"], "row 2")
    with pytest.raises(SchemaError) as changed:
        partial.check("Calc", ["format", "state"], "row 5")
    assert str(changed.value).startswith(
        "environment Calc's rewards gave the columns ['format', 'state'] (row 5), and ['state'] (row 1): a "
        "column is given in one rollout and not the other")


@pytest.fixture()
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny"))


def test_a_component_one_rollout_gives_and_another_does_not_stops_the_run(tokenizer):
    from actors.tool_loop import ToolEnvironment

    env = ToolEnvironment(f"{HERE}:Weather", tokenizer, 2, 5.0)
    names = ["correctness", "format", "schema_valid"]
    try:
        full, _ = env.start_one({"prompt": "Weather in Paris?"})
        assert full.session.call(ToolCall("get_weather", {"city": "Paris"})).text == "sunny"
        other, _ = env.start_one({"prompt": "Weather in Rome?"})
        assert env.rewards([full, other], names) == {
            "correctness": ([1.0, 0.0], ["", ""], ["", ""]), "format": ([1.0, 1.0], ["", ""], ["", ""]),
            "schema_valid": ([1.0, 1.0], ["", ""], ["", ""])}
        short, _ = env.start_one({"prompt": "Weather in Oslo?", "drop": "format"})
        with pytest.raises(SchemaError) as err:
            env.rewards([short], names)
        assert str(err.value).startswith(
            "environment Weather's rewards gave the columns ['correctness', 'schema_valid'] (a rollout of the "
            "row whose prompt is 'Weather in Oslo?'), and the config declares ['correctness', 'format', "
            "'schema_valid'] (fn: environment); ['format'] declared but not given")
        more, _ = env.start_one({"prompt": "Weather in Bern?", "extra": "politeness"})
        with pytest.raises(SchemaError, match=r"\['politeness'\] not declared: their values would be dropped"):
            env.rewards([more], names)
        # a rollout whose rewards could not be read gives no names: NaN with the error, no schema error
        broken, _ = env.start_one({"prompt": "x", "drop": "format"})
        broken.session.process.kill()
        (value,), (kind,), (error,) = env.rewards([broken], names)["format"]
        assert math.isnan(value) and (kind, error) == ("error", "get_rewards was stopped before")
    finally:
        env.close()


def test_the_start_up_check_reads_the_columns_on_the_first_row():
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.preflight import check_environment_columns

    def checked(rewards, rows=({"prompt": "Weather in Paris?"},)):
        c = GDPOConfig().llm(model_path="tiny").data(prompts="task:addition", tool_environment=f"{HERE}:Weather")
        c = c.training(rewards=[{"name": r, "fn": "environment"} for r in rewards])
        specs = [RewardSpec.from_dict(r) for r in c.rewards]
        return check_environment_columns(c, PromptSource(list(rows)), specs)

    assert checked(["correctness", "format", "schema_valid"]) == []
    with pytest.raises(SchemaError) as err:
        checked(["correctness", "format"])
    assert str(err.value).startswith(
        "environment Weather's rewards gave the columns ['correctness', 'format', 'schema_valid'] (the dataset, row 1, "
        "reset and scored before any tool call by the start-up check), and the config declares "
        "['correctness', 'format'] (fn: environment); ['schema_valid'] not declared")
    # where they cannot be read before a call, the first rollout checks them (a note says so)
    notes = checked(["correctness", "format", "schema_valid"], [{"prompt": "x", "drop": ["unhashable"]}])
    assert len(notes) == 1 and notes[0].startswith("environment Weather: the columns its rewards give could "
                                                   "not be read before any tool call (get_rewards raised TypeError")


def test_the_rollout_actor_stops_at_the_first_rollout_whose_columns_differ(tiny_model_dir):
    """Where the start-up check could not read them, the first scored group raises the error out of
    the rollout actor (and so out of the run's step), instead of scoring NaN or dropping a column."""
    import asyncio

    from actors.prompts import Prompt
    from actors.rollout import RolloutActor

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    actor = RolloutActor(tiny_model_dir, [{"name": "correctness", "fn": "environment"}], group_size=2,
                         engine="tests.unit.scripted_engine:ScriptedEngine", engine_kwargs={"script": [call, "Sunny."]},
                         sampling={"max_tokens": 200}, environment=f"{HERE}:Weather", max_turns=3, tool_timeout=5,
                         max_prompt_tokens=4096)
    try:
        with pytest.raises(SchemaError, match=r"\['format', 'schema_valid'\] not declared"):
            asyncio.run(actor.generate([Prompt("0", 0, 0, 0, "Weather in Paris?", {})]))
    finally:
        asyncio.run(actor.shutdown())
