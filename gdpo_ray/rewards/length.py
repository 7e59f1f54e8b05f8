"""Length reward (the paper's §4.2): 1 iff the response has at most ``limit`` tokens."""

from __future__ import annotations


def length(limit: int = 4000):
    """1 if response_length <= limit tokens, else 0 (the paper: limit = 4,000)."""
    if not (isinstance(limit, int) and limit > 0):
        raise ValueError(f"length limit must be a positive number of tokens; got {limit!r}")

    def length(prompts, completions, *, response_length, **_columns) -> list[float]:
        return [float(int(n) <= limit) for n in response_length]

    return length
