"""Built-in synthetic tasks: prompt rows generated on the fly (no download).

A task is a function ``(n, seed) -> list[dict]`` of rows with a ``prompt`` and a
``ground_truth`` column, in the registry ``TASKS``. A config names one as ``task:<name>`` where it
would name a dataset path (``data.prompts``).

- ``addition`` (the CPU demo): "What is a + b?" for single digits a, b. The demo's rewards ask for
  ``<think>…</think><answer>…</answer>`` (format), the right sum (correctness) and, when the sum
  is right, a short response (the paper's conditioned length reward).
- ``arithmetic`` (the SmolLM2 math preset): small word problems with +, - and x on numbers up to
  50, answer in \\boxed{}.
- ``tool_calls`` (a stand-in for the ToolRL data of the ``toolrl`` preset): chat prompts whose
  system message lists tools as JSON schemas; the gold answer is ToolRL's text,
  ``<think>…</think>`` then one ``<tool_call>`` block with a JSON call per line, or a
  ``<response>`` when no tool fits.
- ``count`` (the math-with-a-length-limit study): "Count from a to b." for two-digit a and 2-7
  numbers; the answer is the numbers in order, space-separated, in ``<answer>`` (the
  ``exact_answer`` reward). The right answer's own length grows with the count, so a length
  limit can rule out every right answer to the longer counts (``gdpo_ray.models.demo_count``).
- ``tool_arithmetic`` (the ``agent`` preset, multi-turn): "What is 37 times 12?", "What is 37
  plus 12?" or "What is 37 times 12 plus 5?" (10-39, 2-19, then 1-9: every answer below 1,000);
  the answer is the number. ``steps`` (JSON) holds the gold calls, ``[["multiply", 37, 12], ["add",
  null, 5]]`` (null: the previous call's result), for the environment
  ``gdpo_ray.environments.arithmetic`` whose tools compute them.
- ``tool_arithmetic_demos``: demonstrations of ``tool_arithmetic`` (the gold calls, their
  answers, the answer) in TRL's conversational SFT layout, for ``gdpo-ray sft``;
- ``bfcl_multi_turn``: BFCL's multi-turn items that its eval does not hold out, for the
  ``bfcl_multi_turn`` environment (a BFCL multi-turn conversation per rollout);
- ``code`` (a stand-in for Eurus-2-RL of the ``code`` preset): small Python exercises with test
  cases in the PRIME/APPS layout, ``{"fn_name", "inputs", "outputs"}`` (call-based) or stdin/stdout.
"""

from __future__ import annotations

from typing import Any, Callable

import json

import numpy as np

from gdpo_ray.registry import Registry
from gdpo_ray.tool_format import tool_call_block

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


COUNT_INSTRUCTION = "Count from {a} to {b}."
#: the counts of ``count``: from 2 to 7 numbers
COUNT_SPANS = range(2, 8)


@TASKS.register("count")
def count(n: int = 300, seed: int = 0) -> list[dict[str, Any]]:
    """The 300 counts (start 10-59, 2-7 numbers) in a seeded order, repeated up to ``n`` rows."""
    items = [(a, k) for a in range(10, 60) for k in COUNT_SPANS]
    order = np.random.default_rng(seed).permutation(len(items))
    rows = []
    for i in range(n):
        a, k = items[order[i % len(items)]]
        rows.append({"id": f"count-{a}-{a + k - 1}-{i // len(items)}",
                     "prompt": COUNT_INSTRUCTION.format(a=a, b=a + k - 1),
                     "ground_truth": " ".join(str(x) for x in range(a, a + k))})
    return rows


