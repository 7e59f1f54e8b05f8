"""Adversarial programs in the code sandbox: each attack is shown to have failed by the host's
state or a marker (no file, connection, secret or process gets out), with a sanity half showing
that the probe itself works where it is allowed to; then the code rewards on real runs."""

import ctypes
import glob
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from gdpo_ray import rewards
from gdpo_ray.rewards import _sandbox_init, code, sandbox
from gdpo_ray.rewards.sandbox import Limits, SandboxUnavailable, run_program
from tests.hang import hang_guard

try:
    sandbox.check_available()
except SandboxUnavailable as err:  # the real sandbox cannot run here: nothing to test against
    pytest.skip(f"code sandbox unavailable on this machine: {err}", allow_module_level=True)

LIMITS = dict(wall_s=1.5, cpu_s=2, memory_mb=256, processes=8, output_bytes=1 << 20)
SANDBOX_UIDS = range(200_000, 2_000_000)  # sandbox.run_program's random uid (mapped 1:1 on the host)
MARKER = f"gdpo-sandbox-test-{uuid.uuid4().hex[:8]}"
# The honest program echoes stdin doubled; the ground truth has one test.
TESTS = json.dumps({"inputs": ["21\n"], "outputs": ["42\n"]})
HONEST = "print(int(input()) * 2)"


def passrate(program: str, tests: str = TESTS, **limits) -> float:
    fn = rewards.get("code_passrate", **{**LIMITS, **limits})
    return fn(["p"], [f"```python\n{program}\n```"], ground_truth=[tests])[0]


def run_alone(*programs: str, stdin: str = "21\n", **limits):
    """Each program in turn in one sandbox (one run each), as run_program's RunResults."""
    runs = [{"argv": [sys.executable, "-I", f"p{i}.py"], "stdin": stdin} for i in range(len(programs))]
    files = {f"p{i}.py": program for i, program in enumerate(programs)}
    return run_program(files, runs, Limits(**{**LIMITS, **limits}))


def run_on_host(program: str) -> str:
    """The probe unconfined (it is ours, not a model's): its stdout."""
    return subprocess.run([sys.executable, "-I", "-c", program], capture_output=True, text=True,
                          timeout=30, check=True).stdout


