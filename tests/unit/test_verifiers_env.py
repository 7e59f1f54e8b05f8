"""A verifiers environment (verifiers 0.4, ``verifiers.v1``: a taskset, its task's ``@vf.reward``
functions, a toolset's ``@vf.tool``) runs as a gdpo-ray tool environment, each reward its own
column by name, with verifiers' weights as the columns' default weights, never their weighted
sum; a rubric judge's criteria are columns of their own. Built with verifiers' own classes;
skipped where the ``verifiers`` extra is not installed."""

import json
import math
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers.v1")

from verifiers.v1.judges import Criterion, RubricJudge, RubricJudgeConfig  # noqa: E402

from actors.engines import SamplingParams  # noqa: E402
from actors.prompts import PromptSource  # noqa: E402
from actors.tool_loop import ToolEnvironment  # noqa: E402
from actors.turn_loop import run_batched  # noqa: E402
from gdpo_ray.environments.spec import load_environment, with_environment_columns  # noqa: E402
from gdpo_ray.environments.verifiers_env import TASK_COLUMN, VerifiersEnvironment, taskset_rows  # noqa: E402
from gdpo_ray.model_files import resolve_model_path  # noqa: E402
from tests.unit.scripted_engine import ScriptedEngine  # noqa: E402

HERE = "tests.unit.test_verifiers_env"


class SumState(vf.State):
    calls: int = 0  # the tools' calls in this rollout, read by a reward on trace.state


