"""The README's Python example runs as written (issue 48): taken from README.md and run as a
user's script, in a fresh interpreter where no Ray is running and no Ray setting is made:
``config.build_algo()`` starts a local Ray itself, as RLlib's own algorithms do."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def readme_python_example() -> str:
    """The README's one Python block that imports gdpo_ray."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    [example] = [b for b in blocks if "from gdpo_ray import" in b]
    return example


def test_the_readmes_python_example_runs_as_written(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_python_example() + (  # what it computed, read back after it ran
        "import json, ray\n"
        "print('RESULT', json.dumps({'step': result['step'], 'correct': result['rewards/correct/mean'],\n"
        "                            'cpus': ray.cluster_resources()['CPU']}))\n"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Ray has not been started" not in done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["step"] == 1 and 0 <= result["correct"] <= 1
    assert result["cpus"] >= 2  # a local Ray that holds the example's rollout actor and learner
