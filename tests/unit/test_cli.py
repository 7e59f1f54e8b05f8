"""`gdpo-ray` and `python -m gdpo_ray` are the same command."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ARGS = ["analyze", "distinct-groups", "--rewards", "2", "--rollouts", "2-3", "--json"]


def run(cmd):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_module_and_console_script_agree():
    by_module = run([sys.executable, "-m", "gdpo_ray", *ARGS])
    assert [c["distinct"] for c in by_module["counts"] if c["method"] == "gdpo"] == [3, 6]
    script = Path(sys.executable).with_name("gdpo-ray")
    if not script.exists():
        pytest.fail(f"console script {script} is missing: install the package (pip install -e .)")
    assert run([str(script), *ARGS]) == by_module


def test_help_lists_commands():
    done = subprocess.run([sys.executable, "-m", "gdpo_ray", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "analyze" in done.stdout
