"""`gdpo-ray train` on a machine without a cluster, run as a user runs it (a process of its own):
its local Ray starts in the background while the run is checked (``gdpo_ray.run.cluster``), the
workers import the user's modules from the user's folder, and a run that fails its check stops
the Ray it was starting: no process of it is left, no traceback or Ray warning is printed."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# a TRL user's file name (the package has a gdpo_ray.rewards of its own)
REWARDS = textwrap.dedent('''
    def short(completions, **kwargs):
        return [float(len(c) < 40) for c in completions]

    def marked(completions, **kwargs):
        return [0.25 for _ in completions]

    def crashes(completions, **kwargs):
        raise RuntimeError("judge returned garbage")
''')


@pytest.fixture
def ray_tmp():
    """Ray's temporary folder for one run (a short path: Ray's sockets live under it)."""
    path = Path(tempfile.mkdtemp(prefix="gr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def train(folder: Path, ray_tmp: Path, rewards: list, group_size: int = 2) -> subprocess.CompletedProcess:
    config = {"llm": {"model_path": "tiny", "max_prompt_tokens": 128}, "generation": {"max_tokens": 16},
              "data": {"prompts": "task:addition", "num_prompts": 8},
              "training": {"group_size": group_size, "prompts_per_step": 2, "rewards": rewards},
              "run": {"steps": 1, "output_dir": "runs", "num_cpus": 2, "checkpoint_at_end": False,
                      "export_policy": False}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "rewards.py").write_text(REWARDS)
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmp), PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "gdpo_ray", "train", "config.yaml"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


def left_over(ray_tmp: Path, within: float = 15.0) -> list[str]:
    """The processes of the Ray under ``ray_tmp`` still running after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if str(ray_tmp) in cmdline:
                found.append(f"{proc.pid} {cmdline[:120]}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_a_local_run_trains_with_the_users_modules_and_leaves_no_process(tmp_path, ray_tmp):
    done = train(tmp_path, ray_tmp, [{"name": "short", "fn": "rewards:short"},
                                     {"name": "marked", "fn": "rewards:marked"}])
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = next((tmp_path / "runs").glob("*/metrics.jsonl"))
    (row,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert row["rewards/marked/mean"] == 0.25 and row["rewards/marked/failure_rate"] == 0.0
    assert "Traceback" not in done.stderr and "SIGTERM" not in done.stderr, done.stderr[-3000:]
    assert left_over(ray_tmp) == []


@pytest.mark.parametrize("failing, group_size, said", [
    ("rewards:crashes", 2, "judge returned garbage"),  # the start-up check, in run()
    ("rewards:short", 1, "group_size must be an integer >= 2"),  # the config, in from_args
], ids=["check", "config"])
def test_a_run_that_fails_its_check_stops_the_ray_it_was_starting(tmp_path, ray_tmp, failing, group_size, said):
    done = train(tmp_path, ray_tmp, [{"name": "short", "fn": "rewards:short"}, {"name": "bad", "fn": failing}],
                 group_size=group_size)
    assert done.returncode == 2, done.stderr[-3000:]
    assert said in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "SIGTERM" not in done.stderr, done.stderr[-3000:]
    assert list(ray_tmp.glob("ray/session_*")), "no Ray was started while the run was checked"
    assert left_over(ray_tmp) == []
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_ray_init_imports_nothing_beyond_what_the_background_start_loads_first(ray_tmp):
    """The background start runs ``ray.init`` beside the driver's own imports: it must find every
    module it needs imported already (``RAY_INIT_IMPORTS``), or two threads could import one
    package's circular modules from either end. A new Ray that imports more fails here."""
    script = textwrap.dedent("""
        import contextlib, importlib, sys
        import ray
        from gdpo_ray.run import cluster
        for name in cluster.RAY_INIT_IMPORTS:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        before = set(sys.modules)
        cluster._start_local(1)
        print(sorted(set(sys.modules) - before))
        ray.shutdown()
    """)
    env = dict(os.environ, RAY_TMPDIR=str(ray_tmp), PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "[]"