def _uid_of(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


def marked_processes() -> list[str]:
    """Host processes with MARKER in their argv."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if MARKER.encode() in f.read() and int(pid) != os.getpid():
                    found.append(pid)
        except OSError:
            pass
    return found


def sandbox_leftovers() -> dict:
    """What a sandboxed program could have left on the host: files of a sandbox uid (or named
    with MARKER) in /tmp, /var/tmp, /dev/shm and the working directory, and processes of a
    sandbox uid or with MARKER in their argv."""
    files = []
    for folder in ("/tmp", "/var/tmp", "/dev/shm", os.getcwd()):
        for entry in os.scandir(folder):
            try:
                if entry.stat(follow_symlinks=False).st_uid in SANDBOX_UIDS or MARKER in entry.name:
                    files.append(entry.path)
            except OSError:
                pass
    procs = [p for p in filter(str.isdigit, os.listdir("/proc")) if _uid_of(p) in SANDBOX_UIDS]
    return {"files": sorted(files), "procs": sorted(procs + marked_processes())}


@pytest.fixture
def unchanged_machine():
    before = sandbox_leftovers()
    # no adversarial test outlasts its runs' limits (at most three runs) by much: none hangs
    with hang_guard(int(Limits(**LIMITS).total_s(3)) + 60, "an adversarial sandbox test"):
        yield
    # nothing new is left behind; another session's sandbox run on this machine (same uid
    # range) may come and go meanwhile, so what is new must still be there after 3 s
    deadline = time.monotonic() + 3
    while any((new := _new_leftovers(before)).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert new == {"files": [], "procs": []}


def _new_leftovers(before: dict) -> dict:
    now = sandbox_leftovers()
    return {kind: sorted(set(now[kind]) - set(before[kind])) for kind in now}


def test_honest_program_passes(unchanged_machine):
    assert passrate(HONEST) == 1.0


# ------------------------------------------------------------------------------------------
# resource attacks: each is stopped by its limit, within the wall time, and leaves nothing


def test_infinite_loop_and_sleep_are_stopped_at_the_wall_limit(unchanged_machine):
    loop, sleep = run_alone("while True:\n    pass", "import time\ntime.sleep(10**6)")
    for r in (loop, sleep):
        # wall_s = 1.5 (cpu_s = 2 is not reached first): no exit status, stopped by the sandbox
        assert r.timed_out and r.exit_code is None and r.signal is None
        assert 1.5 <= r.wall_s < 1.5 + 0.5


FORK_COUNT = (
    "import os, time\n"
    "n = 0\n"
    "while True:\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        time.sleep(60)\n"
    "        os._exit(0)\n"
    "    n += 1\n"
    "print(n, flush=True)\n"
    "time.sleep(60)"
)
FORK_BOMB = (
    "import os\n"
    "while True:\n"
    "    try:\n"
    "        os.fork()\n"
    "    except OSError:\n"
    "        pass"
)


def test_fork_bomb_is_held_at_the_process_limit(unchanged_machine):
    counted, bomb, honest = run_alone(FORK_COUNT, FORK_BOMB, HONEST)
    # processes = 8 for the sandbox uid: the program itself + 7 children, then fork fails
    assert counted.stdout == "7\n" and counted.timed_out
    # the classic bomb (every process forks, forever) is stopped at the wall limit ...
    assert bomb.timed_out and bomb.wall_s < 1.5 + 0.5
    # ... and the next run still gets its processes: every bomb process was killed
    assert honest.ok and honest.stdout == "42\n"


def test_memory_bomb_gets_a_memory_error(unchanged_machine):
    program = (
        "blocks = []\n"
        "try:\n"
        "    while True:\n"
        "        blocks.append(bytearray(64 << 20))\n"
        "except MemoryError:\n"
        "    print(len(blocks), flush=True)\n"
        "    raise"
    )
    (r,) = run_alone(program)
    # memory_mb = 256 of address space, the interpreter holds some: 1 to 3 blocks of 64 MiB
    assert 1 <= int(r.stdout) <= 3
    assert r.exit_code == 1 and r.stderr.rstrip().endswith("MemoryError")


def test_output_flood_is_cut_at_the_output_limit(unchanged_machine):
    program = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)"
    (r,) = run_alone(program)
    # output_bytes = 1 MiB: the run is stopped with exactly 1 MiB of its stdout kept
    assert r.output_exceeded and r.stdout == "x" * (1 << 20)
    assert r.wall_s < 1.5


def test_killing_the_parent_and_everything_fails(unchanged_machine):
    program = (
        "import os, signal\n"
        "for pid in (os.getppid(), 1, -1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(int(input()) * 3)"
    )
    killer, honest = run_alone(program, HONEST)
    # the killer survives its own kill(-1) and ends normally; the sandbox's init survived all
    # three kills: it runs the next program and reports both results
    assert killer.ok and killer.stdout == "63\n"
    assert honest.ok and honest.stdout == "42\n"


def test_a_setsid_escapee_does_not_outlive_the_run(unchanged_machine):
    # the grandchild leaves the session, names itself with MARKER in argv and sleeps for 10
    # minutes; the program waits until it runs (the sanity half), then exits
    escapee = ("import os, time; open('/tmp/work/escapee', 'w').write(str(os.getpid())); "
               "time.sleep(600)")
    program = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', {escapee!r}, {MARKER!r}])\n"
        "    os._exit(0)\n"
        "for _ in range(200):\n"
        "    if os.path.exists('/tmp/work/escapee') and open('/tmp/work/escapee').read():\n"
        "        break\n"
        "    time.sleep(0.01)\n"
        "pid = open('/tmp/work/escapee').read()\n"
        f"print('escapee running:', {MARKER!r} in open(f'/proc/{{pid}}/cmdline').read())"
    )
    (r,) = run_alone(program)
    assert r.ok and r.stdout == "escapee running: True\n"
    assert marked_processes() == []  # ... and it was killed when the run ended


# ------------------------------------------------------------------------------------------
# escape attacks: the host file, the listener, the secret stay untouched


def test_writing_outside_its_directory(unchanged_machine, tmp_path):
    inside = [f"/tmp/work/{MARKER}", f"/tmp/{MARKER}", f"/var/tmp/{MARKER}", f"/dev/shm/{MARKER}"]
    outside = [str(Path.cwd() / MARKER), str(tmp_path / MARKER), f"/root/{MARKER}"]
    program = (
        "import json\n"
        "report = {}\n"
        f"for path in {inside + outside!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('pwned')\n"
        "        report[path] = open(path).read()\n"
        "    except OSError as err:\n"
        "        report[path] = type(err).__name__\n"
        "print(json.dumps(report))"
    )
    (r,) = run_alone(program)
    report = json.loads(r.stdout)
    # sanity: the write works in the sandbox's own (throwaway) /tmp, /var/tmp and /dev/shm ...
    assert {path: report[path] for path in inside} == dict.fromkeys(inside, "pwned")
    # ... and fails everywhere else: read-only file system, or hidden under the private /tmp
    assert all(report[path] in ("OSError", "PermissionError", "FileNotFoundError") for path in outside)
    # none of them reached the host, not even the ones the program could write
    assert [t for t in inside + outside if os.path.exists(t)] == []


class Listener:
    """A TCP listener on the host's loopback that counts the connections it accepts."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.1)
        self.port, self.accepted, self.stop = self.server.getsockname()[1], 0, False
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self.stop = True
        self.thread.join()
        self.server.close()


def test_connecting_to_a_local_listener(unchanged_machine):
    listener = Listener()
    program = (
        "import socket\n"
        "try:\n"
        f"    s = socket.create_connection(('127.0.0.1', {listener.port}), timeout=1)\n"
        "    s.sendall(b'hello')\n"
        "    print('connected')\n"
        "except OSError as err:\n"
        "    print('failed:', err.strerror)"
    )
    try:
        assert run_on_host(program) == "connected\n"  # sanity: the probe reaches the listener
        deadline = time.monotonic() + 2
        while listener.accepted < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.accepted == 1
        (r,) = run_alone(program)
        time.sleep(0.2)  # what the listener would accept has arrived by now
    finally:
        listener.close()
    assert r.ok and r.stdout == "failed: Network is unreachable\n"  # the loopback is down
    assert listener.accepted == 1  # only the host's probe


def test_reading_the_parent_environment(unchanged_machine, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("GDPO_TEST_SECRET", secret)
    program = (
        "import os\n"
        "found = [os.environ.get('GDPO_TEST_SECRET', '')]\n"
        "readable = 0\n"
        "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n"
        "        env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0')\n"
        "    except OSError:\n"
        "        continue\n"
        "    readable += 1\n"
        "    found += [i.split(b'=', 1)[1].decode() for i in env if i.startswith(b'GDPO_TEST_SECRET=')]\n"
        "print('found:', ' '.join(found).strip(), '| environ files read:', readable)"
    )
    assert secret in run_on_host(program)  # sanity: unconfined, the probe finds the secret
    (r,) = run_alone(program)
    # in the sandbox: an empty environment, and only its own /proc/<pid>/environ is readable
    assert r.ok and r.stdout == "found:  | environ files read: 1\n"
    assert secret not in r.stdout + r.stderr


def test_sandbox_environment_is_empty_and_unprivileged():
    (r,) = run_program(
        {"main.py": "import os, json; print(json.dumps([dict(os.environ), os.getuid(), os.getpid(), os.getcwd()]))"},
        [{"argv": [sys.executable, "-I", "main.py"]}], Limits(**LIMITS),
    )
    env, uid, pid, cwd = json.loads(r.stdout)
    assert set(env) <= {"LC_CTYPE"}  # what Python itself sets (PEP 538), nothing inherited
    assert uid >= 200_000 and pid < 10 and cwd == "/tmp/work"


# ------------------------------------------------------------------------------------------
# the code rewards on real runs


def test_code_bug_and_passrate_on_one_execution():
    tests = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "8\n"]})
    completions = ["a, b = map(int, input().split())\nprint(a + b)",
                   "a, b = map(int, input().split())\nprint(a + b if a < 3 else 1 / 0)",
                   "def f(:\n  pass"]
    bug = rewards.get("code_bug", **LIMITS)
    pr = rewards.get("code_passrate", **LIMITS)
    # second program: right on test 1, ZeroDivisionError on test 2 (a bug); third: SyntaxError
    assert pr([""] * 3, completions, ground_truth=[tests] * 3) == [0.5, 0.5, 0.0]
    assert bug([""] * 3, completions, ground_truth=[tests] * 3) == [1.0, 0.0, 0.0]


