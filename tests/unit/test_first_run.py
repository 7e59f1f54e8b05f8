"""A user's first run: every mistake of issue 13 stops `gdpo-ray train` (and `check`) in seconds,
before Ray starts, with a message naming the field, file or line and the fix, and leaves no run
directory behind. A user's own folder (a jsonl dataset, a reward module, a YAML) is built in
tmp_path; the command runs from there."""

import json
import textwrap
import uuid

import pytest

from gdpo_ray.run.cli import main
from gdpo_ray.run.train import TrainingRun

ROWS = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(3) for b in range(3)]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The user's folder: data.jsonl, a reward module (a fresh name per test) and config.yaml."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(TrainingRun, "_start_ray", lambda self: pytest.fail("Ray was started"))
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    module = f"my_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent('''
        import re

        def correct(completions, answer, **kwargs):          # TRL's form: keywords
            return [float(answer[i] in c) for i, c in enumerate(completions)]

        def short(completions, **kwargs):
            return [float(len(c) < 40) for c in completions]

        def needs_solution(completions, solution, **kwargs):
            return [1.0 for _ in completions]

        def crashes(completions, **kwargs):
            raise RuntimeError("judge returned garbage")

        def bad_signature(prompt, completions):            # `prompt`: not what is passed
            return [0.0 for _ in completions]
    '''))
    config = {
        "llm": {"model_path": "tiny", "max_prompt_tokens": 256},
        "generation": {"max_tokens": 32},
        "data": {"prompts": "data.jsonl", "prompt_column": "question"},
        "training": {"group_size": 2, "prompts_per_step": 2, "rewards": [
            {"name": "correct", "fn": f"{module}:correct", "weight": 2.0},
            {"name": "short", "fn": f"{module}:short", "condition": {"on": "correct", "min": 1}}]},
        "run": {"steps": 1, "output_dir": "runs"},
    }
    import yaml

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path, module


def fails(capsys, folder, *args, match):
    path, _ = folder
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert match in err, err
    assert not (path / "runs").exists() or not any((path / "runs").iterdir())
    return err


def test_the_user_folder_checks_clean(folder, capsys):
    assert main(["check", "config.yaml"]) == 0
    out = capsys.readouterr().out
    assert "prompt_column: question" in out  # the resolved config
    assert "start-up check passed: 9 dataset rows, rewards correct, short" in out
    assert "correct" in out and "0/8" in out
    assert "is ready to train" in out


def test_a_missing_model_path(folder, capsys):
    fails(capsys, folder, "train", "config.yaml", "llm.model_path=./models/nope",
          match="llm.model_path './models/nope' does not exist; give a Hugging Face model directory")
    fails(capsys, folder, "train", "config.yaml", "llm.model_path=someone/no-such-model",
          match="is not a local directory nor a model in the Hugging Face cache; download it first")


@pytest.mark.parametrize("line, match", [
    ('{"question": "x", "answer": NaN}', "data.jsonl, line 10: NaN is not valid JSON; write null"),
    ('{"question": "x", "answer": "1"', "data.jsonl, line 10: not valid JSON (Expecting ',' delimiter"),
    ('{"question": "caf\udce9"}', "data.jsonl, line 10: not UTF-8 text"),
])
def test_a_malformed_dataset_line(folder, capsys, line, match):
    path, _ = folder
    with (path / "data.jsonl").open("ab") as f:
        f.write(line.encode("utf-8", "surrogateescape") + b"\n")
    fails(capsys, folder, "train", "config.yaml", match=match)


def test_missing_dataset_and_huge_rows(folder, capsys):
    path, _ = folder
    fails(capsys, folder, "train", "config.yaml", "data.prompts=nope.jsonl",
          match="dataset 'nope.jsonl' does not exist")
    with (path / "data.jsonl").open("a") as f:  # a row far beyond pyarrow's JSON block size
        f.write(json.dumps({"question": "long " * 600_000, "answer": "1"}) + "\n")
    assert main(["check", "config.yaml"]) == 0
    assert "10 dataset rows" in capsys.readouterr().out


def test_wrong_types_and_unknown_keys(folder, capsys):
    fails(capsys, folder, "train", "config.yaml", "training.lr=fast",
          match="training.lr must be a number; got 'fast' (str); e.g. training.lr=1e-06")
    fails(capsys, folder, "train", "config.yaml", "training.group_sise=4",
          match="'group_sise' is not a setting of section 'training'; did you mean 'group_size'?")
    fails(capsys, folder, "train", "config.yaml", "generation.max_tokens=many",
          match="generation.max_tokens must be an integer; got 'many'")
    fails(capsys, folder, "check", "config.yaml", "run.stpes=3",
          match="'stpes' is not a setting of section 'run'; did you mean 'steps'?")


def test_rewards_that_cannot_run(folder, capsys):
    _, module = folder
    reward = "training.rewards=[{name: r, fn: '%s:%s'}]"
    fails(capsys, folder, "train", "config.yaml", reward % (module, "needs_solution"),
          match="reward 'r' needs column 'solution' (a parameter of needs_solution without a "
                "default), which")
    fails(capsys, folder, "train", "config.yaml", reward % (module, "bad_signature"),
          match="reward 'r' needs column 'prompt'")
    fails(capsys, folder, "train", "config.yaml", reward % ("no_such_module", "f"),
          match="cannot import module 'no_such_module' of reward 'no_such_module:f'")
    err = fails(capsys, folder, "train", "config.yaml", reward % (module, "crashes"),
                match="reward 'r' failed on every sample: 8 placeholder completions")
    assert "error: RuntimeError: judge returned garbage" in err


def test_a_reused_run_name_is_refused(folder, capsys):
    path, _ = folder
    (path / "runs" / "mine").mkdir(parents=True)
    (path / "runs" / "mine" / "metrics.jsonl").write_text("{}\n")
    assert main(["train", "config.yaml", "run.name=mine"]) == 2
    err = capsys.readouterr().err
    assert f"run directory {path / 'runs' / 'mine'} exists already (run.name='mine')" in err
    assert (path / "runs" / "mine" / "metrics.jsonl").read_text() == "{}\n"  # untouched


def test_overrides_after_resume_and_relative_checkpoints(folder, capsys):
    path, _ = folder
    ckpt = path / "runs" / "old" / "checkpoints" / "final"
    ckpt.mkdir(parents=True)
    # a relative --resume (the README's form) is taken from the shell's folder, and overrides may
    # follow it; this one is not a checkpoint, which is said before Ray starts
    assert main(["train", "config.yaml", "--resume", "runs/old/checkpoints/final",
                 "run.name=new", "run.steps=2"]) == 2
    assert f"--resume {ckpt}: not a gdpo-ray checkpoint" in capsys.readouterr().err


def test_prompt_and_response_must_fit_the_model(folder, capsys):
    fails(capsys, folder, "train", "config.yaml", "llm.max_prompt_tokens=1000",
          "generation.max_tokens=100",
          match="llm.max_prompt_tokens (1000) + generation.max_tokens (100) = 1100 tokens exceed "
                "the model's context length (1024 positions")


def test_list_and_version(capsys):
    assert main(["list", "presets"]) == 0
    assert "demo" in capsys.readouterr().out.split()
    assert main(["list", "rewards"]) == 0
    assert "toolrl_format" in capsys.readouterr().out.split()
    assert main(["list", "estimators"]) == 0
    assert capsys.readouterr().out.split() == ["gdpo", "gdpo_no_std", "grpo", "grpo_no_std"]
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("gdpo-ray 0.")


def test_output_dirs_unique_names_storage_and_temporary_working_dirs(tmp_path):
    from pathlib import Path

    from gdpo_ray.run.outputs import OutputDir
    from gdpo_ray.run.train import in_temporary_working_dir

    first = OutputDir(str(tmp_path), None, "demo")
    first.create()
    (first.local / "metrics.jsonl").write_text("{}\n")
    second = OutputDir(str(tmp_path), None, "demo")  # the same second: a fresh name
    assert second.local != first.local and second.name.startswith(first.name)
    # storage: a local staging copy, uploaded at the end; a second run of that name is refused
    store = OutputDir(f"file://{tmp_path}/bucket", "r1", "demo")
    store.create()
    (store.local / "metrics.jsonl").write_text('{"step": 1}\n')
    store.upload()
    assert (tmp_path / "bucket" / "r1" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert str(store) == f"file://{tmp_path}/bucket/r1"
    with pytest.raises(ValueError, match="exists already"):
        OutputDir(f"file://{tmp_path}/bucket", "r1", "demo")
    job_copy = Path("/tmp/ray/session_2026-12-03_10-00-00_1/runtime_resources/working_dir_files/"
                    "_ray_pkg_1234/runs/demo")
    assert in_temporary_working_dir(job_copy) and not in_temporary_working_dir(tmp_path / "runs")


def test_the_users_reward_modules_are_shipped_to_a_cluster(folder):
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.cluster import user_modules

    path, module = folder
    (path / "pkg").mkdir()
    (path / "pkg" / "__init__.py").write_text("")
    (path / "pkg" / "scores.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    import sys

    sys.path.insert(0, str(path))
    try:
        config = GDPOConfig().training(rewards=[
            {"name": "a", "fn": f"{module}:correct"}, {"name": "b", "fn": "pkg.scores:f"},
            {"name": "c", "fn": "verl:pkg.scores:f"}, {"name": "d", "fn": "json:loads"},
            {"name": "e", "fn": "length"}, {"name": "f", "fn": "gdpo_ray.rewards.length:length"}])
        assert user_modules(config) == [str(path / f"{module}.py"), str(path / "pkg")]
    finally:
        sys.path.remove(str(path))


def test_broken_files_are_named(folder, capsys):
    path, _ = folder
    (path / "broken_mod.py").write_text("def f(completions, **kw)\n    return 1\n")
    fails(capsys, folder, "train", "config.yaml", "training.rewards=[{name: r, fn: 'broken_mod:f'}]",
          match="importing module 'broken_mod' of reward 'broken_mod:f' failed: SyntaxError:")
    (path / "broken.yaml").write_text("training: {rewards: [1, 2\n")
    fails(capsys, folder, "train", "broken.yaml", match="config file broken.yaml is not valid YAML")
    fails(capsys, folder, "train", "config.yaml", "training.rewards=[math_correctness]",
          match="a reward is a mapping {name, fn, params, weight, condition, timeout_s, floor}; got "
                "'math_correctness'")


def test_train_and_eval_resolve_a_hub_name_from_the_local_cache(tmp_path, monkeypatch):
    # one resolver: `llm.model_path: org/name` and `gdpo-ray eval org/name` find the same snapshot
    import huggingface_hub.constants

    from gdpo_ray.model_files import resolve_model_path
    from gdpo_ray.run.eval_runner import resolve_policy

    snapshot = tmp_path / "models--org--name" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--name" / "refs").mkdir()
    (tmp_path / "models--org--name" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model_path("org/name") == snapshot and resolve_policy("org/name") == str(snapshot)
    with pytest.raises(ValueError, match="model 'org/other' is not a local directory nor a model in the "
                                         "Hugging Face cache; download it first"):
        resolve_policy("org/other")
