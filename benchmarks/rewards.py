"""Throughput of the built-in rewards on CPU, and what the code sandbox costs per program.

For each built-in: samples per second of the reward function called in this process on a batch
of typical samples (code rewards include their sandboxed runs). For the sandbox: the time of one
sandboxed run of a trivial program (``pass``) against a bare ``python -c pass`` subprocess of the
same interpreter, measured alternately in one run: ``sandbox_overhead_ratio`` (aim <= 2). For
the scoring pool (``actors.reward.RewardPool``): its cost per call of a trivial reward against
the same calls in this process (``pool_call_overhead_ms``: the pipe round trip and bookkeeping,
near the physical limit of a pipe ping-pong between two processes, ``pipe_round_trip_ms``), and
the wall time of a call of ``score`` in which half the rows hang, in timeouts
(``hang_cost_in_timeouts``: aim about 1; one timeout after another would be the hanging rows'
count divided by the workers).

    python benchmarks/rewards.py [--json] [--samples 64] [--repeats 15] [--pool-rows 256] [--timeout-s 2] [--smoke]

``--smoke``: 8 samples, 2 sandboxed runs, 16 pool calls, a timeout of 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._smoke import parse_args  # noqa: E402
from gdpo_ray import rewards  # noqa: E402
from gdpo_ray.rewards.sandbox import Limits, run_program  # noqa: E402


def call(name, **params):
    return json.dumps({"name": name, "parameters": params})


def samples(n: int) -> dict[str, tuple[list[str], dict]]:
    tool_gold = "<think>g</think>\n<tool_call>\n" + call("search", q="ray", k=3) + "\n" + call(
        "weather", city="Paris") + "\n</tool_call>"
    tool_pred = "<think>I should search.</think>\n<tool_call>\n" + call("search", q="ray", k="3") + (
        "\n</tool_call>")
    code_gt = json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]})
    def code(i: int) -> str:  # distinct programs, so that no execution is reused
        return f"```python\na, b = map(int, input().split())\nprint(a + b)  # {i}\n```"

    return {
        "toolrl_format": ([tool_pred] * n, {"ground_truth": [tool_gold] * n}),
        "toolrl_correctness": ([tool_pred] * n, {"ground_truth": [tool_gold] * n}),
        "math_correctness": ([r"so the answer is \boxed{\frac{3}{4}}"] * n, {"ground_truth": ["0.75"] * n}),
        "length": (["x"] * n, {"response_length": list(range(n))}),
        "code_passrate": ([code(i) for i in range(n)], {"ground_truth": [code_gt] * n}),
        "code_bug": ([code(n + i) for i in range(n)], {"ground_truth": [code_gt] * n}),
    }


def throughput(name: str, completions: list[str], columns: dict) -> float:
    fn = rewards.get(name)
    fn([""], completions[:1], **{k: v[:1] for k, v in columns.items()})  # warm up (imports)
    start = time.perf_counter()
    fn([""] * len(completions), completions, **columns)
    return len(completions) / (time.perf_counter() - start)


def sandbox_overhead(repeats: int) -> tuple[float, float]:
    bare, boxed = [], []
    run = [{"argv": [sys.executable, "-I", "main.py"]}]
    for _ in range(repeats):  # alternate, so that machine noise hits both alike
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-c", "pass"], check=True)
        bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        (result,) = run_program({"main.py": "pass"}, run, Limits())
        boxed.append(time.perf_counter() - t0)
        assert result.ok, result
    return min(bare), min(boxed)


def pipe_round_trip(repeats: int = 2000) -> float:
    """Seconds of one small message there and back between two processes (the floor)."""
    import multiprocessing as mp

    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=_echo, args=(child,))
    proc.start()
    start = time.perf_counter()
    for _ in range(repeats):
        parent.send((0, {"completions": ["x"]}))
        parent.recv()
    elapsed = (time.perf_counter() - start) / repeats
    parent.send(None)
    proc.join()
    return elapsed


def _echo(conn) -> None:
    while (msg := conn.recv()) is not None:
        conn.send(msg)


def pool_costs(rows: int, timeout_s: float) -> tuple[float, float]:
    """(seconds per pool call of the `length` reward minus the in-process call, seconds of a
    score() call whose odd rows hang, in units of timeout_s)."""
    from actors.reward import RewardPool

    fn = rewards.get("length", limit=10)
    start = time.perf_counter()
    for i in range(rows):
        fn(prompts=[""], completions=["x"], response_length=[i])
    direct = (time.perf_counter() - start) / rows
    # one row per call (the default batches a score()'s rows into one call per worker): the cost
    # of a call, not of a row in a batch
    with RewardPool([{"name": "length", "params": {"limit": 10}}], num_workers=1, rows_per_call=1) as pool:
        pool.score([""], ["x"], {"response_length": [1]})  # workers started
        start = time.perf_counter()
        pool.score([""] * rows, ["x"] * rows, {"response_length": list(range(rows))})
        pooled = (time.perf_counter() - start) / rows
    hang = {"name": "hang", "fn": "benchmarks.rewards:sleep_on_odd", "timeout_s": timeout_s}
    with RewardPool([hang], num_workers=1, rows_per_call=1) as pool:
        pool.score([""], ["0"])
        start = time.perf_counter()
        pool.score([""] * 32, [str(i) for i in range(32)])
        hung = (time.perf_counter() - start) / timeout_s
    return pooled - direct, hung


def sleep_on_odd(completions, **kwargs):
    if int(completions[0]) % 2:
        time.sleep(3600)
    return [1.0 for _ in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15, help="sandboxed runs (and bare ones)")
    parser.add_argument("--pool-rows", type=int, default=256, help="calls through the scoring pool")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="the hanging reward's timeout")
    args = parse_args(parser, {"samples": 8, "repeats": 2, "pool_rows": 16, "timeout_s": 0.5})

    results: dict[str, float] = {}
    for name, (completions, columns) in samples(args.samples).items():
        n = args.samples if not name.startswith("code") else max(4, args.samples // 8)
        results[f"{name}_samples_per_s"] = throughput(
            name, completions[:n], {k: v[:n] for k, v in columns.items()})
    bare, boxed = sandbox_overhead(args.repeats)
    results["bare_python_ms"] = bare * 1e3
    results["sandboxed_python_ms"] = boxed * 1e3
    results["sandbox_overhead_ratio"] = boxed / bare
    overhead, hung = pool_costs(args.pool_rows, args.timeout_s)
    results["pool_call_overhead_ms"] = overhead * 1e3
    results["pipe_round_trip_ms"] = pipe_round_trip() * 1e3
    results["hang_cost_in_timeouts"] = hung
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in results.items()} | {"smoke": args.smoke}))
        return
    print("Built-in rewards on CPU, one process (samples/s):")
    for key, value in results.items():
        if key.endswith("_samples_per_s"):
            print(f"  {key.removesuffix('_samples_per_s'):<20} {value:10.1f}")
    print(f"Sandbox: one run of `pass` {boxed * 1e3:.1f} ms vs bare `python -c pass` "
          f"{bare * 1e3:.1f} ms -> {boxed / bare:.2f}x (aim <= 2x)")
    print(f"Scoring pool: {results['pool_call_overhead_ms']:.2f} ms per call over the call itself "
          f"(a pipe round trip between two processes: {results['pipe_round_trip_ms']:.3f} ms); "
          f"32 rows, 16 hanging, 1 worker: {hung:.2f} timeouts of wall time (one after another: 16)")


if __name__ == "__main__":
    main()
