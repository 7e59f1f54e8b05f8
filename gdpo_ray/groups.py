"""References to complete groups in Ray's object store, what the driver knows of each, and the
payload's zero-copy readers.

A ``GroupRef`` names rows ``start:stop`` (one whole group) of a record batch in the object store
(``gdpo_ray.batch`` is its schema) and carries the group's small metadata beside it: its K
rewards per rollout, their error texts, the response lengths and finish reasons. That is all the
driver needs (advantages, dynamic sampling, metrics): the driver and the buffer hold only
``GroupRef``s and never fetch a payload; the learners read it with ``read_rows``. A rollout
actor describes its groups with ``describe_groups`` (``ref`` None: the object's reference is the
call's second return value, known to the caller only) and the driver fills in ``ref``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from gdpo_ray.batch import TURN_COLUMNS, as_numpy, group_bounds

#: a multi-turn rollout's counts, in ``GroupRef.turns``' column order
TURN_COUNTS = tuple(name for name, _ in TURN_COLUMNS[1:])


@dataclasses.dataclass(frozen=True)
class GroupRef:
    """One group: rows ``start:stop`` of the record batch ``ray.get(ref)``, and its metadata
    (None where a caller built a bare reference, e.g. a test of the buffer's arithmetic)."""

    ref: Any  # ray.ObjectRef of a pyarrow.RecordBatch holding whole groups
    start: int
    stop: int
    group_id: str
    policy_version: int  # the oldest policy version that sampled a token of the group
    rewards: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)  # [G, K]
    reward_errors: tuple | None = dataclasses.field(default=None, compare=False, repr=False)  # [G][K]
    response_length: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)  # [G]
    finish_reason: tuple | None = dataclasses.field(default=None, compare=False, repr=False)  # [G]
    # multi-turn: [G, 4] num_turns, num_tool_calls, tool_errors, tool_timeouts (TURN_COUNTS)
    turns: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    finished_at: float | None = dataclasses.field(default=None, compare=False, repr=False)  # its last token's wall time


def describe_groups(batch: pa.RecordBatch, ref: Any = None) -> list[GroupRef]:
    """A ``GroupRef`` with its metadata for every group of ``batch`` (rows in order)."""
    rewards = as_numpy(batch.column("rewards").flatten())
    rewards = rewards.astype(np.float32).reshape(batch.num_rows, -1)
    errors = batch.column("reward_errors").to_pylist()
    lengths = as_numpy(batch.column("response_length")).astype(np.int32)
    reasons = batch.column("finish_reason").to_pylist()
    versions = as_numpy(batch.column("policy_version"))
    turns = np.stack([as_numpy(batch.column(c)) for c in TURN_COUNTS], 1) \
        if "response_mask" in batch.schema.names else None
    return [GroupRef(ref, a, b, gid, int(versions[a:b].min()), rewards[a:b].copy(),
                     tuple(tuple(e) for e in errors[a:b]), lengths[a:b].copy(), tuple(reasons[a:b]),
                     None if turns is None else turns[a:b].copy())
            for gid, a, b in group_bounds(batch)]


def _described(groups: Sequence[GroupRef]) -> Sequence[GroupRef]:
    missing = [g.group_id for g in groups if g.rewards is None]
    if missing:
        raise ValueError(f"group(s) {missing[:3]} carry no metadata: build GroupRefs with "
                         f"gdpo_ray.groups.describe_groups")
    return groups


def rewards_matrix(groups: Sequence[GroupRef]) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float32 rewards of the rollouts of ``groups`` (NaN = not computed), from their
    metadata, and the [N] group index of each rollout."""
    _described(groups)
    if not groups:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
    rewards = np.concatenate([g.rewards for g in groups]).astype(np.float32, copy=False)
    index = np.repeat(np.arange(len(groups)), [len(g.rewards) for g in groups])
    return rewards, index


def reward_errors(groups: Sequence[GroupRef]) -> list[tuple[str, ...]]:
    """Per rollout, the K error texts ("" where the reward was computed)."""
    return [e for g in _described(groups) for e in g.reward_errors]


def response_lengths(groups: Sequence[GroupRef]) -> np.ndarray:
    _described(groups)
    return np.concatenate([g.response_length for g in groups]) if groups else np.zeros(0, np.int32)


def finish_reasons(groups: Sequence[GroupRef]) -> list[str]:
    return [r for g in _described(groups) for r in g.finish_reason]


def turn_counts(groups: Sequence[GroupRef]) -> np.ndarray | None:
    """[N, 4] ``TURN_COUNTS`` of the rollouts of multi-turn groups (None: none is)."""
    turns = [g.turns for g in _described(groups) if g.turns is not None]
    return np.concatenate(turns) if turns else None


def _objects(refs: Sequence[GroupRef]) -> dict:
    """ObjectRef -> record batch, one ray.get for the distinct objects of ``refs``."""
    import ray

    unique = list(dict.fromkeys(g.ref for g in refs))
    return dict(zip(unique, ray.get(unique)))


def read_groups(refs: Sequence[GroupRef]) -> list[pa.RecordBatch]:
    """One record batch per group of ``refs`` (zero-copy slices of the object store)."""
    objects = _objects(refs)
    return [objects[g.ref].slice(g.start, g.stop - g.start) for g in refs]


def read_rows(refs: Sequence[GroupRef]) -> list[pa.RecordBatch]:
    """The rows of ``refs``, in order, as few zero-copy slices as possible: consecutive groups
    that are consecutive rows of one object come back as one slice (a learner reads hundreds of
    groups as a handful of batches)."""
    runs: list[list] = []  # [ref, start, stop]
    for g in refs:
        if runs and runs[-1][0] == g.ref and runs[-1][2] == g.start:
            runs[-1][2] = g.stop
        else:
            runs.append([g.ref, g.start, g.stop])
    objects = _objects(refs)
    return [objects[ref].slice(start, stop - start) for ref, start, stop in runs]