def test_code_bug_counts_errors_and_crashes_not_timeouts():
    tests = json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})
    limits = dict(LIMITS, wall_s=1, cpu_s=1)
    completions = [
        "import time\ntime.sleep(3)",  # past wall_s = 1: timed_out
        "while True:\n    pass",  # cpu_s = 1 reached at wall ~1 s (SIGKILL) or wall_s: a limit either way
        "print(1 / 0)",  # ZeroDivisionError: exit 1
        "def f(:\n  pass",  # SyntaxError: exit 1
        "import os\nos.abort()",  # SIGABRT: a crash
        "print(input())",  # right, for reference
    ]
    paper = rewards.get("code_bug", **limits)
    strict = rewards.get("code_bug", timeouts_are_bugs=True, **limits)
    # the paper: only compile/runtime errors and crashes are bugs
    assert paper([""] * 6, completions, ground_truth=[tests] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    # timeouts_are_bugs: any run that is not ok
    assert strict([""] * 6, completions, ground_truth=[tests] * 6) == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    # pass rate: only the right program passes its one test
    passes = rewards.get("code_passrate", **limits)
    assert passes([""] * 6, completions, ground_truth=[tests] * 6) == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_call_based_tests():
    tests = json.dumps({"inputs": [[1, 2], [3, 4]], "outputs": [3, [7]], "fn_name": "add"})
    pr = rewards.get("code_passrate", **LIMITS)
    programs = ["def add(a, b):\n    return a + b",
                "class Solution:\n    def add(self, a, b):\n        return a + b",
                "def add(a, b):\n    return a - b"]
    assert pr([""] * 3, programs, ground_truth=[tests] * 3) == [1.0, 1.0, 0.0]


def test_call_based_values_json_cannot_encode():
    tests = json.dumps({"inputs": [[3]], "outputs": [[1, 2, 3]], "fn_name": "f"})
    programs = ["def f(n):\n    return {3, 1, 2}",  # a set: sorted -> [1, 2, 3], passes
                "def f(n):\n    return (1, 2, 3)",  # a tuple -> [1, 2, 3], passes
                "def f(n):\n    return {(1, 2): 3}",  # a tuple key: {"(1, 2)": 3}, wrong but no bug
                "def f(n):\n    return object()",  # its repr string: wrong but no bug
                "def g(n):\n    return [1, 2, 3]"]  # no f: a NameError in the harness, a bug
    pr, bug = rewards.get("code_passrate", **LIMITS), rewards.get("code_bug", **LIMITS)
    assert pr([""] * 5, programs, ground_truth=[tests] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert bug([""] * 5, programs, ground_truth=[tests] * 5) == [1.0, 1.0, 1.0, 1.0, 0.0]
    files = {"solution.py": programs[4], "harness.py": code._HARNESS}
    (r,) = run_program(files, [{"argv": [sys.executable, "-I", "harness.py", "f"], "stdin": "[3]"}],
                       Limits(**LIMITS))
    assert r.exit_code == 1 and r.stderr.rstrip().endswith(
        "NameError: the solution defines no function 'f' (nor a method 'f' of class Solution); "
        "define it with that name")


def test_empty_program():
    stdin_tests = json.dumps({"inputs": ["1\n", "2\n"], "outputs": ["1\n", ""]})
    call_tests = json.dumps({"inputs": [[1]], "outputs": [1], "fn_name": "f"})
    pr, bug = rewards.get("code_passrate", **LIMITS), rewards.get("code_bug", **LIMITS)
    empty = ["", "```python\n```"]  # no text at all; an empty python block
    # stdin task: runs without error (bug 1) and prints nothing: passes only the case whose
    # expected output is empty -> 1 of 2 = 0.5
    assert pr([""] * 2, empty, ground_truth=[stdin_tests] * 2) == [0.5, 0.5]
    assert bug([""] * 2, empty, ground_truth=[stdin_tests] * 2) == [1.0, 1.0]
    # call-based task: f is missing, a runtime error: pass rate 0, bug 0
    assert pr([""] * 2, empty, ground_truth=[call_tests] * 2) == [0.0, 0.0]
    assert bug([""] * 2, empty, ground_truth=[call_tests] * 2) == [0.0, 0.0]


def test_code_rewards_after_tag():
    tests = json.dumps({"inputs": ["21\n"], "outputs": ["42\n"]})
    completions = ["<think>```python\nprint(1 / 0)\n```</think>\n```python\nprint(int(input()) * 2)\n```",
                   "<think>```python\nprint(int(input()) * 2)\n```"]  # cut off in the reasoning
    pr = rewards.get("code_passrate", after_tag="</think>", **LIMITS)
    bug = rewards.get("code_bug", after_tag="</think>", **LIMITS)
    # the program after </think> is right; the unfinished one has no program: 0 and 0
    assert pr([""] * 2, completions, ground_truth=[tests] * 2) == [1.0, 0.0]
    assert bug([""] * 2, completions, ground_truth=[tests] * 2) == [1.0, 0.0]
    # without after_tag the block inside the unfinished reasoning is graded (and passes)
    assert rewards.get("code_passrate", **LIMITS)([""], completions[1:], ground_truth=[tests]) == [1.0]


def test_refuses_to_run_code_without_root_namespaces():
    # As an unprivileged user (nobody) the namespaces cannot be created: the sandbox refuses
    # with the reason instead of running the program unconfined.
    with tempfile.TemporaryDirectory() as folder:
        _refusal_probe(Path(folder))


def _refusal_probe(folder: Path):
    script = folder / "probe.py"
    script.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sb', {str(Path(sandbox.__file__))!r})\n"
        "sb = sys.modules['sb'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(sb)\n"
        "try:\n"
        "    sb.run_program({'main.py': 'open(\"/tmp/ran\", \"w\")'}, [{'argv': [sys.executable, 'main.py']}], sb.Limits())\n"
        "except sb.SandboxUnavailable as err:\n"
        "    print('refused:', err)\n"
    )
    folder.chmod(0o755)
    script.chmod(0o644)
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           "/usr/bin/python3", str(script)], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("refused: the code sandbox needs root"), done.stdout + done.stderr


