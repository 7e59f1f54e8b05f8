"""Math correctness (the paper's §4.2): the final answer checked with HF's math-verify.

The answer is found by scans linear in the completion's length (``last_boxed``,
``final_answer``): model output is hostile input, and 210 KB of unclosed ``\\boxed{`` must not
cost minutes. math-verify's own parsing and comparison are bounded by ``timeout_s``: a ground
truth it cannot parse in time is the row's error (``TimeoutError``; math-verify's own
``TimeoutException`` is a BaseException), a completion's answer it cannot parse or compare in
time scores 0, as math-verify scores it.
"""

from __future__ import annotations

import re

from gdpo_ray.rewards.adapters import completion_text


#: parsed ground truths a math_correctness reward keeps (all of them are parsed again past it)
TRUTHS_KEPT = 4096

_BOXED = re.compile(r"\\boxed\s*\{")  # \boxed, optional whitespace, its opening brace
_BRACE = re.compile(r"[{}]")


def _closing_braces(text: str) -> dict[int, int]:
    """Position of each "{" -> position of the "}" that closes it, for the braces that close."""
    opened, closes = [], {}
    for m in _BRACE.finditer(text):
        if m.group() == "{":
            opened.append(m.start())
        elif opened:
            closes[opened.pop()] = m.start()
    return closes


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} whose braces balance, or None (one pass over the text)."""
    opens = [m.end() - 1 for m in _BOXED.finditer(text)]
    if not opens:
        return None
    closes = _closing_braces(text)
    return next((text[i + 1:closes[i]] for i in reversed(opens) if i in closes), None)


def last_tagged(text: str, tag: str) -> str | None:
    """The content of the last ``<tag>…</tag>`` (each opening tag with the first closing tag
    after it, left to right, as ``re.findall(r"<tag>(.*?)</tag>", text, re.DOTALL)[-1]``), or
    None; each closing tag, from the last, looks for an opening one since the closing tag
    before it, so the scan is linear."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    end = text.rfind(closing)
    while end != -1:
        before = text.rfind(closing, 0, end)
        start = text.find(opening, 0 if before == -1 else before + len(closing), end)
        if start != -1:
            return text[start + len(opening):end]
        end = before
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
        inner = last_tagged(completion, answer_tag)
        if inner is not None:
            return last_boxed(inner) or inner.strip()
    return last_boxed(completion)


def math_correctness(answer_tag: str | None = None, timeout_s: int = 5,
                     after_tag: str | None = None):
    """1 if the final answer equals the ground truth (equivalent forms count), else 0; no
    final answer is 0. ``answer_tag``/``after_tag``: see ``final_answer`` (R1-distill models:
    ``after_tag="</think>"``). ``timeout_s`` bounds math-verify's parsing and comparison.
    math-verify (and its LaTeX parser) is imported at the first call, not here: a process that
    only resolves the rewards to check them (the rollout actor) does without it."""
    truths: dict[str, list] = {}  # parsed ground truths: a group's G rows share one, prompts recur

    def parsed_truth(truth: str) -> list:
        from math_verify import parse
        from math_verify.errors import TimeoutException

        if truth not in truths:
            if len(truths) >= TRUTHS_KEPT:
                truths.clear()
            try:
                truths[truth] = parse(f"${truth}$", parsing_timeout=timeout_s, raise_on_error=True)
            except TimeoutException:  # a BaseException: made the reward's error on the row
                raise TimeoutError(f"math-verify did not parse the ground truth {truth[:200]!r} within "
                                   f"{timeout_s} s (timeout_s)") from None
        return truths[truth]

    def math_correctness(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        from math_verify import parse, verify

        out = []
        for completion, truth in zip(completions, ground_truth):
            answer = final_answer(completion_text(completion), answer_tag, after_tag)
            if answer is None:
                out.append(0.0)
                continue
            gold = parsed_truth(str(truth))
            pred = parse(f"$\\boxed{{{answer}}}$", parsing_timeout=timeout_s)  # garbage: []
            if not gold:
                raise ValueError(f"math-verify cannot parse the ground truth {truth!r}")
            out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=timeout_s)))
        return out

    return math_correctness


def exact_answer(answer_tag: str | None = "answer", after_tag: str | None = None):
    """1 if the final answer (as ``math_correctness`` finds it) is the ground truth's text, runs
    of whitespace counting as one space and the ends stripped, else 0: for answers that are not
    one mathematical object (a list in order: ``12 13 14``), where math-verify would compare sets."""

    def exact_answer(prompts, completions, *, ground_truth, **_columns) -> list[float]:
        return [float(_words(final_answer(completion_text(c), answer_tag, after_tag)) == _words(str(t)))
                for c, t in zip(completions, ground_truth)]

    return exact_answer


def _words(text: str | None) -> list[str] | None:
    return None if text is None else text.split()