class Calculator(vf.Toolset[vf.ToolsetConfig, SumState]):
    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Adds two integers."""
        self.state.calls += 1
        return a + b


class SumData(vf.TaskData):
    answer: str


class SumTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class SumTask(vf.Task[SumData, SumState, SumTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(config.tools)]

    @vf.reward(weight=2.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(trace.state.calls > 0)


class SumTasksetConfig(vf.TasksetConfig):
    task: SumTaskConfig = SumTaskConfig()


class Sums(vf.Taskset[SumTask, SumTasksetConfig]):
    def load(self):
        for a, b in [(2, 2), (3, 4)]:
            yield SumTask(SumData(prompt=f"What is {a}+{b}?", system_prompt="Use the calculator.",
                                  answer=str(a + b)), self.config.task)


class Env(VerifiersEnvironment):
    taskset = Sums


class Rubric(RubricJudge):
    """A rubric judge whose verdicts are given here (no endpoint): explains, is short."""

    criteria = [Criterion(name="explains", text="Says why.", weight=3.0),
                Criterion(name="short", text="Under 40 characters.", weight=1.0)]

    async def grade_batch(self, task, trace, batch):
        reply = trace.last_reply
        return {"explains": float("because" in reply), "short": float(len(reply) < 40)}


class JudgedTask(SumTask):
    def plugged_judges(self):
        return [Rubric(RubricJudgeConfig(path=Path("unused.toml"), weight=2.0))]


class Judged(vf.Taskset[JudgedTask, SumTasksetConfig]):
    def load(self):
        yield JudgedTask(SumData(prompt="What is 2+2?", answer="4"), self.config.task)


class JudgedEnv(VerifiersEnvironment):
    taskset = Judged


class Boxed(SumTask):
    NEEDS_CONTAINER = True


class BoxedTasks(vf.Taskset[Boxed, SumTasksetConfig]):
    def load(self):
        yield Boxed(SumData(prompt="p", answer="1"), self.config.task)


class BoxedEnv(VerifiersEnvironment):
    taskset = BoxedTasks


def test_each_reward_is_a_column_with_verifiers_weight_as_its_default():
    spec = load_environment(f"{HERE}:Env")
    assert spec.dynamic and spec.tools == () and spec.reward_getter == "get_rewards"
    assert Env.reward_columns() == {"correct": 2.0, "used_tool": 0.5}
    # undeclared columns are added with their weights; a declaration keeps its own weight
    added = with_environment_columns([{"name": "used_tool", "fn": "environment", "weight": 1.0}], f"{HERE}:Env")
    assert added == [{"name": "used_tool", "fn": "environment", "weight": 1.0},
                     {"name": "correct", "fn": "environment", "weight": 2.0}]
    rows = taskset_rows(Sums)
    assert [r["prompt"] for r in rows] == [
        [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 3+4?"}]]
    assert json.loads(rows[1][TASK_COLUMN])["answer"] == "7"


def rollout(tools, row, script):
    engine = ScriptedEngine(resolve_model_path("tiny"), script=script)
    (t, observation), = tools.start([row])
    assert observation is None and t.session is not None, t.failed
    text = engine.tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False,
                                                tools=tools.schemas_of(t))
    run_batched(engine, tools, [engine.tokenizer(text, add_special_tokens=False)["input_ids"]], [t],
                SamplingParams(max_tokens=400))
    return t


def test_a_verifiers_environment_trains_with_each_rubric_function_its_own_column():
    """Two rollouts of one task through the rollout loop: one calls the toolset's tool and then
    answers wrong, the other answers right without it. Each reward is its own column (the
    weighted sum, 2 x 0 + 0.5 x 1 against 2 x 1 + 0.5 x 0, is no column)."""
    tokenizer = ScriptedEngine(resolve_model_path("tiny")).tokenizer
    tools = ToolEnvironment(f"{HERE}:Env", tokenizer, 4, 30.0)
    try:
        row = taskset_rows(Sums, 1)[0]
        call = '<tool_call>\n{"name": "calculator_add", "arguments": {"a": 2, "b": "2"}}\n</tool_call>'
        called = rollout(tools, row, [call, "The answer is 5."])
        assert [s["function"]["name"] for s in tools.schemas_of(called)] == ["calculator_add"]
        assert called.messages[1] == {"role": "tool", "name": "calculator_add", "content": "4"}  # "2" checked to 2
        right = rollout(tools, row, ["The answer is 4."])
        assert tools.rewards([called, right], ["correct", "used_tool"]) == {
            "correct": ([0.0, 1.0], ["", ""], ["", ""]), "used_tool": ([1.0, 0.0], ["", ""], ["", ""])}
        bad = rollout(tools, row, ['<tool_call>\n{"name": "calculator_add", "arguments": {"a": 1}}\n</tool_call>',
                                   "No."])
        assert bad.tool_errors == 1 and "Field required" in bad.messages[1]["content"]  # MCP's own argument check
    finally:
        tools.close()


def test_a_rubric_judges_criteria_are_columns_in_place_of_its_sum():
    assert JudgedEnv.reward_columns() == {"correct": 2.0, "used_tool": 0.5,
                                          "rubric/explains": 1.5, "rubric/short": 0.5}  # 2 x 3/4, 2 x 1/4
    env = JudgedEnv()
    env.reset(**taskset_rows(Judged)[0])
    assert env.tool_schemas()[0]["function"]["name"] == "calculator_add"
    scored = env.get_rewards(completion=[{"role": "assistant", "content": "It is 4 because 2+2=4, as anyone can see."}])
    assert scored == {"correct": 1.0, "used_tool": 0.0, "rubric/explains": 1.0, "rubric/short": 0.0}


def test_what_gdpo_ray_cannot_run_is_refused_when_it_loads(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"verifiers task Boxed needs a container \(NEEDS_CONTAINER\)"):
        load_environment(f"{HERE}:BoxedEnv")
    with pytest.raises(ValueError, match="has no 'vf_task' column"):
        Env().reset(prompt="What is 2+2?")
    # verifiers:<taskset id>: an installed package exporting its Taskset, as verifiers' CLI resolves it
    (tmp_path / "tiny_sums").mkdir()
    (tmp_path / "tiny_sums" / "__init__.py").write_text(
        f"from {HERE} import Sums\n__all__ = ['Sums']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_environment("verifiers:tiny-sums")
    assert spec.cls.__name__ == "verifiers:tiny-sums" and spec.cls.reward_columns() == {"correct": 2.0, "used_tool": 0.5}
    with pytest.raises(ValueError, match="'verifiers:' needs a taskset id"):
        load_environment("verifiers:")


def test_the_start_up_check_reads_a_verifiers_environments_columns():
    from gdpo_ray import GDPOConfig
    from gdpo_ray.environments.columns import SchemaError
    from gdpo_ray.rewards.spec import RewardSpec
    from gdpo_ray.run.preflight import check_environment_columns

    c = GDPOConfig().llm(model_path="tiny").data(prompts="task:addition", tool_environment=f"{HERE}:Env")
    rows = taskset_rows(Sums)
    specs = [RewardSpec.from_dict(r) for r in with_environment_columns([], f"{HERE}:Env")]
    assert check_environment_columns(c, PromptSource(rows), specs) == []
    with pytest.raises(SchemaError, match=r"\['used_tool'\] not declared"):
        check_environment_columns(c, PromptSource(rows), specs[:1])


@pytest.mark.slow
def test_a_short_training_run_trains_on_each_reward_of_the_task(ray_cluster):
    """The demo model, one GDPO step on the taskset's rows with no reward declared: the task's two
    rewards are the run's columns, each logged and normalized apart, none failed."""
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    sections = load_preset("demo", ["training.prompts_per_step=2", "training.group_size=2", "generation.max_tokens=32",
                                    "generation.prompts_per_call=2", "generation.max_turns=2",
                                    "data.tools_in_system_prompt=never"])  # the demo's prompts stay short
    config = apply_sections(GDPOConfig(), sections).data(prompts=taskset_rows(Sums), tool_environment=f"{HERE}:Env")
    algo = config.training(rewards=[]).build_algo()
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert [(r["name"], r["weight"]) for r in algo.config.rewards] == [("correct", 2.0), ("used_tool", 0.5)]
    assert result["groups"] == 2 and math.isfinite(result["learner/loss"])
    for name in ("correct", "used_tool"):
        assert 0 <= result[f"rewards/{name}/mean"] <= 1 and result[f"rewards/{name}/failure_rate"] == 0, name
    assert {k.split("/")[1] for k in result if k.startswith("rewards/") and k.endswith("/mean")} == {"correct", "used_tool"}
