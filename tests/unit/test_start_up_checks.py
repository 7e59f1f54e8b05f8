"""Issue 29's items 9, 10 and 12 (reward values): data and settings that used to pass the
start-up check and then trained on NaN or zeros, hung or crashed mid-run are refused by
`gdpo-ray check` / `train` before Ray starts, naming the setting, the row or the reward."""

import json
import textwrap
import uuid

import pytest

from gdpo_ray.run.cli import main
from gdpo_ray.run.train import TrainingRun


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A user's folder: data.jsonl (ground_truth answers), a reward module, config.yaml."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TrainingRun, "_start_ray", lambda self: pytest.fail("Ray was started"))
    module = f"rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent('''
        def correct(completions, ground_truth, **kwargs):
            return [float(str(g) in c) for c, g in zip(completions, ground_truth)]

        def as_text(completions, **kwargs):
            return ["0.5" for _ in completions]

        def too_big(completions, **kwargs):
            return [1e39 for _ in completions]
    '''))

    def write(rows, rewards=("correct",), weight=1.0, **training):
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        config = {"llm": {"model_path": "tiny", "max_prompt_tokens": 256},
                  "generation": {"max_tokens": 16},
                  "data": {"prompts": "data.jsonl"},
                  "training": {"group_size": 2, "prompts_per_step": 2, **training, "rewards": [
                      {"name": r, "fn": f"{module}:{r}", "weight": weight} for r in rewards]},
                  "run": {"steps": 1, "output_dir": "runs"}}
        (tmp_path / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
        return "config.yaml"

    return write


ROWS = [{"prompt": f"What is {a} + 1?", "ground_truth": str(a + 1)} for a in range(6)]


def refused(capsys, *args, match):
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert match in " ".join(err.split()), err
    return err


def test_a_column_mixing_strings_and_numbers_is_refused_naming_the_line(folder, capsys):
    rows = [dict(r) for r in ROWS]
    rows[3]["ground_truth"] = 4  # a number among strings: ArrowTypeError in the record batch mid-run
    refused(capsys, folder(rows), match="column 'ground_truth', data.jsonl, line 4: 4 (int) does not "
                                        "fit the type string of the rows before it")


def test_an_integer_beyond_int64_is_refused_naming_the_line(folder, capsys):
    rows = [{"prompt": p["prompt"], "ground_truth": i} for i, p in enumerate(ROWS)]
    rows[5]["ground_truth"] = 2 ** 63  # OverflowError in the record batch mid-run
    refused(capsys, folder(rows), match="column 'ground_truth', data.jsonl, line 6: 9223372036854775808 "
                                        "(int) cannot be stored in a column")


@pytest.mark.parametrize("override, match", [
    ("training.kl_coef=.inf", "training.kl_coef must be a finite number; got inf"),
    ("training.lr=.inf", "training.lr must be a finite number; got inf"),
    ("training.eps=.inf", "training.eps must be a finite number; got inf"),
    ("training.eps=.nan", "training.eps must be a finite number; got nan"),
    ("training.weight_decay=.nan", "training.weight_decay must be a finite number; got nan"),
    ("generation.stop=['']", "generation.stop must be a list of non-empty strings"),
    ("data.num_prompts=1000000000000", "data.num_prompts must be an integer >= 1 and <= 1e+06"),
])
def test_settings_that_trained_on_nan_or_zeros_hung_or_crashed_are_refused(folder, capsys, override, match):
    refused(capsys, folder(ROWS), override, match=match)


@pytest.mark.parametrize("weight", [1e300, 1e200, float("inf")])
def test_reward_weights_that_overflow_the_sums_are_refused(folder, capsys, weight):
    # GRPO with 1e300 trained on NaN, GDPO with 1e200 on zeros (exit 0 both)
    refused(capsys, folder(ROWS, weight=weight), match="reward 'correct': weight must be a finite "
                                                       "number within +-1e+06")


def test_an_infinite_reward_timeout_is_refused(folder, capsys):
    path = folder(ROWS)
    config = json.loads(open(path).read())
    config["training"]["rewards"][0]["timeout_s"] = float("inf")
    open(path, "w").write(json.dumps(config).replace("Infinity", ".inf"))
    refused(capsys, path, match="reward 'correct': timeout_s must be a number of seconds in (0, 3600]")


@pytest.mark.parametrize("reward, match", [
    ("as_text", "reward 'as_text' returned '0.5' (a str); return numbers"),
    ("too_big", "reward 'too_big' returned 1e+39, beyond the float32 range"),
])
def test_a_reward_returning_text_or_beyond_float32_is_named(folder, capsys, reward, match):
    refused(capsys, folder(ROWS, rewards=("correct", reward)), match=match)


def test_a_local_ray_without_cpus_is_refused_before_ray(folder, capsys):
    refused(capsys, folder(ROWS), "run.num_cpus=0", match="run.num_cpus must be an integer >= 1")


def test_fenced_blocks_equal_the_fence_regex_and_stay_linear():
    import random
    import re

    from gdpo_ray.rewards.code import fenced_blocks

    fence = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)  # the rule it implements
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(["`", "``", "```", "````", "\n", "py", "python ", " ", "\t", "x", "é"])
                       for _ in range(rng.randrange(30)))
        assert fenced_blocks(text) == fence.findall(text), repr(text)
    assert fenced_blocks("`" * 600_000) == []  # one pass (the regex took minutes here: quadratic)


def test_an_environments_columns_are_left_to_the_rollouts_in_the_start_up_check(tmp_path, monkeypatch, capsys):
    """`gdpo-ray check` scores placeholders with the reward functions; an environment's columns
    and the rewards that read its instances exist only in real rollouts: shown, not failed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TrainingRun, "_start_ray", lambda self: pytest.fail("Ray was started"))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r | {"target": 1}) + "\n" for r in ROWS))
    config = {"llm": {"model_path": "tiny", "max_prompt_tokens": 256}, "generation": {"max_tokens": 16},
              "data": {"prompts": "data.jsonl", "tool_environment": "tests.unit.trl_style_environments:Calculator",
                       "tools_in_system_prompt": "never"},  # the tiny template ignores tools=: short prompts
              "training": {"group_size": 2, "prompts_per_step": 2, "rewards": [
                  {"name": "fmt", "fn": "regex", "params": {"pattern": "<tool_call>"}},
                  {"name": "state", "fn": "environment"},
                  {"name": "memory_used", "fn": "environment", "weight": 0},
                  {"name": "memory", "fn": "tests.unit.test_tool_loop:memory_left"}]},
              "run": {"steps": 1, "output_dir": "runs"}}
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    assert main(["check", "config.yaml"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[-1] for line in out.splitlines() if line.split()[:1] in (["state"], ["memory"])] == [
        "rollouts", "rollouts"], out


def test_check_shows_prompts_as_the_model_sees_them_and_counts_every_warning(tmp_path, monkeypatch, capsys):
    """Issue 48: `gdpo-ray check CONFIG --show-prompts N` prints the prompts as rendered for the
    model (the tiny model's template ignores tools=: the tools are in the system message, said
    once as a note); every warning printed is counted, those only logged included."""
    import logging

    from gdpo_ray.environments.spec import load_environment
    from gdpo_ray.run import preflight

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TrainingRun, "_start_ray", lambda self: pytest.fail("Ray was started"))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r | {"target": 1}) + "\n" for r in ROWS))
    config = {"llm": {"model_path": "tiny", "max_prompt_tokens": 1000}, "generation": {"max_tokens": 16},
              "data": {"prompts": "data.jsonl", "tool_environment": "tests.unit.trl_style_environments:Counter",
                       "system_prompt": "Be brief."},
              "training": {"group_size": 2, "prompts_per_step": 2, "rewards": []},  # Counter's, as TRL adds it
              "run": {"steps": 1, "output_dir": "runs"}}
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    assert main(["check", "config.yaml", "--show-prompts", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt ") == 2 and "(0 warning(s))" in out
    first = out.split("--- prompt 0 as the model sees it ---\n")[1].split("--- prompt 1")[0]
    assert first.startswith("<|im_start|>system\nBe brief.\n\nYou can call the tools below.")
    for schema in load_environment("tests.unit.trl_style_environments:Counter").schemas:
        assert json.dumps(schema) in first
    assert first.rstrip("\n").endswith(f"<|im_start|>user\n{ROWS[0]['prompt']}<|im_end|>\n<|im_start|>assistant")
    assert any(line.split()[:1] == ["Counter"] for line in out.splitlines())  # the column TRL adds, checked
    assert "gdpo-ray: note: the chat template of 'tiny' does not list the tools" in out
    # a warning of the report and one only logged: both counted
    real = preflight.check_context

    def logs_a_warning(c):
        logging.getLogger("gdpo_ray.run.preflight").warning("a logged warning")
        real(c)

    monkeypatch.setattr(preflight, "check_context", logs_a_warning)
    assert main(["check", "config.yaml", "data.tools_in_system_prompt=never"]) == 0
    out, err = capsys.readouterr()
    assert "a logged warning" in err  # printed, not only counted
    assert "gdpo-ray: warning: data.tool_environment: the chat template of 'tiny'" in out
    assert "(2 warning(s))" in out