# ------------------------------------------------------------------------------------------
# what a program can see: its directory, the interpreter and its standard library, devices

ROOT = Path(__file__).resolve().parents[2]

SEES = (
    "import json, os, sys\n"
    "report = {}\n"
    "for name in ('gdpo_ray', 'numpy', 'torch', 'json'):\n"
    "    try:\n"
    "        __import__(name)\n"
    "        report[name] = 'imported'\n"
    "    except ImportError:\n"
    "        report[name] = 'missing'\n"
    "for path in PATHS:\n"
    "    try:\n"
    "        report[path] = open(path).read() if os.path.isfile(path) else sorted(os.listdir(path))[:3]\n"
    "    except OSError as err:\n"
    "        report[path] = type(err).__name__\n"
    "print(json.dumps(report))"
)


def test_the_trainer_is_invisible(unchanged_machine, tmp_path):
    beside = ROOT / f".{MARKER}.txt"  # a world-readable file beside the project (a dataset, say)
    beside.write_text("secret answers")
    beside.chmod(0o644)
    run_dir = Path.cwd() / "runs"
    paths = [str(beside), str(ROOT), str(ROOT / "gdpo_ray"), str(run_dir), str(Path(sys.prefix))]
    program = f"PATHS = {paths!r}\n" + SEES
    try:
        on_host = json.loads(run_on_host(program))
        (r,) = run_alone(program)
    finally:
        beside.unlink()
    seen = json.loads(r.stdout)
    # sanity: on the host the probe imports the trainer's packages and reads the file
    assert on_host["gdpo_ray"] == on_host["numpy"] == "imported" and on_host[str(beside)] == "secret answers"
    # in the sandbox: the standard library only, and none of the host's files
    assert seen["json"] == "imported"
    assert seen["gdpo_ray"] == seen["numpy"] == seen["torch"] == "missing"
    assert all(seen[p] == "FileNotFoundError" for p in paths if not p.startswith(str(Path(sys.base_prefix))))


def test_regenerating_the_ground_truth_is_no_reward_hack(unchanged_machine):
    # a program that solves nothing but rebuilds task:code's answers from the installed package
    from gdpo_ray.tasks import code as code_task

    rows = code_task(64, seed=3)
    i = next(i for i, r in enumerate(rows) if "fn_name" not in json.loads(r["ground_truth"]))
    row, tests = rows[i], json.loads(rows[i]["ground_truth"])  # a stdin task
    hack = ("from gdpo_ray.tasks import code\nimport json, sys\n"
            f"t = json.loads(code(64, seed=3)[{i}]['ground_truth'])\n"
            "print(t['outputs'][t['inputs'].index(sys.stdin.read())], end='')")
    assert passrate(hack, row["ground_truth"]) == 0.0
    on_host = subprocess.run([sys.executable, "-c", hack], input=tests["inputs"][0],
                             capture_output=True, text=True, timeout=60).stdout
    assert on_host == tests["outputs"][0]  # the hack works wherever the package is visible


