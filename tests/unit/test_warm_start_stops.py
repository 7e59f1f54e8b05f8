"""A demo model's warm start stopped part-way (issue 50): SIGTERM while it trains or writes its
cache exits cleanly with one line saying so, leaves no temporary folder in the cache, and a
folder left by a build killed outright is swept by the next build on the host."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gdpo_ray.models.warm_start import build_atomically, cached_model

ROOT = Path(__file__).resolve().parents[2]


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)


def partial_builds(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if ".tmp" in p.name) if cache.is_dir() else []


def test_sigterm_during_the_warm_start_of_gdpo_ray_eval_exits_143_and_leaves_no_folder(tmp_path):
    """``gdpo-ray eval demo`` builds the demo model before Ray starts, where nothing handles
    SIGTERM: the build's own handler stops it, removes its folder and exits 143, no traceback."""
    cache = tmp_path / "cache"
    env = dict(os.environ, GDPO_RAY_CACHE=str(cache), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "gdpo_ray", "eval", "demo", "--suite", "task:addition",
                             "--limit", "2"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        # the model's files written, its training under way (the fit takes about a minute)
        wait_for(lambda: any((cache / p / "config.json").exists() for p in partial_builds(cache)),
                 "the warm start's folder", proc)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    assert "gdpo-ray: the warm start of demo-addition was stopped (SIGTERM); its partial folder" in err
    assert "Traceback" not in err and "*** SIGTERM received" not in err, err[-3000:]
    assert partial_builds(cache) == [] and list(cache.iterdir()) == []


def test_a_failed_or_interrupted_build_removes_its_folder_and_a_killed_ones_is_swept(tmp_path, capsys):
    def fails(path: Path, recipe: dict) -> None:
        (path / "half").mkdir(parents=True)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        cached_model("m", {"seed": 0}, fails, tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err == ""  # an error says itself; only an interruption gets a line

    def interrupted(path: Path, recipe: dict) -> None:
        path.mkdir(parents=True)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cached_model("m", {"seed": 0}, interrupted, tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert "the warm start of m was stopped (SIGINT)" in capsys.readouterr().err

    # a build SIGKILLed on this host (its pid gone) left its folder; another host's, on a
    # shared cache, and a live process's stay
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    host = socket.gethostname()
    target = tmp_path / "n"
    left = [tmp_path / f"n.tmp-{host}-{dead}", tmp_path / f"n.tmp-elsewhere-{dead}",
            tmp_path / f"n.tmp-{host}-{os.getppid()}"]
    for folder in left:
        folder.mkdir()
    built = build_atomically(target, lambda path: (path.mkdir(), (path / "config.json").write_text("{}")),
                             "a test build", ready=lambda path: (path / "config.json").exists())
    assert built == target and (target / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["n", left[1].name, left[2].name])


def test_the_sigterm_handler_is_the_builds_only_where_none_was_set(tmp_path):
    """The build's SIGTERM handler is in place during the build only, and only where SIGTERM had
    its default action: a process's own handler (gdpo-ray train's, Ray's) is left as it is."""
    seen = []

    def build(path: Path) -> None:
        seen.append(signal.getsignal(signal.SIGTERM))
        path.mkdir()
        (path / "config.json").write_text("{}")

    ready = lambda path: (path / "config.json").exists()
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        build_atomically(tmp_path / "a", build, "a", ready)
        assert seen[-1] is not signal.SIG_DFL and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        own = lambda signum, frame: None
        signal.signal(signal.SIGTERM, own)
        build_atomically(tmp_path / "b", build, "b", ready)
        assert seen[-1] is own and signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, before)
