"""A real Ray cluster on this machine: `ray start --head` on private ports and a temp dir of its
own, the demo submitted with `ray job submit`, a second node offering the `rollout` resource
added while the job runs and removed again; the job's rollout actors grow onto it and shrink
back, and the job succeeds with every step trained. Only the
processes of this cluster are stopped (those whose command line carries its temp dir)."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


_TAKEN: set[int] = set()


def free_port() -> int:
    """A free port, never the same twice, between Ray's worker ports (10002-19999) and the
    kernel's ephemeral range (from 32768): an ephemeral port chosen here could be handed to
    another socket before the agent binds it ("address already in use": no job agent)."""
    while True:
        port = random.randint(20000, 32000)
        if port in _TAKEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _TAKEN.add(port)
        return port


def our_processes(markers: list[str]) -> list[int]:
    """Processes whose command line carries one of ``markers`` (arguments end with NUL), and
    their descendants (Ray's workers and agents rename themselves: ray::IDLE, ...)."""
    marked, parent = set(), {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="ignore")
            parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if any(m in cmdline for m in markers):
            marked.add(int(proc.name))
    grown = True
    while grown:
        children = {pid for pid, ppid in parent.items() if ppid in marked} - marked
        marked |= children
        grown = bool(children)
    return sorted(marked)


def stop_cluster(markers: list[str]) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 0)):
        for pid in our_processes(markers):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while our_processes(markers) and time.time() < deadline:
            time.sleep(0.2)


def private_ports() -> list[str]:
    """Ports of a node's own agents: the defaults (e.g. the dashboard agent's 52365) belong to
    the session's Ray of the other tests, and a second agent on them never comes up ("No
    available agent to submit job")."""
    return [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]


@pytest.fixture(scope="module")
def cluster():
    temp = tempfile.mkdtemp(prefix="gdpo-rt-")
    port, dash = free_port(), free_port()
    env = os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([RAY, "start", "--head", f"--port={port}", f"--dashboard-port={dash}",
                    "--dashboard-host=127.0.0.1", f"--ray-client-server-port={free_port()}",
                    f"--temp-dir={temp}", "--num-cpus=4", '--resources={"rollout": 1}',
                    "--disable-usage-stats", *private_ports()],
                   check=True, env=env, capture_output=True, timeout=120)
    try:
        yield {"gcs": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}", "temp": temp,
               "env": env}
    finally:  # the temp dir, or the GCS address (Ray's client server carries only that)
        stop_cluster([temp, f":{port}\0"])