def test_device_nodes_work(unchanged_machine):
    program = ("import os, subprocess, sys\n"
               "open('/dev/null', 'w').write('x')\n"
               "assert len(open('/dev/urandom', 'rb').read(16)) == 16\n"
               "assert open('/dev/zero', 'rb').read(4) == bytes(4)\n"
               "print(subprocess.run([sys.executable, '-c', 'print(1)'], stdout=subprocess.DEVNULL,"
               " stderr=subprocess.DEVNULL).returncode, os.urandom(4) != os.urandom(4))")
    (r,) = run_alone(program)
    assert r.ok and r.stdout == "0 True\n", r.stderr


def test_every_run_starts_from_fresh_files(unchanged_machine):
    program = ("import os\n"
               "print(open('p0.py').read().startswith('import os'), os.path.exists('left.txt'),"
               " os.path.exists('/tmp/scratch'), os.path.exists('/dev/shm/scratch'))\n"
               "open('p0.py', 'w').write('print(\"tampered\")')\n"
               "open('left.txt', 'w').write('x'); open('/tmp/scratch', 'w'); open('/dev/shm/scratch', 'w')")
    runs = [{"argv": [sys.executable, "-I", "p0.py"]}] * 3
    results = run_program({"p0.py": program}, runs, Limits(**LIMITS))
    assert [r.stdout for r in results] == ["True False False False\n"] * 3


def test_no_nested_namespaces(unchanged_machine):
    nested = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x20000\n"
              "print(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), ctypes.get_errno())")
    (inner,) = run_alone(nested)
    assert inner.stdout == "-1 28\n"  # ENOSPC: no user namespace can be created inside


def test_a_call_has_one_memory_cap(unchanged_machine):
    if sandbox.cgroup_support() is not None:  # then only the per-process caps hold (documented)
        pytest.skip(f"no cgroups on this machine: {sandbox.cgroup_support()}")
    # 6 children of 150 MB each: every one is under the per-process memory_mb (256), together
    # they are 900 MB, past the call's cap (memory_mb + 2 disk_mb + 64 = 384 MB)
    hog = ("import os, time\npids = []\nfor i in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
           "        b = bytearray(150 << 20)\n        b[::4096] = b'x' * len(b[::4096])\n"
           "        time.sleep(1.0)\n        os._exit(0)\n    pids.append(pid)\n"
           "ok = sum(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in (os.waitpid(p, 0)[1] for p in pids))\n"
           "print(ok, flush=True)")
    (big,) = run_alone(hog, wall_s=4, memory_mb=256, processes=8)
    survivors = int(big.stdout or 0)
    assert survivors < 6  # some were killed by the call's cgroup (none would be without it)


def test_call_based_equality_rules():
    tests = json.dumps({"inputs": [[1]], "outputs": [[5]], "fn_name": "f"})
    programs = ["def f(x):\n    return [5]", "def f(x):\n    return 5", "def f(x):\n    return [5.0]",
                "def f(x):\n    return [True]"]
    lenient = rewards.get("code_passrate", **LIMITS)
    strict = rewards.get("code_passrate", equality="strict", **LIMITS)
    bools = json.dumps({"inputs": [[1]], "outputs": [1], "fn_name": "f"})
    # python (APPS/PRIME): ==, and [5] also accepts 5; strict: same JSON types, no unwrapping
    assert lenient([""] * 4, programs, ground_truth=[tests] * 4) == [1.0, 1.0, 1.0, 0.0]
    assert strict([""] * 4, programs, ground_truth=[tests] * 4) == [1.0, 0.0, 0.0, 0.0]
    assert lenient([""], ["def f(x):\n    return True"], ground_truth=[bools]) == [1.0]
    assert strict([""], ["def f(x):\n    return True"], ground_truth=[bools]) == [0.0]


# ------------------------------------------------------------------------------------------
# a wrong program cannot turn its 0 into NaN (NaN is left out of the group statistics, so it
# would pay: advantage 0 instead of -0.5 for one failure in a group of 4 with one pass), nor
# reach anything run-scoped of an earlier run or of the trainer

# fills 16 memfds of 16 MiB (one file_mb each, so under every per-process cap) from small
# processes, held by a small shell: 256 MiB, past the call's cap of 128 + 2 * 8 + 64 = 208 MiB
MEMFD_FILL = (
    "import os\n"
    "fds = [os.memfd_create(f'm{i}', 0) for i in range(16)]\n"
    "for fd in fds:\n"
    "    os.set_inheritable(fd, True)\n"
    "paths = ' '.join(f'/dev/fd/{fd}' for fd in fds)\n"
    "TAIL = 'exec sleep 5'\n"
    "os.execv('/bin/sh', ['sh', '-c', f'for f in {paths}; do head -c 16M /dev/zero > $f; done; '\n"
    "                     f'cat {paths} | wc -c; {TAIL}'])"
)
MEMFD_LIMITS = dict(memory_mb=128, disk_mb=8)


