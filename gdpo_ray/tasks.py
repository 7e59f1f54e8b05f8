"""Built-in synthetic tasks: prompt rows generated on the fly (no download).

A task is a function ``(n, seed) -> list[dict]`` of rows with a ``prompt`` and a
``ground_truth`` column, in the registry ``TASKS``. A config names one as ``task:<name>`` where it
would name a dataset path (``data.prompts``).

- ``addition`` (the CPU demo): "What is a + b?" for single digits a, b. The demo's rewards ask for
  ``<think>…</think><answer>…</answer>`` (format), the right sum (correctness) and, when the sum
  is right, a short response (the paper's conditioned length reward).
- ``arithmetic`` (the SmolLM2 math preset): small word problems with +, - and x on numbers up to
  50, answer in \\boxed{}.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from gdpo_ray.registry import Registry

#: name -> fn(n, seed) -> rows
TASKS: Registry[Callable[[int, int], list[dict[str, Any]]]] = Registry("task")

ADDITION_INSTRUCTION = "What is {a} + {b}?"
#: the demo's format: a (short) thought, then the answer in tags
ADDITION_FORMAT = r"<think>[^<]*</think>\s*<answer>[^<]*</answer>"


@TASKS.register("addition")
def addition(n: int = 100, seed: int = 0) -> list[dict[str, Any]]:
    """All 100 single-digit sums (in a seeded order), repeated up to ``n`` rows."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    order = np.random.default_rng(seed).permutation(len(pairs))
    rows = []
    for i in range(n):
        a, b = pairs[order[i % len(pairs)]]
        rows.append({"id": f"add-{a}-{b}-{i // len(pairs)}",
                     "prompt": ADDITION_INSTRUCTION.format(a=a, b=b), "ground_truth": str(a + b)})
    return rows


_WORD_PROBLEMS = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", "+"),
    ("{name} had {a} marbles and gave away {b}. How many marbles are left?", "-"),
    ("A box holds {a} pens. How many pens are in {b} boxes?", "*"),
    ("What is {a} + {b}?", "+"),
    ("What is {a} - {b}?", "-"),
    ("What is {a} times {b}?", "*"),
]
_NAMES = ["Tom", "Ana", "Lee", "Sara", "Omar", "Mia"]


@TASKS.register("arithmetic")
def arithmetic(n: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` small word problems; the prompt asks for the answer in \\boxed{}."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        text, op = _WORD_PROBLEMS[int(rng.integers(len(_WORD_PROBLEMS)))]
        a, b = int(rng.integers(2, 51)), int(rng.integers(2, 13 if op == "*" else 51))
        if op == "-" and b > a:
            a, b = b, a
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = text.format(name=_NAMES[int(rng.integers(len(_NAMES)))], a=a, b=b)
        rows.append({"id": f"arith-{i}", "ground_truth": str(answer),
                     "prompt": question + " Put the final answer in \\boxed{}."})
    return rows


def task_rows(spec: str, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of ``task:<name>`` (``n`` rows if given, else the task's default)."""
    name = spec.removeprefix("task:")
    fn = TASKS.get(name)
    return fn(seed=seed) if n is None else fn(n, seed)
