"""The benchmarks cannot rot unseen: every name a benchmark script imports from the project
(``gdpo_ray``, ``actors``, ``learners``), at its top or inside a function, exists where the script
looks for it (issue 49: ``benchmarks/streaming.py`` imported ``LOCAL_RAY_CONFIG`` from the module
it had left, and no test noticed), and every script parses."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
PROJECT = ("gdpo_ray", "actors", "learners")


def project_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from <project module> import name`` in the script."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            and node.module.split(".")[0] in PROJECT for alias in node.names]


def missing_names(script: Path) -> list[str]:
    """The project names ``script`` imports that do not exist, each as 'file:line: what'."""
    missing = []
    for line, module, name in project_imports(script):
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name and err.name.split(".")[0] in PROJECT:
                missing.append(f"{script.name}:{line}: no module {module}")
            continue  # an optional dependency of its own (vllm, trl): not this test's
        if not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")  # a submodule
            except ModuleNotFoundError:
                missing.append(f"{script.name}:{line}: {module} has no {name}")
    return missing


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_project_name_a_benchmark_imports_exists(script):
    assert missing_names(script) == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_compiles(script):
    """Compiled, not only parsed: ``ast.parse`` accepts what only the compiler refuses (an import
    above ``from __future__ import annotations``). Each script's run: tests/e2e/test_benchmarks_smoke.py."""
    compile(script.read_text(), str(script), "exec")


def test_the_check_finds_a_moved_name_inside_a_function(tmp_path):
    script = tmp_path / "old.py"
    script.write_text("import os\n\ndef main():\n    from gdpo_ray.run.train import LOCAL_RAY_CONFIG_OLD, TrainingRun\n"
                      "    from gdpo_ray.nowhere import x\n")
    assert missing_names(script) == ["old.py:4: gdpo_ray.run.train has no LOCAL_RAY_CONFIG_OLD",
                                     "old.py:5: no module gdpo_ray.nowhere"]


def test_smoke_settings_are_defaults_that_a_given_flag_overrides():
    import argparse

    from benchmarks._smoke import parse_args

    def parse(*argv):
        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int, default=40)
        parser.add_argument("--seeds", type=int, default=3)
        return parse_args(parser, {"steps": 1, "seeds": 1, "thread_counts": (1,)}, list(argv))

    plain = parse("--steps", "5")
    assert (plain.smoke, plain.steps, plain.seeds, hasattr(plain, "thread_counts")) == (False, 5, 3, False)
    smoke = parse("--smoke")
    assert (smoke.smoke, smoke.steps, smoke.seeds, smoke.thread_counts) == (True, 1, 1, (1,))
    for argv in (("--smoke", "--steps", "5"), ("--steps", "5", "--smoke")):
        assert (parse(*argv).steps, parse(*argv).seeds) == (5, 1)
