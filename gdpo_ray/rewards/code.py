"""Code rewards of the paper's §4.3: test-case pass rate and bug-free execution.

The program (``extract_program``) is the last fenced code block tagged ``python``, ``py`` or
``python3`` (any case); if there is none, the last untagged block (```` ``` ```` alone); if there
is none either, the last block of any other language; with no fenced block at all, the whole
completion. So an untagged or ```` ```text ```` example after the solution is not graded
instead of it. With ``after_tag`` (say ``"</think>"``) only the text after the last occurrence
of the tag is searched, and a completion without the tag has no program at all.

Ground truth is JSON ``{"inputs": [...], "outputs": [...], "fn_name": optional}``: without
``fn_name`` each input is the program's stdin and each output its expected stdout; with it,
each input is the list of arguments of ``fn_name`` (a function, or a method of class
``Solution``) and each output its expected return value (compared as JSON, see ``_plain``).

Every run happens in ``gdpo_ray.rewards.sandbox``. A program that fails, crashes, loops, hits a
limit or attacks the sandbox has failed its test cases; whether it has a bug is ``has_error``.
Only a failure of the sandbox before the program started makes the reward NaN:
``SandboxUnavailable`` is raised as a ``RewardInfraError``, which the reward pool retries and
then records as an ``infra`` failure. Once the program has started, whatever ends the sandbox
call early is the program's doing (``RunResult.aborted``): the run fails its test, as a limit
kill does.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from collections import OrderedDict
from typing import Any

from gdpo_ray.rewards.adapters import RewardInfraError, completion_text
from gdpo_ray.rewards.math_answer import after_last
from gdpo_ray.rewards.sandbox import Limits, RunResult, SandboxUnavailable, run_program

SIGKILL, SIGXCPU = 9, 24

_TAG = re.compile(r"[ \t]*([\w+#.-]*)")
_RESULT_MARK = "\x1e__gdpo_result__"

_PYTHON_TAGS = {"python", "py", "python3"}


def _plain(value):
    """``value`` as data ``json.dumps`` encodes: tuples and lists -> lists, sets -> lists (sorted
    when their elements are sortable, else in iteration order), dict keys json cannot take ->
    their repr, objects with ``tolist`` (numpy) -> that, anything else -> its repr string.
    (Runs inside the call harness: builtins only.)"""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        try:
            items = sorted(value)
        except TypeError:
            items = list(value)
        return [_plain(v) for v in items]
    if isinstance(value, dict):
        return {k if k is None or isinstance(k, (bool, int, float, str)) else repr(k): _plain(v)
                for k, v in value.items()}
    if callable(getattr(value, "tolist", None)):
        return _plain(value.tolist())
    return repr(value)


# Runs a call-based test: the solution is imported as a module, the arguments come on stdin.
_HARNESS = f"""\
import json, sys
sys.setrecursionlimit(10000)
if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)  # a huge int result is encoded, not a harness error
{inspect.getsource(_plain)}
args = json.loads(sys.stdin.read())
namespace = {{"__name__": "solution"}}
exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
name = sys.argv[1]
fn = namespace.get(name)
if fn is None and isinstance(namespace.get("Solution"), type):
    fn = getattr(namespace["Solution"](), name, None)
if not callable(fn):
    raise NameError(f"the solution defines no function {{name!r}} (nor a method {{name!r}} of "
                    "class Solution); define it with that name")
result = fn(*args)
try:
    encoded = json.dumps(_plain(result))
except (RecursionError, ValueError):  # a cyclic value, or nested past the recursion limit
    encoded = json.dumps(repr(result))
sys.stdout.write("\\n" + {_RESULT_MARK!r} + encoded)
"""


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(tag, code) of every fenced block: what ``re.findall(r"```[ \\t]*([\\w+#.-]*)[^\\n]*\\n(.*?)```",
    text, re.DOTALL)`` finds, in one linear pass (that regex retries at every backtick of a text
    without a closing line: quadratic in its length)."""
    out, i = [], 0
    while True:
        i = text.find("```", i)
        if i < 0:
            return out
        newline = text.find("\n", i + 3)
        if newline < 0:  # no fence can open a line anywhere after here
            return out
        end = text.find("```", newline + 1)
        if end < 0:  # no fence after here can close either
            return out
        out.append((_TAG.match(text, i + 3, newline).group(1), text[newline + 1:end]))
        i = end + 3


def extract_program(completion: str, after_tag: str | None = None) -> str | None:
    """The program of a completion (the module docstring's rule); None when ``after_tag`` is
    given and missing."""
    if after_tag:
        completion = after_last(completion, after_tag)
        if completion is None:
            return None
    blocks = fenced_blocks(completion)
    python = [code for tag, code in blocks if tag.lower() in _PYTHON_TAGS]
    untagged = [code for tag, code in blocks if not tag]
    chosen = python or untagged or [code for _, code in blocks]
    return chosen[-1] if chosen else completion


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


#: how a call-based test compares the returned value (after a JSON round trip: tuples and sets
#: are lists, dict keys strings) with the expected one
EQUALITY = ("python", "strict")


