"""Code rewards of the paper's §4.3: test-case pass rate and bug-free execution.

The program is the last fenced code block of the completion (the whole completion if there is
none). Ground truth is JSON ``{"inputs": [...], "outputs": [...], "fn_name": optional}``:
without ``fn_name`` each input is the program's stdin and each output its expected stdout; with
it, each input is the list of arguments of ``fn_name`` (a function, or a method of class
``Solution``) and each output its expected return value.

Every run happens in ``gdpo_ray.rewards.sandbox``. A program that fails, crashes, loops, hits a
limit or attacks the sandbox has failed its test cases (pass rate counts them, bug = 0); only a
failure of the sandbox itself makes the reward NaN (``SandboxUnavailable`` propagates and the
reward runtime records it).
"""

from __future__ import annotations

import json
import re
import sys
from collections import OrderedDict
from typing import Any

from gdpo_ray.rewards.sandbox import Limits, RunResult, run_program

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_RESULT_MARK = "\x1e__gdpo_result__"

# Runs a call-based test: the solution is imported as a module, the arguments come on stdin.
_HARNESS = f"""\
import json, sys
sys.setrecursionlimit(10000)
args = json.loads(sys.stdin.read())
namespace = {{"__name__": "solution"}}
exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
name = sys.argv[1]
fn = namespace.get(name)
if fn is None and "Solution" in namespace:
    fn = getattr(namespace["Solution"](), name)
result = fn(*args)
sys.stdout.write("\\n" + {_RESULT_MARK!r} + json.dumps(result))
"""


def extract_program(completion: str) -> str:
    """The last fenced code block (```python ... ```), or the whole completion if none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1][1] if blocks else completion


def parse_tests(ground_truth: Any) -> dict:
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(tests, dict) or not isinstance(tests.get("inputs"), list) or not isinstance(
        tests.get("outputs"), list
    ):
        raise ValueError(
            'code ground_truth must be JSON {"inputs": [...], "outputs": [...], "fn_name": '
            f"optional}}; got {str(ground_truth)[:200]!r}"
        )
    if len(tests["inputs"]) != len(tests["outputs"]):
        raise ValueError(
            f"code ground_truth has {len(tests['inputs'])} inputs but {len(tests['outputs'])} outputs"
        )
    return tests


def stdout_matches(got: str, expected: Any) -> bool:
    """Equal after trimming trailing whitespace of every line and trailing blank lines, or equal
    as whitespace-separated tokens."""
    expected = "\n".join(expected) if isinstance(expected, list) else str(expected)

    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip("\n").splitlines()]

    return lines(got) == lines(expected) or got.split() == expected.split()


def call_matches(result: RunResult, expected: Any) -> bool:
    if not result.ok or _RESULT_MARK not in result.stdout:
        return False
    try:
        value = json.loads(result.stdout.rsplit(_RESULT_MARK, 1)[1])
    except ValueError:
        return False
    expected = json.loads(json.dumps(expected))  # tuples -> lists, as the program's JSON
    # APPS-style ground truth often wraps the return value in a list
    return value == expected or (isinstance(expected, list) and len(expected) == 1
                                 and value == expected[0])


class _Executions:
    """Last results per (program, tests, limits), so code_passrate and code_bug of one rollout
    run the program once when scored in the same worker."""

    def __init__(self, size: int = 256) -> None:
        self.size, self.items = size, OrderedDict()

    def run(self, program: str, tests: dict, limits: Limits) -> list[tuple[RunResult, Any]]:
        key = (program, json.dumps(tests, sort_keys=True), limits)
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        fn_name = tests.get("fn_name")
        if fn_name:
            files = {"solution.py": program, "harness.py": _HARNESS}
            runs = [{"argv": [sys.executable, "-I", "harness.py", fn_name],
                     "stdin": json.dumps(args if isinstance(args, list) else [args])}
                    for args in tests["inputs"]]
        else:
            files = {"main.py": program}
            stdins = tests["inputs"] or [""]  # no tests: one run on empty stdin (for code_bug)
            runs = [{"argv": [sys.executable, "-I", "main.py"],
                     "stdin": "\n".join(s) if isinstance(s, list) else str(s)} for s in stdins]
        results = run_program(files, runs, limits)
        value = list(zip(results, tests["outputs"] or [None] * len(results)))
        self.items[key] = value
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


_EXECUTIONS = _Executions()


def _tests(truth: Any, max_tests: int) -> dict:
    tests = parse_tests(truth)
    return {**tests, "inputs": tests["inputs"][:max_tests], "outputs": tests["outputs"][:max_tests]}


def code_passrate(max_tests: int = 32, **limits: Any):
    """Fraction of test cases whose output matches, in [0, 1] (the first ``max_tests`` cases).
    Other keywords: sandbox ``Limits``."""
    limits_ = Limits(**limits)

    def code_passrate(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        out = []
        for completion, truth in zip(completions, ground_truth):
            tests = _tests(truth, max_tests)
            if not tests["inputs"]:
                raise ValueError("code_passrate needs at least one test case in ground_truth")
            runs = _EXECUTIONS.run(extract_program(completion), tests, limits_)
            if tests.get("fn_name"):
                passed = sum(call_matches(r, e) for r, e in runs)
            else:
                passed = sum(r.ok and stdout_matches(r.stdout, e) for r, e in runs)
            out.append(passed / len(runs))
        return out

    code_passrate.min_timeout_s = limits_.total_s(max_tests)
    return code_passrate


def code_bug(max_tests: int = 32, **limits: Any):
    """1 if every run ends without compile error, runtime error, timeout or limit kill, else 0
    (wrong answers are not bugs; without test cases the program runs once on empty stdin).
    The first ``max_tests`` cases run; other keywords: sandbox ``Limits``."""
    limits_ = Limits(**limits)

    def code_bug(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        return [
            float(all(r.ok for r, _ in _EXECUTIONS.run(extract_program(c), _tests(t, max_tests),
                                                          limits_)))
            for c, t in zip(completions, ground_truth)
        ]

    code_bug.min_timeout_s = limits_.total_s(max_tests)
    return code_bug
