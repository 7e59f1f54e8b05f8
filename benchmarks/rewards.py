"""Throughput of the built-in rewards on CPU, and what the code sandbox costs per program.

For each built-in: samples per second of the reward function called in this process on a batch
of typical samples (code rewards include their sandboxed runs). For the sandbox: the time of one
sandboxed run of a trivial program (``pass``) against a bare ``python -c pass`` subprocess of the
same interpreter, measured alternately in one run: ``sandbox_overhead_ratio`` (aim <= 2).

    python benchmarks/rewards.py [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    results: dict[str, float] = {}
    for name, (completions, columns) in samples(args.samples).items():
        n = args.samples if not name.startswith("code") else max(4, args.samples // 8)
        results[f"{name}_samples_per_s"] = throughput(
            name, completions[:n], {k: v[:n] for k, v in columns.items()})
    bare, boxed = sandbox_overhead(args.repeats)
    results["bare_python_ms"] = bare * 1e3
    results["sandboxed_python_ms"] = boxed * 1e3
    results["sandbox_overhead_ratio"] = boxed / bare
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in results.items()}))
        return
    print("Built-in rewards on CPU, one process (samples/s):")
    for key, value in results.items():
        if key.endswith("_samples_per_s"):
            print(f"  {key.removesuffix('_samples_per_s'):<20} {value:10.1f}")
    print(f"Sandbox: one run of `pass` {boxed * 1e3:.1f} ms vs bare `python -c pass` "
          f"{bare * 1e3:.1f} ms -> {boxed / bare:.2f}x (aim <= 2x)")


if __name__ == "__main__":
    main()
