"""The hostile-tools soak: the ``agent`` preset trained through the CLI against an environment
whose tools, on a share of the policy's calls, do what a call can make a tool do (raise
SystemExit or KeyboardInterrupt, return an int whose text cannot be made, hold the GIL in C
code, hang, end their process, return a value whose text never ends), while the run's process
tree is sampled. It shows that nothing a tool call does stops the run or grows without bound,
and that the run leaves no process behind.

    python benchmarks/soak_tools.py --steps 200 [--rate 0.3] [--json]

Prints the steps done, the killed calls (``rollout/tool_timeouts``) and the failed ones
(``rollout/tool_errors``) over the run, the largest process count, thread count and memory
(PSS) of the run's processes in its first and last quarters, and the processes still alive a
minute after it ended (named on stderr). ``--smoke``: 2 steps, a sample every 2 s. ``HostileArithmetic`` is the environment (the preset's calculator).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._smoke import parse_args  # noqa: E402
from gdpo_ray.environments.arithmetic import Arithmetic  # noqa: E402


class _NeverText:
    def __str__(self) -> str:
        while True:
            pass


def _crash() -> None:
    os._exit(3)


def _interrupt() -> None:
    raise KeyboardInterrupt


#: what a hostile call does
HOSTILE = {
    "exit": lambda: sys.exit(2),
    "interrupt": _interrupt,
    "huge": lambda: 10 ** 5000,
    "spin": lambda: sum(range(10 ** 13)),
    "hang": lambda: threading.Event().wait(),
    "crash": _crash,
    "endless": _NeverText,
}


class HostileArithmetic(Arithmetic):
    """The preset's calculator; each call is hostile with probability ``SOAK_RATE`` (env, 0.3),
    one of ``HOSTILE`` drawn at random."""

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return _maybe_hostile() or super().add(a, b)

    def multiply(self, a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return _maybe_hostile() or super().multiply(a, b)


def _maybe_hostile():
    if random.random() < float(os.environ.get("SOAK_RATE", "0.3")):
        return HOSTILE[random.choice(sorted(HOSTILE))]()
    return None


def _tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _sample(pids: list[int]) -> tuple[int, int, float]:
    """(processes, threads, PSS in MiB) of ``pids``."""
    threads, pss = 0, 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                threads += next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            continue
    return len(pids), threads, pss / 1024


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rate", type=float, default=0.3, help="the share of tool calls that are hostile")
    parser.add_argument("--tool-timeout", type=float, default=2.0)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples of the process tree")
    parser.add_argument("--json", action="store_true")
    args = parse_args(parser, {"steps": 2, "every": 2.0})
    out = Path(tempfile.mkdtemp(prefix="gdpo-soak-"))
    command = [sys.executable, "-m", "gdpo_ray", "train", "agent", f"run.steps={args.steps}",
               f"run.output_dir={out}", "run.name=soak", "data.tool_environment=benchmarks.soak_tools:HostileArithmetic",
               f"generation.tool_timeout={args.tool_timeout}"]
    env = {**os.environ, "SOAK_RATE": str(args.rate), "RAY_AUTH_MODE": "disabled"}
    start = time.perf_counter()
    run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(run.stdout), daemon=True)
    reader.start()
    samples, seen = [], set()
    while run.poll() is None:
        pids = _tree(run.pid)
        seen.update(pids)
        samples.append((time.perf_counter() - start, *_sample(pids)))
        time.sleep(args.every)
    reader.join(timeout=10)
    minutes = (time.perf_counter() - start) / 60
    deadline = time.monotonic() + 60  # Ray's own processes take a few seconds to end
    while (left := sorted(pid for pid in seen - {run.pid} if _alive(pid))) and time.monotonic() < deadline:
        time.sleep(1)
    steps = [json.loads(line) for line in (out / "soak" / "metrics.jsonl").read_text().splitlines()] \
        if (out / "soak" / "metrics.jsonl").is_file() else []
    quarter = max(1, len(samples) // 4)
    first, last = samples[:quarter], samples[-quarter:]
    result = {
        "steps": len(steps), "exit_code": run.returncode, "minutes": round(minutes, 1),
        "tool_calls_per_rollout": round(sum(s.get("rollout/tool_calls/mean", 0) for s in steps) / max(1, len(steps)), 2),
        "tool_timeouts": sum(s.get("rollout/tool_timeouts", 0) for s in steps),
        "tool_errors": sum(s.get("rollout/tool_errors", 0) for s in steps),
        "tool_success_first": steps[0].get("rewards/tool_success/mean") if steps else None,
        "tool_success_last": steps[-1].get("rewards/tool_success/mean") if steps else None,
        "max_processes_first_quarter": max(s[1] for s in first) if first else None,
        "max_processes_last_quarter": max(s[1] for s in last) if last else None,
        "max_threads_first_quarter": max(s[2] for s in first) if first else None,
        "max_threads_last_quarter": max(s[2] for s in last) if last else None,
        "max_pss_mib_first_quarter": round(max(s[3] for s in first)) if first else None,
        "max_pss_mib_last_quarter": round(max(s[3] for s in last)) if last else None,
        "processes_left": len(left), "smoke": args.smoke,
    }
    if run.returncode != 0 or left:
        print("".join(log[-60:]), file=sys.stderr)
        for pid in left[:10]:
            print(f"left: {pid} {_command(pid)}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:32s} {value}")
    sys.exit(0 if run.returncode == 0 and len(steps) == args.steps and not left else 1)


if __name__ == "__main__":
    main()
