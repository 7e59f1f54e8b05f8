"""Tool-calling rewards of the paper's §4.1 and Appendix C (after ToolRL).

Ground truth: the gold output text (ToolRL's data: ``<think>…</think>\\n<tool_call>\\n{json per
line}\\n</tool_call>`` and/or ``<response>…</response>``), or a JSON list of calls
``[{"name": ..., "parameters": {...}}, ...]`` (a tool-call-only answer).

The calls are read as ``gdpo_ray.tool_format.calls_in`` reads them (linear in the output's
length): a call that is not JSON, or nests lists and objects deeper than its ``MAX_DEPTH``, is
``Unparsable`` (correctness -3), never an exception of another kind.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import numpy as np

from gdpo_ray.rewards.adapters import completion_text
from gdpo_ray.tool_format import CLOSE, OPEN, Unparsable, calls_in

_TAGS = ("<think>", "</think>", OPEN, CLOSE, "<response>", "</response>")


def _gold_parts(ground_truth: Any) -> tuple[bool, bool]:
    """(has tool calls, has a response) in the gold answer."""
    if isinstance(ground_truth, str) and OPEN not in ground_truth and ground_truth.lstrip()[:1] == "[":
        return True, False
    if isinstance(ground_truth, list):
        return True, False
    text = str(ground_truth)
    return OPEN in text, "<response>" in text


def _format_parts(ground_truth: Any) -> tuple[str, set[str]]:
    """The pattern the gold answer's case asks for and its <tool_call>/<response> tags."""
    has_call, has_response = _gold_parts(ground_truth)
    parts, tags = [r"<think>.*?</think>"], set()
    if has_call:
        parts.append(rf"{OPEN}\n.*?\n{CLOSE}")
        tags |= {OPEN, CLOSE}
    if has_response:
        parts.append(r"<response>.*?</response>")
        tags |= {"<response>", "</response>"}
    return "\n".join(parts), tags


def format_matches(completion: str, ground_truth: Any, strict: bool = False) -> bool:
    """The output is <think>…</think>, a newline, then the parts the gold answer has
    (<tool_call>\\n…\\n</tool_call> and/or <response>…</response>, newline-separated), nothing
    after.

    Default (ToolRL's reward): the output is stripped first, and only the <tool_call> /
    </tool_call> / <response> / </response> tags of the gold answer's case must occur exactly
    once (<think> tags are not counted). ``strict``: no stripping, and each of the six tags
    occurs exactly once if the case requires it and not at all otherwise."""
    pattern, tags = _format_parts(ground_truth)
    text = completion if strict else completion.strip()
    if strict:
        tags |= {"<think>", "</think>"}
        counts_ok = all(text.count(tag) == (1 if tag in tags else 0) for tag in _TAGS)
    else:
        counts_ok = all(text.count(tag) == 1 for tag in tags)
    # the counts first: with each required tag once, the pattern's lazy parts cannot backtrack
    # over the text quadratically
    return counts_ok and re.fullmatch(pattern, text, re.DOTALL) is not None


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


def _greedy_matching(gold, pred) -> float:
    """ToolRL's matching: each gold call in order takes the first unused same-name prediction
    with the highest pair score, and only if that score is above 0."""
    used: set[int] = set()
    total = 0.0
    for g in gold:
        best, best_j = 0.0, None
        for j, p in enumerate(pred):
            if j not in used and p[0] == g[0] and (score := pair_score(g, p)) > best:
                best, best_j = score, j
        if best_j is not None:
            used.add(best_j)
            total += best
    return total


def _best_matching(gold, pred, greedy: bool) -> float:
    """Largest total pair score over matchings of same-name calls (or ToolRL's greedy one)."""
    if greedy:
        return _greedy_matching(gold, pred)
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

    R_max = Jaccard of the tool names + the matching's pair scores (``pair_score``). Gold
    without tool calls -> 0 (not applicable); an unparsable prediction -> -3.

    Tool names are compared as multisets (|G & P| / |G | P| with multiplicities: gold [f, f]
    vs predicted [f] is 1/2), as ToolRL's code does; the paper's text says sets.
    Values compare type-strictly (``same_value``): where ToolRL's code uses Python ``==``, which
    takes true == 1, false == 0 and true == 1.0, we do not ("5" != 5 under both).
    ``matching``: "optimal" (the paper: the assignment of same-name calls with the largest
    total) or "greedy" (ToolRL's code: ``_greedy_matching``)."""
    gold = calls_in(ground_truth)
    if not gold:
        return 0.0
    try:
        pred = calls_in(completion) or []
    except Unparsable:
        return -3.0
    names_g, names_p = Counter(g[0] for g in gold), Counter(p[0] for p in pred)
    name_score = sum((names_g & names_p).values()) / sum((names_g | names_p).values())
    r_max = name_score + _best_matching(gold, pred, greedy=matching == "greedy")
    s_max = 1 + len(gold) + sum(len(g[1]) for g in gold)
    return 6.0 * r_max / s_max - 3.0


def toolrl_format(strict: bool = False):
    """1 if the output has the structure the gold answer asks for, else 0 (``format_matches``:
    ToolRL's check by default; ``strict=True``: no stripping, all six tags counted)."""

    def toolrl_format(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        return [float(format_matches(completion_text(c), g, strict)) for c, g in zip(completions, ground_truth)]

    return toolrl_format


def toolrl_correctness(matching: str = "optimal"):
    """Tool-call correctness in [-3, 3]; ``matching`` "optimal" (the paper) or "greedy"
    (the public ToolRL reward)."""
    if matching not in ("optimal", "greedy"):
        raise ValueError(f"toolrl_correctness matching must be 'optimal' or 'greedy'; got {matching!r}")

    def toolrl_correctness(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        return [correctness(completion_text(c), g, matching) for c, g in zip(completions, ground_truth)]

    return toolrl_correctness
