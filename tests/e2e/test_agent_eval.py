"""Issue 48, as a user meets it: their own environment (its reward read off its own state, TRL's
``get_reward()``, no column declared), two reward functions of their own (one reading the
environment instances), a held-out jsonl, evaluated before and after training from a scratch
folder on CPU, every column scored and pass@k from ``--correct``; each command a process of its
own, as a user runs it."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # about 2.5 minutes: each command a process of its own, as a user runs it

ROOT = Path(__file__).resolve().parents[2]

ENVIRONMENT = textwrap.dedent('''
    class Calc:
        """A user's calculator: its state is what its tools returned."""

        def reset(self, **row):
            self.target, self.results = str(row["ground_truth"]), []

        def add(self, a: int, b: int) -> int:
            """Adds two integers.

            Args:
                a: The first integer.
                b: The second integer.
            """
            self.results.append(str(a + b))
            return a + b

        def multiply(self, a: int, b: int) -> int:
            """Multiplies two integers.

            Args:
                a: The first integer.
                b: The second integer.
            """
            self.results.append(str(a * b))
            return a * b

        def get_reward(self):
            return float(self.target in self.results)
''')
REWARDS = textwrap.dedent('''
    import re

    def answered(completions, ground_truth, **kwargs):
        out = []
        for conversation, truth in zip(completions, ground_truth):
            last = [m["content"] for m in conversation if m["role"] == "assistant"][-1]
            found = re.search(r"<answer>(.*?)</answer>", last)
            out.append(float(bool(found) and found.group(1).strip() == str(truth)))
        return out

    def calls_made(environments, **kwargs):
        return [None if env is None else float(len(env.results)) for env in environments]
''')
CORRECT = ["--correct", "Calc>=1", "--correct", "answered>=1"]


@pytest.fixture
def scratch():
    from gdpo_ray.tasks import tool_arithmetic

    folder = Path(tempfile.mkdtemp(prefix="gr-agent-", dir="/tmp"))
    (folder / "calc_env.py").write_text(ENVIRONMENT)
    (folder / "my_rewards.py").write_text(REWARDS)
    rows = tool_arithmetic(40, 3)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    (folder / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[32:38]))
    config = {"run": {"steps": 2, "output_dir": "runs", "name": "calc", "num_cpus": 2, "checkpoint_at_end": False},
              "llm": {"model_path": "demo-agent", "max_prompt_tokens": 96},
              "data": {"prompts": "train.jsonl", "tool_environment": "calc_env:Calc"},
              "generation": {"temperature": 1.0, "max_tokens": 64, "max_turns": 3, "tool_timeout": 5},
              "training": {"group_size": 2, "prompts_per_step": 2, "lr": 1e-4, "eval_every": 2,
                           "eval_suite": "rewards:held_out.jsonl", "eval_samples": 2, "eval_correct": ["Calc>=1"],
                           "rewards": [{"name": "answered", "fn": "my_rewards:answered"},
                                       {"name": "calls", "fn": "my_rewards:calls_made", "weight": 0.1}]},
              "env_runners": {"num_env_runners": 1}}
    (folder / "calc.yaml").write_text(yaml.safe_dump(config))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def gdpo_ray(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "gdpo_ray", *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_users_environment_task_is_judged_before_and_after_training(scratch):
    base = gdpo_ray(scratch, "eval", "demo-agent", "--suite", "rewards:held_out.jsonl", "--rewards", "calc.yaml",
                    "--samples", "2", *CORRECT, "--pass-k", "1,2", "--output", "base.json", "--num-cpus", "2")
    assert base.returncode == 0, base.stderr[-3000:]
    trained = gdpo_ray(scratch, "train", "calc.yaml")
    assert trained.returncode == 0, trained.stderr[-3000:]
    # in training too (training.eval_suite on the run's rollout actors): every column, the turns,
    # accuracy as training.eval_correct defines it
    rows = [json.loads(line) for line in (scratch / "runs" / "calc" / "metrics.jsonl").read_text().splitlines()]
    evaluated = {k.removeprefix("eval/rewards:held_out/"): v for k, v in rows[-1].items() if k.startswith("eval/")}
    for key in ("Calc", "Calc/failure_rate", "calls", "answered", "accuracy", "Calc/pass_rate", "rollout/turns"):
        assert key in evaluated, sorted(evaluated)
    assert evaluated["Calc/failure_rate"] == 0.0 and evaluated["accuracy"] == evaluated["Calc/pass_rate"]
    after = gdpo_ray(scratch, "eval", "runs/calc", "--suite", "rewards:held_out.jsonl", "--samples", "2",
                     *CORRECT, "--pass-k", "1,2", "--num-cpus", "2")
    assert after.returncode == 0, after.stderr[-3000:]
    reports = [json.loads((scratch / "base.json").read_text()),
               json.loads((scratch / "runs" / "calc" / "eval" / "rewards_held_out.json").read_text())]
    for report in reports:
        overall = report["overall"]
        # every column scored: the environment's (TRL's get_reward, named after the class), the
        # one reading its instances, the plain one; none left out
        for name in ("answered", "calls", "Calc"):
            assert overall[f"{name}/failure_rate"] == 0.0 and 0.0 <= overall[name]
        assert "rewards_left_out" not in report["settings"]
        assert report["settings"]["reward_weights"] == {"answered": 1.0, "calls": 0.1, "Calc": 1.0}
        assert report["settings"]["correct"] == ["Calc>=1", "answered>=1"]
        for key in ("accuracy", "Calc/pass_rate", "answered/pass_rate", "pass@1", "pass@2",
                    "rollout/turns", "rollout/tool_calls", "rollout/tool_errors"):
            assert key in overall, key
        samples = [s for item in report["items"].values() for s in item["samples"]]
        assert len(samples) == 12 and all(s["rollout/turns"] >= 1 for s in samples)
        for s in samples:  # the transcript, and the verdicts read off it
            assert s["messages"][0]["role"] == "assistant"
            assert s["accuracy"] == float(s["Calc"] >= 1 and s["answered"] >= 1)
            assert s["rollout/tool_calls"] == sum(m["role"] == "tool" for m in s["messages"]) or \
                s["rollout/tool_errors"] > 0 or s["finish_reason"] == "length"
        # pass@1 is the mean of accuracy over each item's samples
        assert overall["pass@1"] == pytest.approx(overall["accuracy"])
        assert any(s["rollout/tool_calls"] > 0 for s in samples)  # demo-agent calls tools
    # the base model took the run's system prompt, template and environment: one line per setting
    # that still differs (here none), and the table compares like with like
    compared = gdpo_ray(scratch, "eval", "--compare", "base.json", "runs/calc")
    assert compared.returncode == 0 and "differs" not in compared.stdout, compared.stdout
    # a completions file cannot score the environment's columns: said before anything runs
    (scratch / "c.jsonl").write_text(json.dumps({"id": "0", "completions": ["4"]}) + "\n")
    refused = gdpo_ray(scratch, "eval", "--suite", "rewards:held_out.jsonl", "--rewards", "calc.yaml",
                       "--completions", "c.jsonl")
    assert refused.returncode == 2 and "rewards ['calls', 'Calc'] are computed by the rollout actors" in refused.stderr
