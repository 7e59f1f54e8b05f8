"""References to complete groups in Ray's object store, and their zero-copy readers.

A ``GroupRef`` names rows ``start:stop`` (one whole group) of a record batch in the object store
(``gdpo_ray.batch`` is its schema); the buffer and the driver hold only these, the learners read
the payload with ``read_rows``. The readers call ``ray.get``; ``gdpo_ray.batch`` stays pure.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import pyarrow as pa


@dataclasses.dataclass(frozen=True)
class GroupRef:
    """One group: rows ``start:stop`` of the record batch ``ray.get(ref)``."""

    ref: Any  # ray.ObjectRef of a pyarrow.RecordBatch holding whole groups
    start: int
    stop: int
    group_id: str
    policy_version: int


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
