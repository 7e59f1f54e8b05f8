"""Math correctness (the paper's §4.2): the final answer checked with HF's math-verify."""

from __future__ import annotations

import re

from gdpo_ray.rewards.adapters import completion_text


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = text.find("{", start)
        if i != -1 and text[start + len("\\boxed"):i].strip() == "":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j]
        start = text.rfind("\\boxed", 0, start)
    return None


def after_last(text: str, tag: str) -> str | None:
    """The text after the last occurrence of ``tag``, or None when the tag is missing."""
    cut = text.rfind(tag)
    return None if cut == -1 else text[cut + len(tag):]


def final_answer(completion: str, answer_tag: str | None = None,
                 after_tag: str | None = None) -> str | None:
    """The last <answer_tag>…</answer_tag> if asked for and present, else the last \\boxed{}.

    ``after_tag`` (say "</think>"): only the text after its last occurrence counts, and there is
    no answer when the tag is missing (a reasoning cut off by max_tokens is not graded)."""
    if after_tag:
        completion = after_last(completion, after_tag)
        if completion is None:
            return None
    if answer_tag:
        found = re.findall(rf"<{answer_tag}>(.*?)</{answer_tag}>", completion, re.DOTALL)
        if found:
            inner = found[-1]
            return last_boxed(inner) or inner.strip()
    return last_boxed(completion)


def math_correctness(answer_tag: str | None = None, timeout_s: int = 5,
                     after_tag: str | None = None):
    """1 if the final answer equals the ground truth (equivalent forms count), else 0; no
    final answer is 0. ``answer_tag``/``after_tag``: see ``final_answer`` (R1-distill models:
    ``after_tag="</think>"``). ``timeout_s`` bounds math-verify's parsing and comparison."""
    from math_verify import parse, verify

    def math_correctness(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        out = []
        for completion, truth in zip(completions, ground_truth):
            answer = final_answer(completion_text(completion), answer_tag, after_tag)
            if answer is None:
                out.append(0.0)
                continue
            gold = parse(f"${truth}$", parsing_timeout=timeout_s, raise_on_error=True)
            pred = parse(f"$\\boxed{{{answer}}}$", parsing_timeout=timeout_s)  # garbage: []
            if not gold:
                raise ValueError(f"math-verify cannot parse the ground truth {truth!r}")
            out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=timeout_s)))
        return out

    return math_correctness
