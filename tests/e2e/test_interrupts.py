"""Interrupting `gdpo-ray train` (issue 29 item 11), as a user does: Ctrl-C (SIGINT to the
command's process group, as a terminal sends it) and SIGTERM (to the process, as a scheduler or
`timeout` sends it) after the first step. Each run stops after the step in progress, without a
traceback, saves a checkpoint of it (checkpoint_every is 0), prints its path and the command that
resumes it, and exits 130 / 143; that command continues the run in its own directory."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gdpo_ray.run.checkpoints import checkpoint_version, verify_checkpoint
from gdpo_ray.run.train import TrainingRun

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["training.prompts_per_step=4", "training.group_size=4", "generation.max_tokens=32",
         "run.steps=100", "run.output_dir=runs", "run.num_cpus=2"]

pytestmark = pytest.mark.slow


def start(folder: Path, name: str) -> subprocess.Popen:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "-m", "gdpo_ray", "train", "demo", f"run.name={name}", *SMALL],
                            cwd=folder, env=env, start_new_session=True, text=True,
                            stdout=open(folder / f"{name}.out", "w"), stderr=open(folder / f"{name}.err", "w"))


def steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_sigint_and_sigterm_stop_with_a_checkpoint_and_the_resume_command(tmp_path, monkeypatch):
    # both runs at once (each starts its own Ray), so the test costs one start-up
    procs = {"ctrl_c": start(tmp_path, "ctrl_c"), "term": start(tmp_path, "term")}
    how = {"ctrl_c": lambda p: os.killpg(p.pid, signal.SIGINT), "term": lambda p: p.send_signal(signal.SIGTERM)}
    deadline, sent = time.monotonic() + 400, set()
    try:
        while len(sent) < 2 and time.monotonic() < deadline:
            for name, proc in procs.items():
                if name in sent:
                    continue
                assert proc.poll() is None, (tmp_path / f"{name}.err").read_text()[-3000:]
                if steps(tmp_path / "runs" / name):
                    how[name](proc)
                    sent.add(name)
            time.sleep(0.5)
        codes = {name: proc.wait(timeout=max(60, deadline - time.monotonic())) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert codes == {"ctrl_c": 130, "term": 143}
    monkeypatch.chdir(tmp_path)
    for name, signame in (("ctrl_c", "SIGINT"), ("term", "SIGTERM")):
        err, run = (tmp_path / f"{name}.err").read_text(), tmp_path / "runs" / name
        assert "Traceback" not in err, err[-3000:]
        done = steps(run)[-1]
        checkpoint = run / "checkpoints" / f"step_{done:06d}"
        assert f"stopped by {signame} after step {done}; checkpoint {checkpoint}" in err, err[-3000:]
        assert verify_checkpoint(str(checkpoint)) == [] and checkpoint_version(checkpoint) == done
        command = err.split("gdpo-ray: resume with: ")[1].splitlines()[0]
        assert command == shlex.join(["gdpo-ray", "train", "demo", f"run.name={name}", *SMALL,
                                      "--resume", str(run)])
        # the command continues this run, in its directory, from that checkpoint
        argv = shlex.split(command)
        resumed = TrainingRun.from_args(argv[2], argv[3:-2], resume=argv[-1])
        assert resumed.resume == str(checkpoint) and resumed.run_dir == run and resumed.outputs.continuing
