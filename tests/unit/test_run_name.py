"""`run.name` is one plain folder of `run.output_dir` (issue 50): a path, `.`/`..`, an empty
name or one with control characters fails `gdpo-ray train` and `gdpo-ray check` before Ray
starts, saying the rule and where the folder should go instead; nothing is written outside
`run.output_dir`."""

import pytest

from gdpo_ray.config import check_run_name
from gdpo_ray.run import cluster
from gdpo_ray.run.cli import main


@pytest.fixture
def before_ray(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cluster, "begin", lambda run: pytest.fail("Ray was started"))
    monkeypatch.setattr(cluster, "start_ray", lambda *a, **k: pytest.fail("Ray was started"))
    return tmp_path


@pytest.mark.parametrize("command", ["train", "check"])
def test_a_path_as_run_name_fails_before_ray_with_the_fix(before_ray, capsys, command):
    outside = before_ray / "elsewhere" / "x"
    assert main([command, "demo", f"run.name={outside}", "run.steps=1"]) == 2
    err = capsys.readouterr().err
    assert (f"gdpo-ray {command}: run.name must be a plain folder name, without / or \\: it is a folder of "
            f"run.output_dir (runs), not a path; got '{outside}'. Say where the folder goes with "
            f"run.output_dir: run.output_dir={outside.parent} run.name=x") in err
    assert main([command, "demo", "run.name=a/b", "run.output_dir=out", "run.steps=1"]) == 2
    assert "got 'a/b'. Say where the folder goes with run.output_dir: run.output_dir=out/a run.name=b" in \
        capsys.readouterr().err
    assert list(before_ray.iterdir()) == []


@pytest.mark.parametrize("name, said", [
    ("..", "run.name '..' is run.output_dir itself or its parent, not a folder of its own"),
    (".", "run.name '.' is run.output_dir itself or its parent"),
    ("'a\\\\b'", "run.name must be a plain folder name, without / or \\"),
])
def test_dot_names_and_backslashes_fail_before_ray(before_ray, capsys, name, said):
    assert main(["train", "demo", f"run.name={name}", "run.steps=1"]) == 2
    assert said in capsys.readouterr().err
    assert list(before_ray.iterdir()) == []


def test_the_rule_by_itself():
    for good in (None, "first-try", "seed7-a", "run 1", "~x", "é" * 127):
        check_run_name(good)
    for bad, said in (("", "must be a non-empty folder name"), ("  ", "must be a non-empty folder name"),
                      ("a\x00b", "must not hold control characters"), ("a\nb", "must not hold control characters"),
                      ("x" * 256, "is 256 bytes long; a folder name holds at most 255"),
                      ("/", "run.output_dir=/ run.name=<name>"), ("a/", "run.output_dir=runs run.name=a")):
        with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
            check_run_name(bad)