_TOOLS = [
    {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
    {"name": "convert_currency", "description": "Convert an amount of money",
     "parameters": {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                    "to_currency": {"type": "string"}}},
    {"name": "set_timer", "description": "Start a countdown timer",
     "parameters": {"minutes": {"type": "integer"}}},
    {"name": "search_recipes", "description": "Find recipes with an ingredient",
     "parameters": {"ingredient": {"type": "string"}, "max_results": {"type": "integer"}}},
]
TOOL_SYSTEM = (
    "You can call these tools (JSON schemas, one per line):\n{tools}\n\n"
    "Answer in this format: first your reasoning in <think>...</think>, then on a new line either\n"
    "<tool_call>\n{{\"name\": <tool name>, \"parameters\": {{<arguments>}}}}\n</tool_call>\n"
    "with one JSON object per line for each call, or, if no tool fits the request,\n"
    "<response>your answer</response>"
)
_CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver"]
_CURRENCIES = ["USD", "EUR", "JPY", "GBP"]
_INGREDIENTS = ["lentils", "salmon", "tofu", "spinach", "mango"]


def _tool_request(rng: np.random.Generator) -> tuple[str, list[dict]]:
    """A user request and the gold calls (none: the answer is a plain response)."""
    kind = int(rng.integers(6))
    city, other = rng.choice(_CITIES, 2, replace=False)
    unit = str(rng.choice(["celsius", "fahrenheit"]))
    if kind == 0:
        return f"How warm is it in {city} right now, in {unit}?", [
            {"name": "get_weather", "parameters": {"city": str(city), "unit": unit}}]
    if kind == 1:
        return f"Compare the weather in {city} and {other}, both in {unit}.", [
            {"name": "get_weather", "parameters": {"city": str(c), "unit": unit}} for c in (city, other)]
    if kind == 2:
        amount = int(rng.integers(5, 500))
        a, b = (str(x) for x in rng.choice(_CURRENCIES, 2, replace=False))
        return f"How much is {amount} {a} in {b}?", [
            {"name": "convert_currency", "parameters": {"amount": amount, "from_currency": a, "to_currency": b}}]
    if kind == 3:
        minutes = int(rng.integers(1, 61))
        return f"Set a timer for {minutes} minutes.", [{"name": "set_timer", "parameters": {"minutes": minutes}}]
    if kind == 4:
        ingredient, k = str(rng.choice(_INGREDIENTS)), int(rng.integers(1, 6))
        return f"Find me {k} recipes that use {ingredient}.", [
            {"name": "search_recipes", "parameters": {"ingredient": ingredient, "max_results": k}}]
    return "Thanks, that is all for today!", []


@TASKS.register("tool_calls")
def tool_calls(n: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` tool-calling requests (single and parallel calls, and some with no fitting tool)."""
    rng = np.random.default_rng(seed)
    tools = "\n".join(json.dumps(t) for t in _TOOLS)
    rows = []
    for i in range(n):
        request, calls = _tool_request(rng)
        if calls:
            names = ", ".join(dict.fromkeys(c["name"] for c in calls))
            answer = (f"<think>The user's request needs {names}.</think>\n"
                      + tool_call_block([(c["name"], c["parameters"]) for c in calls], key="parameters"))
        else:
            answer = "<think>No tool is needed.</think>\n<response>You're welcome!</response>"
        rows.append({"id": f"tool-{i}", "ground_truth": answer, "prompt": [
            {"role": "system", "content": TOOL_SYSTEM.format(tools=tools)},
            {"role": "user", "content": request}]})
    return rows


def _arithmetic_request(rng: np.random.Generator) -> tuple[str, list[list], int]:
    """A question, its gold calls (null: the previous result) and its answer."""
    a, b = int(rng.integers(10, 40)), int(rng.integers(2, 20))
    kind = int(rng.integers(3))
    if kind == 0:
        return f"What is {a} times {b}?", [["multiply", a, b]], a * b
    if kind == 1:
        return f"What is {a} plus {b}?", [["add", a, b]], a + b
    c = int(rng.integers(1, 10))
    return f"What is {a} times {b} plus {c}?", [["multiply", a, b], ["add", None, c]], a * b + c


@TASKS.register("tool_arithmetic")
def tool_arithmetic(n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` questions a calculator's tools answer in one or two calls."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        question, steps, answer = _arithmetic_request(rng)
        rows.append({"id": f"calc-{i}", "prompt": [{"role": "user", "content": question}],
                     "ground_truth": str(answer), "steps": json.dumps(steps)})
    return rows


@TASKS.register("tool_arithmetic_demos")
def tool_arithmetic_demos(n: int = 256, seed: int = 1) -> list[dict[str, Any]]:
    """Demonstrations of ``tool_arithmetic`` in TRL's conversational SFT layout (``gdpo-ray sft``):
    ``messages``, the user's question, each gold call as an assistant turn with ``tool_calls``,
    the tool's answer as a ``tool`` message, then the answer in ``<answer>…</answer>``; with the
    task's ``id``, ``prompt`` and ``ground_truth`` (seed 1 by default, so the questions differ from
    the training prompts' seed-0 draw)."""
    out = []
    for row in tool_arithmetic(n, seed):
        messages, result = list(row["prompt"]), None
        for name, a, b in json.loads(row["steps"]):
            a = result if a is None else a
            call = {"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}
            result = a * b if name == "multiply" else a + b
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": name, "content": str(result)}]
        messages.append({"role": "assistant", "content": f"<answer>{row['ground_truth']}</answer>"})
        out.append({**row, "messages": messages})
    return out


@TASKS.register("bfcl_multi_turn")
def bfcl_multi_turn(n: int = 159, seed: int = 0) -> list[dict[str, Any]]:
    """BFCL's ``multi_turn_base`` training scenarios (those ``gdpo_ray.bfcl.data.
    is_held_out`` leaves in: 159 of 200), in a seeded order, repeated up to ``n`` rows: ``prompt``
    the first user turn, ``bfcl_entry`` the item with its ground truth (JSON) for the
    ``bfcl_multi_turn`` environment. Needs bfcl-eval's data (``pip install --no-deps
    bfcl-eval==2026.3.23``)."""
    from gdpo_ray.bfcl.data import is_held_out, load_category

    entries = [e for e in load_category("multi_turn_base") if not is_held_out(e["id"])]
    order = np.random.default_rng(seed).permutation(len(entries))
    rows = []
    for i in range(n):
        entry = entries[order[i % len(entries)]]
        rows.append({"id": f"{entry['id']}-{i // len(entries)}", "prompt": [dict(m) for m in entry["question"][0]],
                     "bfcl_entry": json.dumps(entry)})
    return rows


def _code_problem(rng: np.random.Generator) -> tuple[str, dict]:
    """A statement and its tests (PRIME/APPS layout)."""
    kind = int(rng.integers(5))
    if kind == 0:
        k = int(rng.integers(2, 10))
        xs = [int(x) for x in rng.integers(-50, 50, 4)]
        return (f"Write a function `scale_add(x)` that returns {k} * x + 1.",
                {"fn_name": "scale_add", "inputs": [[x] for x in xs], "outputs": [k * x + 1 for x in xs]})
    if kind == 1:
        c = str(rng.choice(list("aeiou")))
        words = ["banana", "education", "sky", "queue", "aardvark"]
        return (f"Write a function `count_char(s)` that returns how many times '{c}' occurs in s.",
                {"fn_name": "count_char", "inputs": [[w] for w in words], "outputs": [w.count(c) for w in words]})
    if kind == 2:
        a, b = (int(x) for x in rng.choice([2, 3, 5, 7], 2, replace=False))
        ns = [int(x) for x in rng.integers(1, 60, 4)]
        return (f"Write a function `sum_multiples(n)` that returns the sum of the numbers below n "
                f"that are divisible by {a} or {b}.",
                {"fn_name": "sum_multiples", "inputs": [[n] for n in ns],
                 "outputs": [sum(i for i in range(n) if i % a == 0 or i % b == 0) for n in ns]})
    if kind == 3:
        lists = [[int(x) for x in rng.integers(-9, 10, int(rng.integers(1, 6)))] for _ in range(4)]
        return ("Write a function `largest_gap(nums)` that returns the largest absolute difference "
                "between two neighbouring numbers of the list (0 for a list of one number).",
                {"fn_name": "largest_gap", "inputs": [[xs] for xs in lists],
                 "outputs": [max((abs(p - q) for p, q in zip(xs, xs[1:])), default=0) for xs in lists]})
    k = int(rng.integers(1, 10))
    pairs = [(int(a), int(b)) for a, b in rng.integers(0, 100, (4, 2))]
    return (f"Write a program that reads two integers a and b (one line, separated by a space) from "
            f"standard input and prints a * b + {k}.",
            {"inputs": [f"{a} {b}\n" for a, b in pairs], "outputs": [f"{a * b + k}\n" for a, b in pairs]})


@TASKS.register("code")
def code(n: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` small Python exercises (functions and stdin programs), four test cases each."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        statement, tests = _code_problem(rng)
        rows.append({"id": f"code-{i}", "ground_truth": json.dumps(tests),
                     "prompt": statement + " Answer with the code in one ```python block."})
    return rows


def task_rows(spec: str, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of ``task:<name>`` (``n`` rows if given, else the task's default)."""
    name = spec.removeprefix("task:")
    fn = TASKS.get(name)
    return fn(seed=seed) if n is None else fn(n, seed)
