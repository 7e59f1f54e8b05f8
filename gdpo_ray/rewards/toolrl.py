"""Tool-calling rewards of the paper's §4.1 and Appendix C (after ToolRL).

Ground truth: the gold output text (ToolRL's data: ``<think>…</think>\\n<tool_call>\\n{json per
line}\\n</tool_call>`` and/or ``<response>…</response>``), or a JSON list of calls
``[{"name": ..., "parameters": {...}}, ...]`` (a tool-call-only answer).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

import numpy as np

_TOOL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<response>", "</response>")


class Unparsable(ValueError):
    """A tool-call block that is not one JSON call object per line."""


def _gold_parts(ground_truth: Any) -> tuple[bool, bool]:
    """(has tool calls, has a response) in the gold answer."""
    if isinstance(ground_truth, str) and "<tool_call>" not in ground_truth and ground_truth.lstrip()[:1] == "[":
        return True, False
    if isinstance(ground_truth, list):
        return True, False
    text = str(ground_truth)
    return "<tool_call>" in text, "<response>" in text


def format_matches(completion: str, ground_truth: Any) -> bool:
    """The whole output is <think>…</think>, a newline, then the parts the gold answer has
    (<tool_call>\\n…\\n</tool_call> and/or <response>…</response>, newline-separated), each tag
    exactly once and nothing after."""
    has_call, has_response = _gold_parts(ground_truth)
    parts = [r"<think>.*?</think>"]
    required = {"<think>", "</think>"}
    if has_call:
        parts.append(r"<tool_call>\n.*?\n</tool_call>")
        required |= {"<tool_call>", "</tool_call>"}
    if has_response:
        parts.append(r"<response>.*?</response>")
        required |= {"<response>", "</response>"}
    if re.fullmatch("\n".join(parts), completion, re.DOTALL) is None:
        return False
    return all(completion.count(tag) == (1 if tag in required else 0) for tag in _TAGS)


def parse_calls(block: str) -> list[tuple[str, dict]]:
    """One JSON object per non-empty line: {"name": str, "parameters" | "arguments": dict}."""
    calls = []
    for line in block.strip().splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as err:
            raise Unparsable(f"not JSON: {line[:80]!r}") from err
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise Unparsable(f"not a call object with a name: {line[:80]!r}")
        params = obj.get("parameters", obj.get("arguments", {}))
        if not isinstance(params, dict):
            raise Unparsable(f"parameters are not an object: {line[:80]!r}")
        calls.append((obj["name"], params))
    return calls


def _calls_in(text_or_calls: Any) -> list[tuple[str, dict]] | None:
    """Calls of a gold answer or a completion; None when there is no tool-call block."""
    if isinstance(text_or_calls, list):
        return parse_calls("\n".join(json.dumps(c) for c in text_or_calls))
    text = str(text_or_calls)
    if "<tool_call>" not in text and text.lstrip()[:1] == "[":
        return _calls_in(json.loads(text))
    blocks = _TOOL_BLOCK.findall(text)
    if not blocks:
        return None
    return [call for block in blocks for call in parse_calls(block)]


def same_value(a: Any, b: Any) -> bool:
    """JSON equality that respects types: "5" != 5, true != 1, 1 == 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def pair_score(gold: tuple[str, dict], pred: tuple[str, dict]) -> float:
    """Parameter-name Jaccard (1 when both have none) + gold parameters with equal values."""
    g, p = gold[1], pred[1]
    union = set(g) | set(p)
    keys = len(set(g) & set(p)) / len(union) if union else 1.0
    return keys + sum(k in p and same_value(v, p[k]) for k, v in g.items())


def _best_matching(gold, pred, greedy: bool) -> float:
    """Largest total pair score over matchings of same-name calls (or ToolRL's greedy one)."""
    if greedy:
        used: set[int] = set()
        total = 0.0
        for g in gold:
            options = [(pair_score(g, p), j) for j, p in enumerate(pred)
                       if j not in used and p[0] == g[0]]
            if options:
                best = max(options, key=lambda sj: (sj[0], -sj[1]))
                used.add(best[1])
                total += best[0]
        return total
    from scipy.optimize import linear_sum_assignment

    total = 0.0
    for name in {g[0] for g in gold}:
        gs = [g for g in gold if g[0] == name]
        ps = [p for p in pred if p[0] == name]
        if ps:
            scores = np.array([[pair_score(g, p) for p in ps] for g in gs])
            rows, cols = linear_sum_assignment(scores, maximize=True)
            total += float(scores[rows, cols].sum())
    return total


def correctness(completion: str, ground_truth: Any, matching: str = "optimal") -> float:
    """R = 6 * R_max / S_max - 3 in [-3, 3], S_max = 1 + |G| + sum |keys(G_j)|.

    R_max = Jaccard of the multisets of tool names + the best matching's pair scores. Gold
    without tool calls -> 0 (not applicable); an unparsable prediction -> -3."""
    gold = _calls_in(ground_truth)
    if not gold:
        return 0.0
    try:
        pred = _calls_in(completion) or []
    except Unparsable:
        return -3.0
    names_g, names_p = Counter(g[0] for g in gold), Counter(p[0] for p in pred)
    name_score = sum((names_g & names_p).values()) / sum((names_g | names_p).values())
    r_max = name_score + _best_matching(gold, pred, greedy=matching == "greedy")
    s_max = 1 + len(gold) + sum(len(g[1]) for g in gold)
    return 6.0 * r_max / s_max - 3.0


def toolrl_format():
    """1 if the output has exactly the structure the gold answer asks for, else 0."""

    def toolrl_format(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        return [float(format_matches(c, g)) for c, g in zip(completions, ground_truth)]

    return toolrl_format


def toolrl_correctness(matching: str = "optimal"):
    """Tool-call correctness in [-3, 3]; ``matching`` "optimal" (the paper) or "greedy"
    (the public ToolRL reward)."""
    if matching not in ("optimal", "greedy"):
        raise ValueError(f"toolrl_correctness matching must be 'optimal' or 'greedy'; got {matching!r}")

    def toolrl_correctness(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        return [correctness(c, g, matching) for c, g in zip(completions, ground_truth)]

    return toolrl_correctness