def job(cluster, *args: str) -> str:
    """What `ray job ...` printed (the CLI writes some of it to stderr)."""
    done = subprocess.run([RAY, "job", *args, "--address", cluster["dashboard"]], env=cluster["env"],
                          capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def submit(cluster, working_dir, runtime_env: dict, *entrypoint: str) -> str:
    """`ray job submit --no-wait` -> the job id."""
    deadline = time.time() + 300  # the dashboard's job agent registers some time after `ray start`
    while True:  # (seconds; minutes on a loaded 2-core machine)
        submitted = subprocess.run(
            [RAY, "job", "submit", "--address", cluster["dashboard"], "--working-dir",
             str(working_dir), "--runtime-env-json", json.dumps(runtime_env), "--no-wait", "--",
             *entrypoint], env=cluster["env"], capture_output=True, text=True, timeout=180)
        if "No available agent" not in submitted.stderr or time.time() > deadline:
            break
        time.sleep(3)
    assert submitted.returncode == 0, submitted.stderr
    return re.search(r"raysubmit_[A-Za-z0-9]+", submitted.stdout + submitted.stderr).group(0)


def wait_for_end(cluster, job_id: str, seconds: float) -> str:
    deadline = time.time() + seconds
    while True:
        status = job(cluster, "status", job_id).lower()  # "Job '...' succeeded"
        if any(f"' {end}" in status for end in ("succeeded", "failed", "stopped")):
            return status
        assert time.time() < deadline, status
        time.sleep(2)


USER_REWARDS = """
import re


def correct(completions, answer, **kwargs):           # as written for TRL's GRPOTrainer
    found = [re.search(r"<answer>(.*?)</answer>", c) for c in completions]
    return [float(bool(m) and m.group(1).strip() == a) for m, a in zip(found, answer)]


def tagged(completions, **kwargs):
    return [float("<answer>" in c) for c in completions]
"""


def test_ray_job_submit_from_the_users_own_folder(cluster, tmp_path):
    """The user's folder (config, jsonl data, a TRL-style reward module) is the working dir;
    gdpo-ray is installed on the nodes; outputs go to a shared path the user names."""
    user = tmp_path / "project"
    user.mkdir()
    (user / "my_rewards.py").write_text(USER_REWARDS)
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(5) for b in range(5)]
    (user / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (user / "config.yaml").write_text(
        "llm: {model_path: demo, max_prompt_tokens: 64}\n"
        "data: {prompts: train.jsonl, prompt_column: question}\n"
        "training:\n  group_size: 4\n  prompts_per_step: 4\n  lr: 1.0e-4\n  rewards:\n"
        "    - {name: tagged, fn: 'my_rewards:tagged'}\n"
        "    - {name: correct, fn: 'my_rewards:correct', weight: 2.0}\n"
        "generation: {max_tokens: 24}\nrun: {steps: 2, name: userjob, export_policy: false}\n")
    shared = tmp_path / "shared"
    script = str(Path(sys.executable).with_name("gdpo-ray"))  # the installed console script
    job_id = submit(cluster, user, {"env_vars": {"RAY_AUTH_MODE": "disabled"}},
                    script, "train", "config.yaml", f"run.output_dir={shared}")
    status = wait_for_end(cluster, job_id, 420)
    logs = job(cluster, "logs", job_id)
    assert "' succeeded" in status, logs[-4000:]
    assert f"run directory {shared / 'userjob'}" in logs and "warning: outputs go to" not in logs
    metrics = [json.loads(line) for line in (shared / "userjob" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2]
    assert all(r["rewards/correct/failure_rate"] == 0 and r["rewards/tagged/errors"] == 0 for r in metrics)
    assert (shared / "userjob" / "rewards.png").exists()


def test_ray_job_submit_grows_rollouts_onto_a_new_node(cluster, tmp_path):
    runtime_env = {"excludes": [".git", ".venv", ".venv-vllm", ".venv-gpu", "runs"],
                   "env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}}
    job_id = submit(
        cluster, ROOT, runtime_env, sys.executable, "-m", "gdpo_ray", "train", "demo",
        "run.steps=600", "run.name=job", f"run.output_dir={tmp_path}",
        "training.prompts_per_step=4", "training.group_size=4", "generation.max_tokens=24",
        "env_runners.num_env_runners=[1,2]", "env_runners.custom_resources_per_env_runner={rollout: 1}",
        "run.export_policy=false")
    metrics = tmp_path / "job" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert time.time() < deadline, job(cluster, "logs", job_id)[-3000:]
        time.sleep(1)
    # a second node offering the rollout resource joins while the job trains ...
    node_port = free_port()
    subprocess.run([RAY, "start", f"--address={cluster['gcs']}", "--num-cpus=2",
                    '--resources={"rollout": 1}', f"--node-manager-port={node_port}",
                    "--disable-usage-stats", *private_ports()],
                   check=True, env=cluster["env"], capture_output=True, timeout=120)
    while not any(json.loads(line)["rollout/nodes"] == 2 for line in metrics.read_text().splitlines()):
        assert time.time() < deadline + 120, job(cluster, "logs", job_id)[-3000:]
        time.sleep(1)
    # ... and leaves again (its raylet and every process under it die)
    stop_cluster([f"--node_manager_port={node_port}\0"])
    status = wait_for_end(cluster, job_id, max(60.0, deadline + 240 - time.time()))
    logs = job(cluster, "logs", job_id)
    assert "' succeeded" in status, logs[-4000:]
    assert "rollout actors 1 on 1 node(s)" in logs and "rollout actors 2 on 2 node(s)" in logs, logs[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    placement = [(r["rollout/actors"], r["rollout/nodes"]) for r in rows]
    grown = placement.index((2, 2))
    assert placement[0] == (1, 1) and placement[-1] == (1, 1) and grown < len(rows) - 1
    # no prompt lost: every step trained its 4 groups, through the growth and the shrink
    assert [r["step"] for r in rows] == list(range(1, 601)) and all(r["groups"] == 4 for r in rows)
