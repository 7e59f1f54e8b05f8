"""Adversarial programs in the code sandbox: each ends within its limits, leaves the machine as
it was, and scores 0 in code_passrate (while an honest program scores 1)."""

import json
import os
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
from gdpo_ray.rewards import sandbox
from gdpo_ray.rewards.code import extract_program
from gdpo_ray.rewards.sandbox import Limits, SandboxUnavailable, run_program

try:
    sandbox.check_available()
except SandboxUnavailable as err:  # the real sandbox cannot run here: nothing to test against
    pytest.skip(f"code sandbox unavailable on this machine: {err}", allow_module_level=True)

LIMITS = dict(wall_s=1.5, cpu_s=2, memory_mb=256, processes=8, output_bytes=1 << 20)
MARKER = f"gdpo-sandbox-test-{uuid.uuid4().hex[:8]}"
# The honest program echoes stdin doubled; the ground truth has one test.
TESTS = json.dumps({"inputs": ["21\n"], "outputs": ["42\n"]})


def passrate(program: str, tests: str = TESTS, **limits) -> float:
    fn = rewards.get("code_passrate", **{**LIMITS, **limits})
    return fn(["p"], [f"```python\n{program}\n```"], ground_truth=[tests])[0]


def host_state():
    procs = subprocess.run(["pgrep", "-f", MARKER], capture_output=True, text=True).stdout.split()
    return {
        "tmp": sorted(os.listdir("/tmp")),
        "shm": sorted(os.listdir("/dev/shm")),
        "procs": [p for p in procs if int(p) != os.getpid()],
    }


@pytest.fixture
def unchanged_machine():
    before = host_state()
    start = time.monotonic()
    yield
    # a whole adversarial call stays within its bound (one run: wall + margins)
    assert time.monotonic() - start < Limits(**LIMITS).total_s(1) + 2
    assert host_state() == before


def test_honest_program_passes(unchanged_machine):
    assert passrate("print(int(input()) * 2)") == 1.0


ADVERSARIAL = {
    "infinite_loop": "while True:\n    pass",
    "sleep_forever": "import time\ntime.sleep(10**6)",
    "fork_bomb": (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass"
    ),
    "memory_bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 1024 * 1024))",
    "kill_parent": (
        "import os, signal\n"
        "for pid in (os.getppid(), 1, -1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(int(input()) * 3)"
    ),
    "setsid_escape": (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', '{MARKER}'])\n"
        "    os._exit(0)\n"
        "print(int(input()) * 3)"
    ),
    "output_flood": "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)",
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_program_scores_zero(name, unchanged_machine):
    assert passrate(ADVERSARIAL[name]) == 0.0


def test_writing_outside_its_directory(unchanged_machine, tmp_path):
    targets = [f"/tmp/{MARKER}", f"/dev/shm/{MARKER}", str(Path.cwd() / MARKER),
               str(tmp_path / MARKER), f"/root/{MARKER}"]
    program = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('pwned')\n"
        "    except OSError:\n"
        "        pass\n"
        "print(int(input()) * 3)"
    )
    assert passrate(program) == 0.0
    assert not any(os.path.exists(t) for t in targets)


def test_connecting_to_a_local_listener(unchanged_machine):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: _accept(server, accepted))
    thread.start()
    program = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'hello')\n"
        "print(int(input()) * 2)"
    )
    try:
        assert passrate(program) == 0.0
    finally:
        thread.join()
        server.close()
    assert accepted == []


def _accept(server, accepted):
    try:
        accepted.append(server.accept())
    except OSError:
        pass


def test_reading_the_parent_environment(unchanged_machine, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("GDPO_TEST_SECRET", secret)
    # the expected output is the secret: the program passes only if it can read it
    tests = json.dumps({"inputs": [""], "outputs": [secret + "\n"]})
    program = (
        "import os\n"
        "found = os.environ.get('GDPO_TEST_SECRET', '')\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\\0')\n"
        "    except OSError:\n"
        "        continue\n"
        "    for item in env:\n"
        "        if item.startswith(b'GDPO_TEST_SECRET='):\n"
        "            found = item.split(b'=', 1)[1].decode()\n"
        "print(found)"
    )
    assert passrate(program, tests) == 0.0


def test_sandbox_environment_is_empty_and_unprivileged():
    (r,) = run_program(
        {"main.py": "import os, json; print(json.dumps([dict(os.environ), os.getuid(), os.getpid(), os.getcwd()]))"},
        [{"argv": [sys.executable, "-I", "main.py"]}], Limits(**LIMITS),
    )
    env, uid, pid, cwd = json.loads(r.stdout)
    assert set(env) <= {"LC_CTYPE"}  # what Python itself sets (PEP 538), nothing inherited
    assert uid >= 200_000 and pid < 10 and cwd == "/tmp/work"


def test_extract_program():
    assert extract_program("text\n```python\na = 1\n```\nmore\n```py\nb = 2\n```\n") == "b = 2\n"
    assert extract_program("print(1)") == "print(1)"


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


def test_call_based_tests():
    tests = json.dumps({"inputs": [[1, 2], [3, 4]], "outputs": [3, [7]], "fn_name": "add"})
    pr = rewards.get("code_passrate", **LIMITS)
    programs = ["def add(a, b):\n    return a + b",
                "class Solution:\n    def add(self, a, b):\n        return a + b",
                "def add(a, b):\n    return a - b"]
    assert pr([""] * 3, programs, ground_truth=[tests] * 3) == [1.0, 1.0, 0.0]


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
