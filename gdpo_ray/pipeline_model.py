"""The ideal pipeline of a run: a discrete-event model of its generation, admission, updates and
pushes with no framework overhead at all, under a timing model (``gdpo_ray.simulation``). Pure:
numbers in, seconds out. ``benchmarks/scale.py`` measures a simulated run against it
(``async_efficiency``); docs/scale.md predicts a large run's step time with it.

What it models, as the real system does it:

- admission (``actors.buffer.ArrowBuffer.room``): with s updates done, B groups a step and
  eta = ``max_staleness``, a group may start while accepted + in flight < (eta + s + 1) * B;
  a group's version is the policy's when it starts;
- ``engines`` engines, each batching continuously (``TimingModel``: at most ``max_num_seqs``
  sequences, ``decode_step_s(b)`` a step; a prompt's prefill once per group, which stalls its
  engine); a new group goes to the engine with the fewest sequences;
- a group is complete when its ``group_size`` responses are; the learners take the B oldest
  complete groups once B are there and no update runs: ``update_s`` of their prompt and
  response tokens over ``learners`` ranks (each its share, at once), then the push: every
  engine pauses ``load_s`` (the whole model's weights), the version becomes s + 1, and groups
  in flight that started before s + 1 - eta are aborted and started again (a streaming actor
  does so); complete groups that fell too stale are dropped and started again.

``pipeline`` returns each update's end time; ``step_s`` is the steady state's mean interval.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import numpy as np


@dataclasses.dataclass
class _Group:
    version: int
    remaining: int  # responses not finished
    tokens: int = 0  # prompt + response tokens (for the update)


class _Engine:
    """One engine's sequences: every one decodes at the same rate, so each is kept as the
    engine's ``progress`` (tokens decoded per sequence since the start) at which it finishes."""

    def __init__(self, timing: Any) -> None:
        self.timing, self.progress, self.busy_until = timing, 0.0, 0.0
        self.heap: list[tuple[float, int, _Group]] = []
        self._count = 0

    def add(self, length: float, group: _Group) -> None:
        self._count += 1
        heapq.heappush(self.heap, (self.progress + length, self._count, group))

    def rate(self) -> float:
        """Tokens per second of each sequence (beyond ``max_num_seqs`` the sequences take turns)."""
        running = len(self.heap)
        slots = min(running, self.timing.max_num_seqs)
        return slots / running / self.timing.decode_step_s(slots)

    def next_finish(self, now: float) -> float:
        if not self.heap:
            return float("inf")
        return max(self.busy_until, now) + (self.heap[0][0] - self.progress) / self.rate()

    def advance(self, now: float, until: float) -> None:
        begin = max(self.busy_until, now)
        if self.heap and until > begin:
            self.progress += (until - begin) * self.rate()

    def finished(self) -> list[_Group]:
        out = []
        while self.heap and self.heap[0][0] - self.progress <= 1e-9:
            out.append(heapq.heappop(self.heap)[2])
        return out

    def abort(self, stale) -> set[int]:
        """Drops the sequences of groups ``stale(group)`` says; returns those groups' ids."""
        gone = {id(g) for _, _, g in self.heap if stale(g)}
        if gone:
            self.heap = [item for item in self.heap if id(item[2]) not in gone]
            heapq.heapify(self.heap)
        return gone


def pipeline(timing: Any, lengths: Any, engines: int, learners: int, groups_per_step: int, group_size: int,
             max_staleness: int, steps: int, max_tokens: int, prompt_tokens: int = 64,
             epochs: int = 1, seed: int = 0) -> list[float]:
    """The end time of each of ``steps`` updates (modelled seconds from the start), with
    response lengths drawn from ``lengths`` (``ResponseLengths``) capped at ``max_tokens``."""
    rng = np.random.default_rng(seed)
    now, version, accepted, in_flight = 0.0, 0, 0, 0
    complete: list[_Group] = []
    pool = [_Engine(timing) for _ in range(engines)]
    learner_done, ends = None, []

    def start_groups() -> None:
        nonlocal accepted, in_flight
        while accepted + in_flight < (max_staleness + version + 1) * groups_per_step:
            engine = min(pool, key=lambda e: len(e.heap))
            group = _Group(version, group_size, prompt_tokens * group_size)
            for n in lengths.draw(rng, group_size, max_tokens):
                engine.add(float(n), group)
                group.tokens += int(n)
            engine.busy_until = max(engine.busy_until, now) + timing.prefill_s(prompt_tokens)
            in_flight += 1

    start_groups()
    while len(ends) < steps:
        times = [e.next_finish(now) for e in pool]
        which = int(np.argmin(times))
        nxt = times[which]
        if learner_done is not None and learner_done <= nxt:
            nxt, which = learner_done, -1
        if nxt == float("inf"):
            raise RuntimeError("the modelled pipeline stalled: no generation and no update pending")
        for engine in pool:
            engine.advance(now, nxt)
        now = nxt
        if which == -1:  # the update ends; the push
            ends.append(now)
            version += 1
            learner_done = None
            oldest = version - max_staleness
            for engine in pool:
                engine.busy_until = max(engine.busy_until, now) + timing.load_s()
                in_flight -= len(engine.abort(lambda g: g.version < oldest))
            dropped = [g for g in complete if g.version < oldest]
            complete = [g for g in complete if g.version >= oldest]
            accepted -= len(dropped)
        else:
            for group in pool[which].finished():
                group.remaining -= 1
                if group.remaining == 0:
                    in_flight -= 1
                    accepted += 1
                    complete.append(group)
        if learner_done is None and len(complete) >= groups_per_step:
            batch, complete = complete[:groups_per_step], complete[groups_per_step:]
            learner_done = now + timing.update_s(sum(g.tokens for g in batch) / learners, epochs)
        start_groups()
    return ends


def step_s(ends: list[float], warmup: int | None = None) -> float:
    """The mean interval between updates once the pipeline is full (after ``warmup`` updates;
    default: the first half)."""
    skip = len(ends) // 2 if warmup is None else warmup
    tail = ends[skip:]
    if len(tail) < 2:
        raise ValueError(f"{len(ends)} updates leave fewer than 2 past the warm-up of {skip}")
    return (tail[-1] - tail[0]) / (len(tail) - 1)
