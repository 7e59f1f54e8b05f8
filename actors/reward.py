"""The reward scoring pool a rollout actor uses: worker processes, timeouts, kills, NaN.

Rewards never run in the trainer or rollout process. A pool of worker processes (each the leader
of its own session, so that its whole process tree can be killed) scores tasks of
(rows, all rewards). When a call raises, the rows are re-scored one by one to isolate the row
that fails; when a call hangs past its timeout or its worker dies, the worker's process tree is
killed, a new worker replaces it, and the task is re-issued row by row and reward by reward.
A single (row, reward) that still fails is recorded as NaN with its error text: nothing is ever
replaced by 0.0. Conditions (``RewardSpec.condition``) are applied to the scored values, so the
returned columns are what is stored and trained on.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping, Sequence

import cloudpickle
import numpy as np

from gdpo_ray.rewards import RewardSpec, apply_conditions, check_specs, to_floats


@dataclasses.dataclass
class ScoreResult:
    values: np.ndarray  # [N, K] float32 stored (conditioned) rewards; NaN = could not be computed
    errors: list[list[str]]  # [N][K] why a value is NaN ("" where it was computed)
    metrics: dict[str, float]  # rewards/<name>/{mean,std,failure_rate,timeouts,latency_s}


@dataclasses.dataclass
class _Task:
    rows: list[int]
    rewards: list[int]


def _worker_main(conn: Connection, payload: bytes) -> None:
    """A scoring worker: resolves the reward functions once, then scores tasks until told to stop."""
    os.setsid()  # its own process group: a kill reaches everything it started
    specs: list[RewardSpec] = cloudpickle.loads(payload)
    fns = [spec.resolve() for spec in specs]
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        ks, prompts, completions, columns = msg
        for k in ks:  # one message per reward, so the parent times each call on its own
            start = time.perf_counter()
            try:
                result = fns[k](prompts, completions, **columns)
                values, error = to_floats(result, len(completions), specs[k].name), ""
            except Exception as err:  # noqa: BLE001 - any failure of the reward is recorded
                values, error = None, f"{type(err).__name__}: {err}"[:500]
            conn.send((k, values, error, time.perf_counter() - start))


class _Worker:
    def __init__(self, payload: bytes) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, payload), daemon=True)
        self.process.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardPool:
    """Scores completions with K rewards in worker processes.

    Args:
        rewards: K reward declarations (``RewardSpec`` or ``{name, fn, params, weight,
            condition, timeout_s}``), validated and resolved here, before any worker starts.
        num_workers: worker processes (scoring is CPU-bound: about the cores you can spare).
        rows_per_task: rows scored per call of a reward function (batching for functions that
            benefit from it); a failing task is re-issued row by row.
    """

    def __init__(self, rewards: Sequence[RewardSpec | Mapping[str, Any]], num_workers: int = 2,
                 rows_per_task: int = 1) -> None:
        if num_workers < 1 or rows_per_task < 1:
            raise ValueError(f"num_workers ({num_workers}) and rows_per_task ({rows_per_task}) must be >= 1")
        self.specs = [RewardSpec.from_dict(r) for r in rewards]
        fns = check_specs(self.specs)
        self.timeouts = [spec.call_timeout_s(fn) for spec, fn in zip(self.specs, fns)]
        self.rows_per_task = rows_per_task
        self._payload = cloudpickle.dumps(self.specs)
        self._workers = [_Worker(self._payload) for _ in range(num_workers)]
        self._startup_failures = 0

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              columns: Mapping[str, Sequence[Any]] | None = None) -> ScoreResult:
        """[N] prompts and completions, plus per-row columns (ground_truth, response_length, ...)."""
        n, k = len(completions), len(self.specs)
        columns = dict(columns or {})
        if len(prompts) != n or any(len(v) != n for v in columns.values()):
            lengths = {"prompts": len(prompts), **{c: len(v) for c, v in columns.items()}}
            raise ValueError(f"score: every column needs {n} rows (one per completion); got {lengths}")
        run = _Scoring(n, k)
        tasks = deque(_Task(list(range(i, min(i + self.rows_per_task, n))), list(range(k)))
                      for i in range(0, n, self.rows_per_task))
        busy: dict[Connection, tuple[_Worker, _Task, float]] = {}  # with its deadline
        while tasks or busy:
            for w in self._workers:
                if tasks and w.ready and all(w is not b[0] for b in busy.values()):
                    task = tasks.popleft()
                    rows = task.rows
                    w.conn.send((task.rewards, [prompts[i] for i in rows],
                                 [completions[i] for i in rows],
                                 {c: [v[i] for i in rows] for c, v in columns.items()}))
                    busy[w.conn] = (w, task, self._deadline(task))
            starting = [w.conn for w in self._workers if not w.ready]
            deadlines = [b[2] for b in busy.values()]
            left = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for conn in wait(list(busy) + starting, timeout=left):
                self._receive(conn, busy, tasks, run)
            now = time.monotonic()
            for conn, (w, task, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[conn]
                    self._replace(w)
                    seconds = len(task.rows) * self.timeouts[task.rewards[0]]
                    # the reward being scored timed out; the ones after it never started
                    hung = _Task(task.rows, task.rewards[:1])
                    self._failed(hung, f"timeout after {seconds:g} s (process tree killed)", tasks,
                                 run, timeout=True)
                    if task.rewards[1:]:
                        tasks.append(_Task(task.rows, task.rewards[1:]))
        return run.result(self.specs)

    def _receive(self, conn, busy, tasks, run) -> None:
        worker = next(w for w in self._workers if w.conn is conn)
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            entry = busy.pop(conn, None)
            worker.process.join(timeout=1.0)  # its pipe closes before it is reaped: wait for the code
            code = worker.process.exitcode
            if not worker.ready:
                self._startup_failures += 1
                if self._startup_failures > 3:
                    raise RuntimeError(f"reward workers keep dying at start (exit code {code}); "
                                       "their traceback is on stderr")
            self._replace(worker)
            if entry is not None:
                self._failed(entry[1], f"reward worker died (exit code {code})", tasks, run)
            return
        if msg == "ready":
            worker.ready = True
            return
        j, values, error, seconds = msg
        w, task, _ = busy[conn]
        task.rewards.remove(j)
        if task.rewards:
            busy[conn] = (w, task, self._deadline(task))
        else:
            del busy[conn]
        if values is not None:
            run.record(task.rows, j, values, seconds)
        elif len(task.rows) > 1:  # isolate the failing row(s)
            tasks.extend(_Task([i], [j]) for i in task.rows)
        else:
            run.fail(task.rows[0], j, error)

    def _deadline(self, task: _Task) -> float:
        """When the reward now being scored (the task's first) must have answered."""
        return time.monotonic() + len(task.rows) * self.timeouts[task.rewards[0]]

    def _failed(self, task: _Task, reason: str, tasks, run, timeout: bool = False) -> None:
        if len(task.rows) * len(task.rewards) > 1:
            tasks.extend(_Task([i], [j]) for i in task.rows for j in task.rewards)
            return
        run.fail(task.rows[0], task.rewards[0], reason, timeout=timeout)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._payload)

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.process.join(timeout=2)
            if w.process.is_alive():
                w.kill()
        self._workers = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Scoring:
    """Accumulates one score() call."""

    def __init__(self, n: int, k: int) -> None:
        self.values = np.full((n, k), np.nan, np.float32)
        self.errors = [[""] * k for _ in range(n)]
        self.seconds = np.zeros(k)
        self.scored = np.zeros(k)
        self.timeouts = np.zeros(k, int)

    def record(self, rows: list[int], k: int, values: list[float], seconds: float) -> None:
        self.values[rows, k] = values
        self.seconds[k] += seconds
        self.scored[k] += len(rows)

    def fail(self, row: int, k: int, error: str, timeout: bool = False) -> None:
        self.errors[row][k] = error or "reward failed"
        self.timeouts[k] += timeout

    def result(self, specs: Sequence[RewardSpec]) -> ScoreResult:
        stored = apply_conditions(self.values, specs)
        names = [s.name for s in specs]
        for k, spec in enumerate(specs):
            if spec.condition is None:
                continue
            gate = names.index(spec.condition.on)
            for i in np.flatnonzero(np.isnan(stored[:, k]) & ~np.isnan(self.values[:, k])):
                self.errors[i][k] = f"condition on {spec.condition.on!r}: " + (
                    self.errors[i][gate] or "gate could not be computed")
        metrics: dict[str, float] = {}
        n = len(stored)
        for k, name in enumerate(names):
            col = stored[:, k]
            valid = col[~np.isnan(col)]
            failed = sum(1 for row in self.errors if row[k])
            metrics[f"rewards/{name}/mean"] = float(valid.mean()) if len(valid) else math.nan
            metrics[f"rewards/{name}/std"] = float(valid.std(ddof=1)) if len(valid) > 1 else math.nan
            metrics[f"rewards/{name}/failure_rate"] = failed / n if n else 0.0
            metrics[f"rewards/{name}/timeouts"] = float(self.timeouts[k])
            metrics[f"rewards/{name}/latency_s"] = (
                float(self.seconds[k] / self.scored[k]) if self.scored[k] else math.nan)
        return ScoreResult(stored, self.errors, metrics)
