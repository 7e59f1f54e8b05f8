"""The built-in synthetic tasks: seeded rows whose gold answers earn the top reward."""

import json
import re

import pytest

from gdpo_ray.rewards import get
from gdpo_ray.tasks import TOOL_SYSTEM, task_rows


@pytest.mark.parametrize("name", ["addition", "arithmetic", "count", "tool_calls", "code"])
def test_rows_are_seeded_and_ids_unique(name):
    rows = task_rows(f"task:{name}", 40, seed=3)
    assert rows == task_rows(f"task:{name}", 40, seed=3) != task_rows(f"task:{name}", 40, seed=4)
    assert len({r["id"] for r in rows}) == 40 and all(r["prompt"] and r["ground_truth"] for r in rows)


def test_counts_are_the_300_items_and_their_answers_are_the_numbers_in_order():
    rows = task_rows("task:count")
    assert len({r["prompt"] for r in rows}) == 300 == len(rows)
    row = next(r for r in rows if r["prompt"] == "Count from 23 to 27.")
    assert row["ground_truth"] == "23 24 25 26 27" and row["id"] == "count-23-27-0"
    spans = [len(r["ground_truth"].split()) for r in rows]
    assert sorted(set(spans)) == [2, 3, 4, 5, 6, 7] and all(spans.count(k) == 50 for k in range(2, 8))
    exact = get("exact_answer")
    golds = [r["ground_truth"] for r in rows]
    assert exact([None] * 300, [f"<answer>{g}</answer>" for g in golds], ground_truth=golds) == [1.0] * 300


def test_tool_call_gold_answers_score_the_maximum():
    rows = task_rows("task:tool_calls", 48)
    gold = [r["ground_truth"] for r in rows]
    fmt = get("toolrl_format")([""] * len(rows), gold, ground_truth=gold)
    correct = get("toolrl_correctness")([""] * len(rows), gold, ground_truth=gold)
    assert fmt == [1.0] * len(rows)
    has_calls = ["<tool_call>" in g for g in gold]
    assert {True, False} == set(has_calls)  # calls and plain responses both occur
    assert correct == [3.0 if c else 0.0 for c in has_calls]  # 0: not applicable (DESIGN.md §1)
    assert any(g.count("\n{") == 2 for g in gold)  # parallel calls occur
    system, user = rows[0]["prompt"]
    assert system["role"] == "system" and "get_weather" in system["content"] and user["role"] == "user"
    assert TOOL_SYSTEM.splitlines()[0] in system["content"]


def reference_solution(statement: str, tests: dict) -> str:
    """A correct program for each kind of exercise of task:code."""
    fn = tests.get("fn_name")
    if fn == "scale_add":
        k = re.search(r"returns (\d+) \* x", statement).group(1)
        return f"def scale_add(x):\n    return {k} * x + 1\n"
    if fn == "count_char":
        c = re.search(r"times '(\w)' occurs", statement).group(1)
        return f"def count_char(s):\n    return s.count({c!r})\n"
    if fn == "sum_multiples":
        a, b = re.search(r"divisible by (\d+) or (\d+)", statement).groups()
        return (f"def sum_multiples(n):\n    return sum(i for i in range(n) if i % {a} == 0 "
                f"or i % {b} == 0)\n")
    if fn == "largest_gap":
        return ("def largest_gap(nums):\n    return max((abs(p - q) for p, q in zip(nums, "
                "nums[1:])), default=0)\n")
    k = re.search(r"prints a \* b \+ (\d+)", statement).group(1)
    return f"a, b = map(int, input().split())\nprint(a * b + {k})\n"


def test_code_tests_pass_with_a_reference_solution_and_fail_without():
    rows = task_rows("task:code", 10, seed=1)
    kinds = {json.loads(r["ground_truth"]).get("fn_name") for r in rows}
    assert len(kinds) >= 4  # the exercises vary
    truths = [r["ground_truth"] for r in rows]
    right = ["```python\n" + reference_solution(r["prompt"], json.loads(r["ground_truth"])) + "```"
             for r in rows]
    wrong = ["```python\nprint(1 / 0)\n```"] * len(rows)
    passrate, bug = get("code_passrate"), get("code_bug")
    assert passrate([""] * 10, right, ground_truth=truths) == [1.0] * 10
    assert bug([""] * 10, right, ground_truth=truths) == [1.0] * 10
    assert passrate([""] * 10, wrong, ground_truth=truths) == [0.0] * 10
    assert bug([""] * 10, wrong, ground_truth=truths) == [0.0] * 10
