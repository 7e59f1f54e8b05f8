"""PromptSource: hands out dataset prompts, epoch by epoch, and remembers what became of each.

Every prompt of an epoch is in exactly one state (DESIGN.md §2):
    pending     not handed out yet this epoch
    in flight   handed out (to a rollout actor, or waiting in the buffer)
    trained     its group went into a training step          (final for the epoch)
    filtered    dropped with a reason (no reward varies, ...) (final for the epoch)
A prompt re-issued (its group too stale, its actor died) goes back to the front of the queue
with the next attempt number. The state is checkpointable: a resumed run re-issues what was in
flight and neither skips nor repeats a prompt.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Iterable, Mapping

import numpy as np

from gdpo_ray.data import Rows, read_dataset


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One hand-out of a dataset row."""

    prompt_id: str  # stable id of the row ("<row>" or the id column's value)
    row: int
    epoch: int
    attempt: int
    prompt: str | list  # text, or chat messages [{"role": ..., "content": ...}, ...]
    columns: Mapping[str, Any]  # the row's other columns (ground_truth, ...)

    @property
    def group_id(self) -> str:
        return f"{self.prompt_id}/e{self.epoch}/a{self.attempt}"


class PromptSource:
    """Seeded epochs over a dataset, with the state of every prompt handed out.

    Args:
        data: see ``gdpo_ray.data.read_dataset``.
        prompt_column: the column holding the prompt text or chat messages.
        id_column: a column of unique prompt ids (default: the row number).
        seed: the order of epoch e is a permutation drawn from (seed, e).
        columns: extra columns taken from nested fields, ``{name: "column.field..."}``: verl's
            parquet keeps the answer in ``reward_model.ground_truth``, the rewards read
            ``ground_truth`` (``{"ground_truth": "reward_model.ground_truth"}``).
    """

    def __init__(self, data: Any, prompt_column: str = "prompt", id_column: str | None = None,
                 seed: int = 0, columns: Mapping[str, str] | None = None) -> None:
        source = read_dataset(data)
        self._rows = [dict(r) for r in source.rows]
        names = list(self._rows[0])
        for name, path in (columns or {}).items():
            _add_column(self._rows, name, path, names, source)
        for column, setting in ((prompt_column, "prompt_column"), (id_column, "id_column")):
            if column is not None and column not in self._rows[0]:
                raise ValueError(f"data.{setting} {column!r} is not a column of {source.source}; "
                                 f"columns: {names}")
        self._prompt_column, self.seed = prompt_column, seed
        ids = ([str(r[id_column]) for r in self._rows] if id_column else
               [str(i) for i in range(len(self._rows))])
        if id_column and len(set(ids)) != len(ids):
            first = next(i for i, v in enumerate(ids) if ids.index(v) != i)
            raise ValueError(f"{source.where(first)}: id {ids[first]!r} of data.id_column "
                             f"{id_column!r} is repeated (first at {source.where(ids.index(ids[first]))})")
        self._ids = ids
        for i, row in enumerate(self._rows):
            _check_prompt(row[prompt_column], source.where(i), prompt_column)
        self.dataset = source  # where the rows came from (for messages)
        self.epoch, self._cursor = 0, 0
        self._queue: deque[tuple[int, int, int]] = deque()  # re-issued (row, epoch, attempt)
        self._in_flight: dict[str, tuple[int, int, int]] = {}
        self._done: dict[tuple[int, int], str] = {}  # (epoch, row) -> "trained" | "filtered: why"
        self.reissued = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def rows(self) -> list[dict]:
        return self._rows

    @property
    def columns(self) -> list[str]:
        """The columns a reward is given (every column but the prompt's)."""
        return [k for k in self._rows[0] if k != self._prompt_column]

    def first(self, n: int) -> list[Prompt]:
        """The dataset's first ``n`` rows as prompts, without handing them out."""
        return [self._prompt(i, 0, 0) for i in range(min(n, len(self._rows)))]

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self._rows))

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (re-issued ones first); epochs roll over as needed."""
        out = []
        while len(out) < n:
            if self._queue:
                row, epoch, attempt = self._queue.popleft()
            else:
                if self._cursor == len(self._rows):
                    self.epoch, self._cursor = self.epoch + 1, 0
                row, epoch, attempt = int(self._order(self.epoch)[self._cursor]), self.epoch, 0
                self._cursor += 1
            prompt = self._prompt(row, epoch, attempt)
            self._in_flight[prompt.group_id] = (row, epoch, attempt)
            out.append(prompt)
        return out

    def _prompt(self, row: int, epoch: int, attempt: int) -> Prompt:
        data = self._rows[row]
        columns = {k: v for k, v in data.items() if k != self._prompt_column}
        return Prompt(self._ids[row], row, epoch, attempt, data[self._prompt_column], columns)

    def _finish(self, group_id: str, state: str) -> None:
        try:
            row, epoch, _ = self._in_flight.pop(group_id)
        except KeyError:
            raise ValueError(f"group {group_id!r} is not in flight") from None
        if (epoch, row) in self._done:
            raise RuntimeError(f"prompt {self._ids[row]} of epoch {epoch} was already "
                               f"{self._done[epoch, row]}")
        self._done[epoch, row] = state

    def mark_trained(self, group_ids: Iterable[str]) -> None:
        for g in group_ids:
            self._finish(g, "trained")

    def mark_filtered(self, group_id: str, reason: str) -> None:
        self._finish(group_id, f"filtered: {reason}")

    def reissue(self, group_ids: Iterable[str]) -> None:
        """Back to the front of the queue, with the next attempt number."""
        for g in group_ids:
            try:
                row, epoch, attempt = self._in_flight.pop(g)
            except KeyError:
                raise ValueError(f"group {g!r} is not in flight") from None
            self._queue.append((row, epoch, attempt + 1))
            self.reissued += 1

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def outcomes(self, epoch: int) -> dict[str, str]:
        """prompt_id -> final state, for the prompts of ``epoch`` that reached one."""
        return {self._ids[row]: state for (e, row), state in self._done.items() if e == epoch}

    def state_dict(self, in_buffer: Iterable[str] = ()) -> dict:
        """What a resumed run needs; prompts in flight now are re-issued on load, except the
        groups ``in_buffer`` (generated, saved with the buffer): they stay in flight."""
        kept = set(in_buffer)
        pending = list(self._queue) + [(r, e, a + 1) for g, (r, e, a) in self._in_flight.items()
                                       if g not in kept]
        held = [[g, *self._in_flight[g]] for g in kept if g in self._in_flight]
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self._cursor,
                "queue": pending, "done": [[e, r, s] for (e, r), s in self._done.items()],
                "in_buffer": held, "reissued": self.reissued + len(self._in_flight) - len(held),
                "rows": len(self._rows)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["rows"] != len(self._rows) or state["seed"] != self.seed:
            raise ValueError(f"prompt state of a dataset of {state['rows']} rows with seed "
                             f"{state['seed']} cannot resume one of {len(self._rows)} rows, seed "
                             f"{self.seed}")
        self.epoch, self._cursor = state["epoch"], state["cursor"]
        self._queue = deque(tuple(q) for q in state["queue"])
        self._in_flight = {g: (r, e, a) for g, r, e, a in state.get("in_buffer", [])}
        self._done = {(e, r): s for e, r, s in state["done"]}
        self.reissued = state["reissued"]


def _add_column(rows: list[dict], name: str, path: str, column_names: list[str],
                source: Rows) -> None:
    """Sets ``row[name]`` to the nested field ``path`` ("column.field.field") of every row."""
    first, *rest = path.split(".")
    if first not in column_names:
        raise ValueError(f"data column {name!r} comes from {path!r}, but {source.source} has no "
                         f"column {first!r}; columns: {column_names}")
    for i, row in enumerate(rows):
        value, where = row[first], first
        for part in rest:
            if not isinstance(value, dict) or part not in value:
                keys = sorted(value) if isinstance(value, dict) else type(value).__name__
                raise ValueError(f"{source.where(i)}: data column {name!r} comes from {path!r}, but "
                                 f"{where!r} has no field {part!r} (it has: {keys})")
            value, where = value[part], f"{where}.{part}"
        if value is None:
            raise ValueError(f"{source.where(i)}: data column {name!r} comes from {path!r}, which is "
                             "empty (null) in this row")
        row[name] = value


def _check_prompt(value: Any, where: str, column: str) -> None:
    if isinstance(value, str) and value:
        return
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        return
    raise ValueError(f"{where}: column {column!r} must be a non-empty string or a list of "
                     f"chat messages {{role, content}}; got {str(value)[:100]!r}")
