"""A learner's view of its rollouts: one ``Row`` per rollout (zero-copy views of the Arrow
record's columns), and the plan of its micro-batches."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from gdpo_ray.batch import as_numpy, token_versions


@dataclasses.dataclass
class Row:
    prompt: np.ndarray
    response: np.ndarray
    rollout_logprobs: np.ndarray
    advantage: float
    sampled: np.ndarray | None = None  # multi-turn: 1 where the policy sampled the token; None: all
    versions: np.ndarray | None = None  # per token: the policy version that sampled it

    def sampled_tokens(self) -> int:
        """Tokens of the loss and of the token-mean count (a tool turn's are not)."""
        return len(self.response) if self.sampled is None else int(np.count_nonzero(self.sampled))


def rows_of(batches: Sequence[Any], advantages: np.ndarray) -> list[Row]:
    """Per-rollout views (no copies) of the prompt, response and rollout logprobs."""
    def split(column: Any, dtype: type) -> list[np.ndarray]:
        values = as_numpy(column.flatten()).astype(dtype, copy=False)
        offsets = as_numpy(column.offsets)
        return np.split(values, offsets[1:-1] - offsets[0])

    rows = []
    for b in batches:
        masks = split(b.column("response_mask"), np.int8) if "response_mask" in b.schema.names \
            else [None] * b.num_rows
        responses = b.column("response_token_ids")
        offsets = as_numpy(responses.offsets)
        versions = np.split(token_versions(b.column("response_versions")), offsets[1:-1] - offsets[0])
        rows.extend(Row(p, r, lp, 0.0, m, v) for p, r, lp, m, v in zip(
            split(b.column("prompt_token_ids"), np.int64), split(responses, np.int64),
            split(b.column("response_logprobs"), np.float32), masks, versions))
    if len(rows) != len(advantages):
        raise ValueError(f"{len(advantages)} advantages for {len(rows)} rollouts")
    for row, a in zip(rows, advantages):
        row.advantage = float(a)
    return rows


def plan_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices per micro-batch: longest first, rows x longest <= budget (one row at least)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def plan_groups(rows: Sequence[Row], budget: int) -> list[list[int]]:
    """Row indices per micro-batch of a packed forward (``learners/packing.py``), whose cost is
    its real tokens: each distinct prompt once plus every response. A group (the rows after one
    prompt) stays in one micro-batch where it fits the budget: groups largest first, each into the
    first micro-batch with room; a larger group is split into runs of rows that fit, longest
    first (one row at least)."""
    groups: dict[bytes, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(np.asarray(r.prompt, np.int64).tobytes(), []).append(i)
    units = []  # (cost, prompt length, rows): a group, or a run of an oversized one
    for members in groups.values():
        prompt = len(rows[members[0]].prompt)
        run, cost = [], prompt
        for i in sorted(members, key=lambda i: -len(rows[i].response)):  # runs of like lengths
            n = len(rows[i].response)
            if run and cost + n > budget:
                units.append((cost, prompt, run))
                run, cost = [], prompt
            run.append(i)
            cost += n
        units.append((cost, prompt, run))
    batches: list[tuple[int, list[int]]] = []  # (cost, rows)
    for cost, _, members in sorted(units, key=lambda u: -u[0]):
        for b, (used, taken) in enumerate(batches):
            if used + cost <= budget:
                batches[b] = (used + cost, taken + members)
                break
        else:
            batches.append((cost, list(members)))
    return [sorted(taken) for _, taken in batches]
