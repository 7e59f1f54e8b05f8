"""``task:<name>``: the built-in synthetic tasks (``gdpo_ray.tasks``) as eval suites.

Items are drawn with ``EVAL_SEED``, not the training seed (0), so the word problems, tool
requests and code exercises are mostly ones training never showed; ``addition`` has only 100
distinct sums, so its eval set is all of them (the demo trains on every one: its eval measures
how reliably the policy answers, not generalization). Each task is scored as its preset's
rewards score it, reported under the paper's metric names:

- ``addition``: ``pass@1`` (the sum in ``<answer>``), ``format_ratio`` (the demo's
  ``<think>…</think><answer>…</answer>``), ``exceed_ratio`` (over 16 tokens: the demo's limit);
- ``arithmetic``: ``pass@1`` (the ``\\boxed{}`` answer), ``exceed_ratio``;
- ``count``: ``pass@1`` (``exact_answer``: the numbers in order in ``<answer>``), ``exceed_ratio``
  (over 14 tokens: the math-length study's limit); all 300 counts, less those a run trained on;
- ``tool_calls``: ``accuracy`` (the calls equal the gold calls: same names and type-strictly
  equal arguments, in any order; or no call where none fits), ``format_ratio`` (ToolRL's format);
- ``tool_arithmetic`` (the ``agent`` preset): generated as it trains, multi-turn with its
  environment's tools (``Suite.environment``); ``accuracy`` (``exact_answer``), ``format_ratio``
  (``tool_turn_format``), ``tool_success`` (a tool answered the item's answer; NaN for a
  completions file's text, which has no tool turns);
- ``code``: ``pass@1`` (every test case passes), ``bug_ratio`` (a compile or runtime error),
  ``exceed_ratio``: run in the code sandbox; a program no UTF-8 file can hold (a lone
  surrogate, from a completions file) does not compile, and is not run.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

from gdpo_ray.eval.suite import Completion, EvalItem, Suite, exceeds
from gdpo_ray.tool_format import Unparsable, calls_in

#: the seed of eval items (training draws with seed 0)
EVAL_SEED = 1_000_003


def _rows_as_items(rows: list[dict], task: str) -> list[EvalItem]:
    return [EvalItem(id=str(r["id"]), prompt=r["prompt"], category=task, reference=r["ground_truth"])
            for r in rows]


class TaskSuite(Suite):
    def __init__(self, task: str, n: int, length_limit: int | None = None) -> None:
        from gdpo_ray.tasks import task_rows

        self.task, self.name = task, f"task:{task}"
        self._items = _rows_as_items(task_rows(task, n, seed=EVAL_SEED), task)
        if length_limit is not None:
            self.length_limit = length_limit

    def all_items(self) -> list[EvalItem]:
        return list(self._items)

    def _rewards(self, fns: dict, item: EvalItem, completions: Sequence[Completion]) -> list[dict]:
        texts = [c.text for c in completions]
        values = {m: fn([item.prompt] * len(texts), texts, ground_truth=[item.reference] * len(texts))
                  for m, fn in fns.items()}
        return [{**{m: float(v[i]) for m, v in values.items()},
                 **({"exceed_ratio": exceeds(c, self.length_limit)} if "exceed_ratio" in self.metrics else {})}
                for i, c in enumerate(completions)]


class AdditionSuite(TaskSuite):
    metrics = ("pass@1", "format_ratio", "exceed_ratio")
    max_tokens, length_limit = 40, 16

    def __init__(self, length_limit: int | None = None) -> None:
        super().__init__("addition", 100, length_limit)

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        from gdpo_ray.rewards import get
        from gdpo_ray.tasks import ADDITION_FORMAT

        return self._rewards({"pass@1": get("math_correctness", answer_tag="answer"),
                              "format_ratio": get("regex", pattern=ADDITION_FORMAT)}, item, completions)


class ArithmeticSuite(TaskSuite):
    metrics = ("pass@1", "exceed_ratio")
    max_tokens, length_limit = 256, 200

    def __init__(self, length_limit: int | None = None) -> None:
        super().__init__("arithmetic", 64, length_limit)

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        from gdpo_ray.rewards import get

        return self._rewards({"pass@1": get("math_correctness")}, item, completions)


class CountSuite(TaskSuite):
    metrics = ("pass@1", "exceed_ratio")
    max_tokens, length_limit = 40, 14

    def __init__(self, length_limit: int | None = None) -> None:
        super().__init__("count", 300, length_limit)

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        from gdpo_ray.rewards import get

        return self._rewards({"pass@1": get("exact_answer")}, item, completions)


def calls_equal(completion: str, gold: Any) -> bool:
    """The completion's tool calls are the gold calls (names and type-strictly equal arguments,
    as a multiset); a gold answer without calls wants none (and a parsable answer)."""
    from gdpo_ray.rewards.toolrl import same_value

    try:
        pred = calls_in(completion) or []
    except Unparsable:
        return False
    want = calls_in(gold) or []
    if Counter(name for name, _ in pred) != Counter(name for name, _ in want):
        return False
    left = list(pred)
    for name, args in want:
        match = next((i for i, (n, a) in enumerate(left) if n == name and same_value(a, args)), None)
        if match is None:
            return False
        left.pop(match)
    return True


class ToolCallSuite(TaskSuite):
    metrics = ("accuracy", "format_ratio")
    max_tokens = 256

    def __init__(self, length_limit: int | None = None) -> None:
        super().__init__("tool_calls", 64, length_limit)

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        from gdpo_ray.rewards.toolrl import format_matches

        return [{"accuracy": float(calls_equal(c.text, item.reference)),
                 "format_ratio": float(format_matches(c.text, item.reference))} for c in completions]


class ToolArithmeticSuite(TaskSuite):
    """Generated as the ``agent`` preset trains: multi-turn, with its environment's tools."""

    metrics = ("accuracy", "format_ratio", "tool_success")
    max_tokens, max_turns = 96, 4  # the agent preset's
    environment = "gdpo_ray.environments.arithmetic:Arithmetic"

    def __init__(self, length_limit: int | None = None) -> None:
        super().__init__("tool_arithmetic", 128, length_limit)

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        from gdpo_ray.rewards import get

        conversations = [c.text if c.messages is None else c.messages for c in completions]
        n = len(conversations)
        answer = get("exact_answer")([item.prompt] * n, conversations, ground_truth=[item.reference] * n)
        form = get("tool_turn_format")([item.prompt] * n, conversations)
        return [{"accuracy": float(a), "format_ratio": float(f), "tool_success": _tool_success(c, item.reference)}
                for a, f, c in zip(answer, form, completions)]