def test_a_memfd_filled_call_scores_0_not_nan(unchanged_machine):
    # unconfined (no cap), the probe really holds 256 MiB = 268435456 bytes
    assert run_on_host(MEMFD_FILL.replace("exec sleep 5", "")) == f"{256 << 20}\n"
    tests = json.dumps({"inputs": ["21\n", "21\n"], "outputs": ["42\n", "42\n"]})
    completion = [f"```python\n{MEMFD_FILL}\n```"]
    scores = [rewards.get(name, **{**LIMITS, **MEMFD_LIMITS, **params})(
        ["p"], completion, ground_truth=[tests])[0]
        for name, params in (("code_passrate", {}), ("code_bug", {}),
                             ("code_bug", {"timeouts_are_bugs": True}))]
    # the call's OOM killer or the wall limit stops it: pass rate 0, not NaN; a limit kill is
    # no bug in the paper's reading (1), and a bug with timeouts_are_bugs (0)
    assert scores == [0.0, 1.0, 0.0]
    # the sandbox's init was never at risk: it is outside the cgroup, and runs the next program
    filled, honest = run_alone(MEMFD_FILL, HONEST, **MEMFD_LIMITS)
    assert not filled.ok and filled.aborted is None
    assert honest.ok and honest.stdout == "42\n" and honest.aborted is None
    # how: a program process is the OOM killer's first choice (1000), in a cgroup the init
    # (process 1) is not in (where this machine gives the call a cgroup)
    (where,) = run_alone("print(open('/proc/self/oom_score_adj').read().strip(),\n"
                         "      open('/proc/self/cgroup').read() != open('/proc/1/cgroup').read())")
    assert where.stdout == f"1000 {sandbox.cgroup_support() is None}\n"


DEEP_TMP = (
    "import os\n"
    "BASE = '/tmp'\n"
    "print(os.path.exists(BASE + '/d'))  # left by an earlier run?\n"
    "os.chdir(BASE)\n"
    "depth = 0\n"
    "for _ in range(1500):\n"
    "    os.mkdir('d')\n"
    "    os.chdir('d')\n"
    "    depth += 1\n"
    "print(depth)"
)


def test_a_deep_directory_left_in_tmp_scores_0_not_nan(unchanged_machine):
    base = tempfile.mkdtemp()
    try:  # unconfined, the probe really leaves a 1,500-deep directory
        assert run_on_host(DEEP_TMP.replace("'/tmp'", repr(base))) == "False\n1500\n"
        deepest = subprocess.run(["find", base, "-mindepth", "1500", "-type", "d"], text=True,
                                 capture_output=True, check=True).stdout
        assert deepest.count("\n") == 1
    finally:
        subprocess.run(["rm", "-rf", base], check=True)  # shutil.rmtree recurses past its limit
    tests = json.dumps({"inputs": ["21\n", "21\n", "21\n"], "outputs": ["42\n"] * 3})
    assert passrate(DEEP_TMP, tests) == 0.0  # a wrong answer on each of 3 runs, not NaN
    # every run starts with a new /tmp: none sees the directory of the run before
    results = run_program({"p.py": DEEP_TMP}, [{"argv": [sys.executable, "-I", "p.py"]}] * 3,
                          Limits(**LIMITS))
    assert [r.stdout for r in results] == ["False\n1500\n"] * 3


def test_a_message_queue_does_not_outlive_its_test_run(unchanged_machine):
    key = random.randrange(1 << 20, 1 << 30)
    probe = (
        "import ctypes, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"queue = libc.msgget({key}, 0o1600)  # IPC_CREAT | 0600\n"
        "if sys.stdin.readline().strip() == 'send':\n"
        "    message = ctypes.create_string_buffer(b'\\1' + bytes(7) + b'hello', 13)  # mtype 1\n"
        "    print('sent' if libc.msgsnd(queue, message, ctypes.c_size_t(5), 0o4000) == 0 else 'no')\n"
        "else:\n"
        "    buffer = ctypes.create_string_buffer(8 + 64)\n"
        "    n = libc.msgrcv(queue, buffer, ctypes.c_size_t(64), ctypes.c_long(0), 0o4000)\n"
        "    print(buffer.raw[8:8 + n].decode() if n > 0 else 'nothing')"
    )
    libc = ctypes.CDLL(None, use_errno=True)
    try:  # unconfined, a message sent by one run is received by the next
        on_host = [subprocess.run([sys.executable, "-I", "-c", probe], input=word, text=True,
                                  capture_output=True, timeout=30).stdout for word in ("send\n", "receive\n")]
    finally:
        libc.msgctl(libc.msgget(key, 0), 0, None)  # IPC_RMID
    assert on_host == ["sent\n", "hello\n"]
    # in the sandbox every test run has its own IPC namespace: test 1 passes (it only sends),
    # test 2 would need run 1's message and finds nothing: 1 of 2 = 0.5 (1.0 if it leaked)
    tests = json.dumps({"inputs": ["send\n", "receive\n"], "outputs": ["sent\n", "hello\n"]})
    assert passrate(probe, tests) == 0.5


def test_the_trainers_session_keyring_is_out_of_reach(unchanged_machine):
    # a subprocess with a session keyring of its own (never the machine's) holds a secret
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("keyring_probe.py")),
                           json.dumps(LIMITS)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    if "skip" in report:
        pytest.skip(report["skip"])
    # unconfined, the probe reads the secret, adds a key and clears the keyring
    assert report["host_stdout"] == report["secret"] + "\n"
    assert "add_key -1" not in report["host_stderr"] and report["after_host"] == []
    # in the sandbox it reads nothing (pass rate 0, not NaN) and the keyring is as it was:
    # the secret alone, intact
    assert report["score"] == 0.0
    assert report["after_sandbox"] == [report["serial"]] and report["payload"] == report["secret"]