def same_typed(a: Any, b: Any) -> bool:
    """Equal with equal JSON types all the way down: True != 1, 1.0 != 1, [5] != 5."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_typed(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_typed(a[k], b[k]) for k in a)
    return a == b


def call_matches(result: RunResult, expected: Any, equality: str = "python") -> bool:
    """Whether a call-based run returned ``expected``. ``equality="python"`` (APPS's and
    PRIME's grader, which Eurus-2-RL uses): Python ``==`` (``True == 1``, ``1.0 == 1``), and an
    expected one-element list also accepts its element (``5`` for ``[5]``, the usual wrapping
    of APPS outputs). ``"strict"``: ``same_typed``, no unwrapping."""
    if not result.ok or _RESULT_MARK not in result.stdout:
        return False
    expected = json.loads(json.dumps(expected))  # tuples -> lists, as the program's JSON
    try:  # what the program printed: not JSON, or nested past the recursion limit, is no answer
        value = json.loads(result.stdout.rsplit(_RESULT_MARK, 1)[1])
        if equality == "strict":
            return same_typed(value, expected)
        return value == expected or (isinstance(expected, list) and len(expected) == 1
                                     and value == expected[0])
    except (ValueError, RecursionError):
        return False


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
        try:
            results = run_program(files, runs, limits)
        except SandboxUnavailable as err:  # the infrastructure, not the program: retried, then NaN
            raise RewardInfraError(f"code sandbox unavailable: {err}") from err
        value = list(zip(results, tests["outputs"] or [None] * len(results)))
        self.items[key] = value
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


_EXECUTIONS = _Executions()


def _tests(truth: Any, max_tests: int) -> dict:
    tests = parse_tests(truth)
    return {**tests, "inputs": tests["inputs"][:max_tests], "outputs": tests["outputs"][:max_tests]}


def has_error(result: RunResult, timeouts_are_bugs: bool = False) -> bool:
    """Whether a run is a bug: a compile or runtime error (non-zero exit, a Python traceback,
    MemoryError and RecursionError included) or a crash signal (SIGSEGV, SIGABRT, ...).

    Not a bug unless ``timeouts_are_bugs`` (the paper counts only runtime and compilation
    errors): a wall timeout (``timed_out``: the sandbox stops waiting, no exit status), too much
    output (``output_exceeded``), a CPU-time or memory kill (RLIMIT_CPU with soft = hard limit
    and the call's OOM killer send SIGKILL; SIGXCPU where the soft limit is lower), or a sandbox
    call the program ended early (``aborted``: a limit of the call, never NaN). With
    ``timeouts_are_bugs`` every run that is not ``RunResult.ok`` is a bug."""
    if timeouts_are_bugs:
        return not result.ok
    if result.timed_out or result.output_exceeded or result.aborted:
        return False
    if result.signal is not None:
        return result.signal not in (SIGKILL, SIGXCPU)
    return result.exit_code != 0


def code_passrate(max_tests: int = 32, after_tag: str | None = None, equality: str = "python",
                  **limits: Any):
    """Fraction of test cases whose output matches, in [0, 1] (the first ``max_tests`` cases).

    ``after_tag`` (say "</think>"): the program comes from the text after the tag's last
    occurrence; a completion without the tag scores 0 (nothing runs). An empty program: on a
    stdin task it prints nothing, so it passes only cases whose expected output is empty; on a
    call-based task the function is missing, 0. ``equality``: how call-based results compare
    (``call_matches``: "python", as APPS/PRIME grade, or "strict"). Other keywords: sandbox
    ``Limits``."""
    if equality not in EQUALITY:
        raise ValueError(f"code_passrate: equality must be one of {EQUALITY}; got {equality!r}")
    limits_ = Limits(**limits)

    def code_passrate(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        out = []
        for completion, truth in zip(completions, ground_truth):
            tests = _tests(truth, max_tests)
            if not tests["inputs"]:
                raise ValueError("code_passrate needs at least one test case in ground_truth")
            program = extract_program(completion_text(completion), after_tag)
            if program is None:
                out.append(0.0)
                continue
            runs = _EXECUTIONS.run(program, tests, limits_)
            if tests.get("fn_name"):
                passed = sum(call_matches(r, e, equality) for r, e in runs)
            else:
                passed = sum(r.ok and stdout_matches(r.stdout, e) for r, e in runs)
            out.append(passed / len(runs))
        return out

    code_passrate.min_timeout_s = limits_.total_s(max_tests)
    return code_passrate


def code_bug(max_tests: int = 32, timeouts_are_bugs: bool = False, after_tag: str | None = None,
             **limits: Any):
    """R_bug: 1 if no run of the first ``max_tests`` cases has an error (``has_error``: compile
    or runtime error or crash; timeouts and limit kills only with ``timeouts_are_bugs``), else 0.
    Wrong answers are not bugs; without test cases a stdin program runs once on empty stdin.

    ``after_tag`` (say "</think>"): the program comes from the text after the tag's last
    occurrence; a completion without the tag has no program and scores 0 (an unfinished answer
    earns nothing, as in code_passrate). An empty program: on a stdin task it runs without
    error, 1; on a call-based task the function is missing (a NameError), 0.
    Other keywords: sandbox ``Limits``."""
    limits_ = Limits(**limits)

    def bug_free(completion: str, truth: Any) -> float:
        program = extract_program(completion, after_tag)
        if program is None:
            return 0.0
        runs = _EXECUTIONS.run(program, _tests(truth, max_tests), limits_)
        return float(not any(has_error(r, timeouts_are_bugs) for r, _ in runs))

    def code_bug(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        return [bug_free(completion_text(c), t) for c, t in zip(completions, ground_truth)]

    code_bug.min_timeout_s = limits_.total_s(max_tests)
    return code_bug