def _tool_success(c: Completion, answer: str) -> float:
    """1 if a tool's answer in the conversation is the item's answer (the environment's
    ``tool_success``); NaN for a completion without its conversation (a completions file)."""
    if c.messages is None:
        return math.nan
    return float(any(m.get("role") == "tool" and m.get("content") == answer for m in c.messages))


class CodeTaskSuite(TaskSuite):
    metrics = ("pass@1", "bug_ratio", "exceed_ratio")
    max_tokens = 512

    def __init__(self, length_limit: int | None = None) -> None:
        super().__init__("code", 64, length_limit)

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        from gdpo_ray.rewards import get
        from gdpo_ray.rewards.adapters import RewardInfraError
        from gdpo_ray.rewards.code import extract_program

        passrate, bug_free = get("code_passrate"), get("code_bug")
        out = []
        for c in completions:
            try:
                extract_program(c.text).encode("utf-8")
                rate = passrate([item.prompt], [c.text], ground_truth=[item.reference])[0]
                bug = 1.0 - bug_free([item.prompt], [c.text], ground_truth=[item.reference])[0]
                passed = float(rate == 1.0)
            except UnicodeEncodeError:  # a lone surrogate: no source file holds the program
                passed, bug = 0.0, 1.0
            except RewardInfraError:  # the sandbox, not the program: not scored
                passed = bug = float("nan")
            out.append({"pass@1": passed, "bug_ratio": bug, "exceed_ratio": exceeds(c, self.length_limit)})
        return out


TASK_SUITES = {"addition": AdditionSuite, "arithmetic": ArithmeticSuite, "count": CountSuite,
               "tool_calls": ToolCallSuite, "tool_arithmetic": ToolArithmeticSuite, "code": CodeTaskSuite}


def task_suite(name: str, length_limit: int | None = None) -> TaskSuite:
    if name not in TASK_SUITES:
        raise ValueError(f"unknown task suite task:{name!r}; known: "
                         f"{', '.join('task:' + t for t in TASK_SUITES)}")
    return TASK_SUITES[name](length_limit=length_limit)