#: small pure-Python packages often found in a system's dist-packages, tried first
PURE_PYTHON = ("yaml", "six", "toml", "distro", "idna", "certifi", "chardet", "pyparsing", "jwt")


def _system_packages() -> list[tuple[str, str]]:
    """Up to 5 (folder, module) in the system's site/dist-packages folders (Debian's
    /usr/lib/python3/dist-packages, say), which this interpreter does not use."""
    folders = sorted({os.path.realpath(folder) for root in sandbox.SYSTEM_DIRS
                      for pattern in ("python*/*-packages", "lib*/python*/*-packages",
                                      "local/lib*/python*/*-packages")
                      for folder in glob.glob(os.path.join(root, pattern))})
    found = []
    for folder in folders:
        for entry in sorted(os.listdir(folder)):
            name = entry.removesuffix(".py")
            if name.isidentifier() and not name.startswith("_") and (
                    os.path.isfile(os.path.join(folder, entry, "__init__.py")) or entry.endswith(".py")):
                found.append((folder, name))
    rank = {name: i for i, name in enumerate(PURE_PYTHON)}
    return sorted(found, key=lambda item: rank.get(item[1], len(rank)))[:5]


def test_every_site_packages_is_hidden_whatever_the_prefix(unchanged_machine):
    candidates = _system_packages()
    if not candidates:
        pytest.skip("no package in a system site/dist-packages folder on this machine")
    probe = (
        "import os, subprocess, sys\n"
        f"for folder, name in {candidates!r}:\n"
        "    sys.path.insert(0, folder)\n"
        "    try:\n"
        "        __import__(name)\n"
        "        print('imported', name)\n"
        "        break\n"
        "    except Exception:\n"
        "        sys.path.remove(folder)\n"
        "if os.path.exists('/usr/bin/python3'):  # the system's own interpreter, its own path\n"
        f"    for _, name in {candidates!r}:\n"
        "        if subprocess.run(['/usr/bin/python3', '-c', f'import {name}'],\n"
        "                          capture_output=True).returncode == 0:\n"
        "            print('system python imported', name)\n"
        "            break"
    )
    on_host = run_on_host(probe)
    if not on_host:
        pytest.skip(f"none of {candidates} imports here, even unconfined")
    assert on_host.startswith("imported ")  # unconfined, the system's packages are there
    tests = json.dumps({"inputs": [""], "outputs": [on_host]})
    assert passrate(probe, tests) == 0.0  # in the sandbox neither way finds one
    (r,) = run_alone(probe)
    assert r.ok and r.stdout == ""


REACH = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "for name, number, args in CALLS:\n"
    "    ret = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args])\n"
    "    print(name, 'ENOSYS' if ret == -1 and ctypes.get_errno() == 38 else 'reached')"
)


def _calls(args_by_name: dict) -> list:
    """(name, number, args) of calls of _sandbox_init.DENIED on this machine."""
    column = _sandbox_init.ARCHES[os.uname().machine][0]
    return [(name, _sandbox_init.DENIED[name][column], args) for name, args in args_by_name.items()
            if _sandbox_init.DENIED[name][column] is not None]


#: name: ((x86_64, aarch64) number, arguments no kernel accepts, so that the unconfined half
#: (root, on this machine) does nothing: an errno other than ENOSYS shows the kernel was reached)
REACHABLE = {"io_uring_setup": ((425, 425), (0, 0)), "bpf": ((321, 280), (-1, 0, 0)),
             "perf_event_open": ((298, 241), (0, 0, -1, -1, 0)), "userfaultfd": ((323, 282), (-1,)),
             "keyctl": ((250, 219), (-1,)), "ptrace": ((101, 117), (-1, -1)),
             "process_vm_readv": ((310, 270), (-1, 0, 0, 0, 0, 0))}


def test_seccomp_denies_what_a_test_program_never_needs(unchanged_machine):
    column = {"x86_64": 0, "aarch64": 1}[os.uname().machine]
    calls = [(name, numbers[column], args) for name, (numbers, args) in REACHABLE.items()]
    probe = f"CALLS = {calls!r}\n" + REACH
    on_host = run_on_host(probe)
    missing = [line.split()[0] for line in on_host.splitlines() if line.endswith("ENOSYS")]
    if {"io_uring_setup", "bpf"} & set(missing):
        pytest.skip(f"this kernel has no {missing}: the unconfined half cannot show them")
    assert on_host == "".join(f"{name} reached\n" for name in REACHABLE if name not in missing)
    assert passrate(probe, json.dumps({"inputs": [""], "outputs": [on_host]})) == 0.0
    # every call of the list, with arguments that are harmless anyway for an unprivileged
    # process, is refused with ENOSYS; the calls of another ABI too (x32), others still work
    listed = _calls({name: (-1,) * 6 for name in _sandbox_init.DENIED})
    everything = f"CALLS = {listed!r}\n" + REACH
    if os.uname().machine == "x86_64":
        everything += "\nprint('x32 getpid', libc.syscall(0x40000000 | 39), ctypes.get_errno())"
    everything += "\nprint('getpid', libc.syscall(39 if os.uname().machine == 'x86_64' else 172) > 0)"
    (r,) = run_alone(everything)
    lines = r.stdout.splitlines()
    assert lines[:len(listed)] == [f"{name} ENOSYS" for name, _, _ in listed]
    assert lines[len(listed):] == (["x32 getpid -1 38"] if os.uname().machine == "x86_64" else []) + [
        "getpid True"]


