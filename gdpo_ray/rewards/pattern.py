"""Format reward by regular expression: 1 iff the whole (stripped) response matches."""

from __future__ import annotations

import re

from gdpo_ray.rewards.adapters import completion_text


def regex(pattern: str, dotall: bool = True):
    """1 if ``re.fullmatch(pattern, completion.strip())``, else 0 (e.g. the demo's
    ``<think>…</think><answer>…</answer>`` format)."""
    try:
        compiled = re.compile(pattern, re.DOTALL if dotall else 0)
    except re.error as err:
        raise ValueError(f"regex reward: bad pattern {pattern!r}: {err}") from None

    def regex(prompts, completions, **_columns) -> list[float]:
        return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]

    return regex