def test_ordinary_programs_still_work_under_the_filter(unchanged_machine):
    program = (
        "import asyncio, concurrent.futures, json, mmap, multiprocessing, os, socket, subprocess, sys\n"
        "def square(x):\n"
        "    return x * x\n"
        "async def later():\n"
        "    await asyncio.sleep(0.01)\n"
        "    return 42\n"
        "if __name__ == '__main__':\n"
        "    with multiprocessing.Pool(2) as pool:\n"
        "        processes = pool.map(square, range(4))\n"
        "    with concurrent.futures.ThreadPoolExecutor(2) as threads:\n"
        "        threaded = list(threads.map(square, range(4)))\n"
        "    shared = mmap.mmap(-1, 4096)\n"
        "    shared[:2] = b'ok'\n"
        "    a, b = socket.socketpair()\n"
        "    a.send(b'x')\n"
        "    child = subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True, text=True)\n"
        "    print(json.dumps([processes, threaded, asyncio.run(later()), shared[:2].decode(),\n"
        "                      b.recv(1).decode(), child.stdout, os.cpu_count() > 0]))"
    )
    (r,) = run_alone(program)
    assert r.ok, r.stderr
    assert json.loads(r.stdout) == [[0, 1, 4, 9], [0, 1, 4, 9], 42, "ok", "x", "7\n", True]


# the verdict itself, whatever ends a call: the init is made to break on request
# (dying_sandbox_init.py) where no program can make it break any more

def test_a_call_that_breaks_after_the_program_started_is_the_programs_failure(unchanged_machine, monkeypatch):
    monkeypatch.setattr(sandbox, "INIT", Path(__file__).with_name("dying_sandbox_init.py"))
    argv = [sys.executable, "-I", "main.py"]

    def call(*stdins, **limits):
        return run_program({"main.py": HONEST}, [{"argv": argv, "stdin": s} for s in stdins],
                           Limits(**{**LIMITS, **limits}))

    # the init dies while run 1's program runs: run 1 is aborted (not ok), run 0 keeps its
    # result, and run 2 is run in a fresh sandbox
    first, broken, rest = call("21\n", "crash-during", "21\n")
    assert first.ok and first.stdout == "42\n" and first.aborted is None
    assert not broken.ok and "the init broke while the program ran" in broken.aborted
    assert rest.ok and rest.stdout == "42\n"
    # it dies before run 1 starts, after run 0's program ran: the program's too
    first, broken, rest = call("21\n", "crash-before", "21\n")
    assert first.ok and broken.aborted and not broken.ok and rest.ok
    # it hangs: the call's time bound (total_s) ends it, the run in progress is aborted
    (hung,) = call("hang-during", wall_s=0.5)
    assert "did not finish" in hung.aborted
    # before the program's first run starts, it is the sandbox's failure: NaN upstream
    with pytest.raises(SandboxUnavailable, match="the init broke before the program started"):
        call("crash-before", "21\n")
    with pytest.raises(SandboxUnavailable, match="No such file"):  # the exec itself fails
        run_program({"main.py": HONEST}, [{"argv": ["/nonexistent/python3", "main.py"]}],
                    Limits(**LIMITS))
    # scored: the aborted test fails (1 of 2 = 0.5), a limit kill, not a bug (1; 0 with
    # timeouts_are_bugs); never NaN
    tests = json.dumps({"inputs": ["21\n", "crash-during\n"], "outputs": ["42\n", "42\n"]})
    scores = [rewards.get(name, **LIMITS, **params)(["p"], [HONEST], ground_truth=[tests])[0]
              for name, params in (("code_passrate", {}), ("code_bug", {}),
                                   ("code_bug", {"timeouts_are_bugs": True}))]
    assert scores == [0.5, 1.0, 0.0]


def test_a_program_that_is_not_utf8_fails_as_a_program(unchanged_machine):
    # a lone surrogate (from a completions file, say) is written as is: a SyntaxError of the
    # program (pass rate 0, a bug), not a failure of the sandbox (NaN)
    program = "print('\ud800 ' + str(int(input()) * 2))"
    assert passrate(program) == 0.0
    assert rewards.get("code_bug", **LIMITS)(["p"], [program], ground_truth=[TESTS]) == [0.0]


def test_a_result_nested_past_the_recursion_limit_scores_0_not_nan(unchanged_machine):
    # a call-based program prints the harness's result mark itself, then 100,000 nested lists:
    # decoding it on the host would exceed the recursion limit; it is simply a wrong answer
    tests = json.dumps({"inputs": [[1]], "outputs": [1], "fn_name": "f"})
    program = ("import os, sys\n"
               f"sys.stdout.write('\\n' + {code._RESULT_MARK!r} + '[' * 100000 + ']' * 100000)\n"
               "sys.stdout.flush()\n"
               "os._exit(0)")
    (r,) = run_program({"main.py": program}, [{"argv": [sys.executable, "-I", "main.py"]}],
                       Limits(**LIMITS))
    with pytest.raises(RecursionError):  # what scoring it used to meet
        json.loads(r.stdout.rsplit(code._RESULT_MARK, 1)[1])
    assert passrate(program, tests) == 0.0
    assert rewards.get("code_bug", **LIMITS)(["p"], [program], ground_truth=[tests]) == [1.0]


def test_has_error_counts_an_aborted_run_as_a_limit():
    aborted = sandbox.RunResult(None, None, False, False, "", "", 0.0, aborted="init killed")
    assert not aborted.ok
    assert code.has_error(aborted) is False and code.has_error(aborted, timeouts_are_bugs=True)
