"""The reward scoring pool a rollout actor uses: worker processes, timeouts, kills, retries, NaN.

Rewards never run in the trainer or rollout process. Worker processes (``actors.reward_worker``:
forked from a server that has imported the reward modules, so a new one starts in milliseconds;
each the leader of its own session, so that its whole process tree can be killed) score tasks
of (rows, rewards), one reward call at a time, calling each function as TRL does
(``gdpo_ray.rewards.call_reward``).

Every (row, reward) that cannot be scored is NaN with its error text, of one of three classes
(the text starts with it; ``failure_kind`` reads it back):
  - ``error:``   the reward raised (a batched call that raises is re-scored row by row, so only
                 the rows that fail are lost);
  - ``timeout:`` the call ran past its ``timeout_s`` (one sample's; a call of several rows that
                 runs over is re-scored row by row first): its worker's process tree is killed;
  - ``infra:``   the scoring infrastructure failed (the worker died, or the reward raised
                 ``RewardInfraError``, e.g. the code sandbox is unavailable): retried
                 ``INFRA_RETRIES`` times first.
Nothing is ever replaced by 0.0. Conditions (``RewardSpec.condition``) are applied to the
scored values, so the returned columns are what is stored and trained on.

Hangs cost about one timeout per call of ``score``, not one per row: a call that has run
``PARK_AFTER_S`` while its worker sleeps (not runnable) and used at most half a core, i.e. it
waits (sleeps, a socket, a judge server), is parked: it no longer counts against ``num_workers`` and another worker takes
the next task, so blocked calls time out side by side. Calls that compute (and rewards that run
programs in a sandbox, which bound their own time) are never parked: CPU-bound hangs cost one
timeout per worker.

No worker outlives the pool, whatever its rewards do: a worker whose call timed out is killed
with every process it started (``gdpo_ray.reaper.kill_tree``: its session, its group, their
descendants) and replaced; ``close`` kills the busy workers at once and stops the idle ones; and
the pool's reaper (``gdpo_ray.reaper.Reaper``, a small detached process told of every worker)
kills every worker left when the pool's process ends without ``close`` (a Ray actor killed at
the end of a run while a reward sleeps: its workers and their children would otherwise be left
running, owned by init).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping, Sequence

import cloudpickle
import numpy as np

from actors.reward_worker import PARK_AFTER_S, Task, Worker, fork_server
from gdpo_ray.reaper import Reaper
from gdpo_ray.rewards import (NOT_APPLICABLE, RewardSpec, TrainerState, apply_conditions, check_specs, reward_specs,
                              failure_kind, takes_environments)

logger = logging.getLogger(__name__)

#: parked workers a pool may hold beside its ``num_workers``
MAX_PARKED = 64
#: retries of a (row, reward) whose scoring infrastructure failed
INFRA_RETRIES = 2


@dataclasses.dataclass
class ScoreResult:
    values: np.ndarray  # [N, K] float32 stored (conditioned) rewards; NaN = could not be computed
    errors: list[list[str]]  # [N][K] why a value is NaN ("" where it was computed)
    metrics: dict[str, float]  # rewards/<name>/{mean,std,failure_rate,errors,timeouts,...}


class RewardPool:
    """Scores completions with K rewards in worker processes.

    Args:
        rewards: K reward declarations (``RewardSpec`` or ``{name, fn, params, weight,
            condition, timeout_s}``), validated and resolved here, before any worker starts.
        num_workers: worker processes computing at once (scoring is CPU-bound: about the
            cores you can spare); parked workers (see the module docstring) come on top.
        rows_per_call: rows scored per call of a reward function. None (the default): a plain
            reward gets a score call's rows in one call per worker (as TRL calls it: once per
            batch), a sandboxed (code) reward one row per call. A call of several rows has one
            sample's timeout; a call that fails or runs over is re-issued row by row (each
            with its own timeout), and a reward whose batched call ran over is scored row by
            row from then on.
    """

    def __init__(self, rewards: Sequence[RewardSpec | Mapping[str, Any]],
                 num_workers: int = 1,
                 rows_per_call: int | None = None) -> None:
        if num_workers < 1 or (rows_per_call is not None and rows_per_call < 1):
            raise ValueError(f"num_workers ({num_workers}) and rows_per_call ({rows_per_call}) must be >= 1")
        self.specs = reward_specs(rewards)
        fns = check_specs(self.specs)
        self.timeouts = [None if fn is None else spec.call_timeout_s(fn) for spec, fn in zip(self.specs, fns)]
        # columns not scored here (``score``'s ``given`` and ``judged``): an environment's own (``fn:
        # environment``), the rewards that read its instances, called where the instances live
        # (``local``), and the judges' criteria (``fn: judge``: ``actors.judging``)
        self.environment_columns = [s.name for s in self.specs if s.from_environment]
        self.judge_columns = [s.name for s in self.specs if s.from_judge]
        self.local = {s.name: fn for s, fn in zip(self.specs, fns) if fn is not None and takes_environments(fn)}
        self.given = [*self.environment_columns, *self.local]
        # sandboxed rewards wait on programs that compute: never parked
        self.parkable = [not hasattr(fn, "min_timeout_s") for fn in fns]
        self.num_workers, self.rows_per_call = num_workers, rows_per_call
        # rewards scored one row per call: sandboxed ones, and any whose batched call ran over
        self._row_by_row = {j for j, fn in enumerate(fns) if hasattr(fn, "min_timeout_s")}
        self._cwd = os.getcwd()
        self._payload = cloudpickle.dumps((self.specs, list(sys.path), self._cwd))
        self._ctx = fork_server(self.specs)
        self._lock = threading.Lock()  # close() may come from another thread than score()
        self._closed = False
        self._reaper = Reaper()
        self._workers: list[Worker] = []
        for _ in range(num_workers):
            self._add_worker()
        self._startup_failures = 0
        self.parked = 0  # calls parked so far (waiting while others were scored)

    def _add_worker(self) -> Worker:
        """A worker process, in the pool and on its reaper's list, forked from the process's fork
        server, which has imported the reward modules (started at the pool's first worker: one
        spawn's time once, then milliseconds each). Never a child of the pool's own process: Ray
        kills a killed actor's children before the reaper can look, and a worker killed so
        would leave the processes that left its session to init."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward pool was closed while it was scoring")
            worker = Worker(self._ctx, self._payload, self._cwd)
            self._reaper.add(worker.process.pid)
            self._workers.append(worker)
        return worker

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def score(self, prompts: Sequence[Any], completions: Sequence[Any],
              columns: Mapping[str, Sequence[Any]] | None = None,
              completion_ids: Sequence[Sequence[int]] | None = None,
              trainer_state: TrainerState | None = None,
              given: Mapping[str, GivenColumn] | None = None,
              judged: Callable[[], Mapping[str, GivenColumn]] | None = None) -> ScoreResult:
        """[N] prompts and completions (strings, or chat messages), plus per-row columns
        (ground_truth, response_length, ...) and the completions' token ids. ``given``: the
        environment's columns (``fn: environment``), by name, as the rollouts scored them;
        ``judged``: called once the workers are done, the judges' columns (``fn: judge``, judged
        meanwhile). Their conditions apply as any reward's."""
        n, k = len(completions), len(self.specs)
        columns = dict(columns or {})
        ids = list(completion_ids) if completion_ids is not None else [[] for _ in range(n)]
        if len(prompts) != n or len(ids) != n or any(len(v) != n for v in columns.values()):
            lengths = {"prompts": len(prompts), "completion_ids": len(ids),
                       **{c: len(v) for c, v in columns.items()}}
            raise ValueError(f"score: every column needs {n} rows (one per completion); got {lengths}")
        state = trainer_state or TrainerState()
        run = _Scoring(n, k)
        for name in self.given:
            run.take(self.names.index(name), *(dict(given or {}).get(name) or _not_given(n)))
        pending = self._tasks(n, k)

        def start(w: Worker, task: Task) -> None:
            rows = task.rows
            kwargs = {c: [v[i] for i in rows] for c, v in columns.items()}
            kwargs |= {"prompts": [prompts[i] for i in rows],
                       "completions": [completions[i] for i in rows],
                       "completion_ids": [ids[i] for i in rows], "trainer_state": state}
            w.send(task, kwargs, self.timeouts[task.rewards[0]])

        while pending or any(w.task for w in self._workers):
            if self._closed:
                raise RuntimeError("the reward pool was closed while it was scoring")
            for w in self._workers:
                if pending and w.ready and w.task is None:
                    start(w, pending.popleft())
            self._grow(pending)
            now = time.monotonic()
            busy = [w for w in self._workers if w.task is not None]
            wake = [w.deadline for w in busy]
            if pending and any(not w.parked and self.parkable[w.task.rewards[0]] for w in busy):
                wake.append(now + PARK_AFTER_S / 2)  # look again for calls that only wait
            conns = [w.conn for w in busy] + [w.conn for w in self._workers if not w.ready]
            try:
                ready = wait(conns, timeout=max(0.0, min(wake) - now) if wake else None)
            except (OSError, ValueError):  # a pipe closed under it: by close(), from another thread
                if self._closed:
                    raise RuntimeError("the reward pool was closed while it was scoring") from None
                raise
            for conn in ready:
                worker = next((w for w in self._workers if w.conn is conn), None)
                if worker is not None:  # None: close() took it meanwhile (the loop's next turn raises)
                    self._receive(worker, pending, run, start)
            now = time.monotonic()
            for w in [w for w in self._workers if w.task is not None]:
                if now >= w.deadline:
                    self._timed_out(w, pending, run)
                elif pending and not w.parked and self.parkable[w.task.rewards[0]] and w.blocked(now):
                    w.parked = True
                    self.parked += 1
        self._settle()
        judge_columns = dict(judged() if judged is not None else {})
        for name in self.judge_columns:
            run.take(self.names.index(name), *(judge_columns.get(name) or _not_given(n, "judge")))
        for j, spec in enumerate(self.specs):
            if run.timeouts[j]:
                logger.warning("reward %r timed out on %d of %d rows (timeout_s %g, process "
                               "trees killed)", spec.name, run.timeouts[j], n, self.timeouts[j])
        return run.result(self.specs)

    def _tasks(self, n: int, k: int) -> deque:
        """The calls of one score: rewards scored row by row get a task per row, the others
        share tasks of ``rows_per_call`` rows (default: the rows split among the workers)."""
        scored = [j for j in range(k) if self.specs[j].name not in self.given and not self.specs[j].from_judge]
        single = [j for j in scored if j in self._row_by_row]
        batched = [j for j in scored if j not in self._row_by_row]
        size = self.rows_per_call or max(1, math.ceil(n / self.num_workers))
        tasks = deque(Task(list(range(i, min(i + size, n))), batched) for i in range(0, n, size) if batched)
        tasks.extend(Task([i], single) for i in range(n) if single)
        return tasks

    def _grow(self, pending: deque) -> None:
        """Starts workers while fewer than ``num_workers`` are computing or free."""
        if not pending:
            return
        working = sum(1 for w in self._workers if not w.parked)
        want = min(len(pending), self.num_workers - working,
                   self.num_workers + MAX_PARKED - len(self._workers))
        for _ in range(max(0, want)):
            self._add_worker()

    def _settle(self) -> None:
        """Back to ``num_workers`` after a call of ``score``: idle extra workers stop, killed
        ones are replaced (the next call starts at once)."""
        if self._closed:
            return
        extra = self._workers[self.num_workers:]
        self._workers = self._workers[:self.num_workers]
        self._stop_all(extra)
        while len(self._workers) < self.num_workers:
            self._add_worker()

    def _receive(self, worker: Worker, pending: deque, run: "_Scoring", start) -> None:
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            self._died(worker, pending, run)
            return
        if msg == "ready":
            worker.ready = True
            return
        if isinstance(msg, tuple) and msg[0] == "failed":
            self.close()
            raise RuntimeError(f"a reward worker could not load the rewards: {msg[1]}")
        values, kind, error, seconds = msg
        task = worker.task
        j, rest = task.rewards[0], task.rewards[1:]
        worker.task, worker.parked = None, False  # free, and computing again when next sent work
        if values is not None:
            run.record(task.rows, j, values, seconds)
        else:
            self._failed(Task(task.rows, [j], task.attempt), kind, error, pending, run)
        if rest:  # the task's next reward, on the same worker (its caches are warm)
            start(worker, Task(task.rows, rest, task.attempt))

    def _died(self, worker: Worker, pending: deque, run: "_Scoring") -> None:
        worker.process.join(timeout=1.0)  # its pipe closes before it is reaped: wait for the code
        code = worker.process.exitcode
        self._remove(worker)
        if not worker.ready:
            self._startup_failures += 1
            if self._startup_failures > 3:
                self.close()
                raise RuntimeError(f"reward workers keep dying at start (exit code {code}); "
                                   "their traceback is on stderr")
            if len(self._workers) < self.num_workers:
                self._add_worker()
            return
        task = worker.task
        if task is not None:
            self._failed(Task(task.rows, task.rewards[:1], task.attempt), "infra",
                         f"reward worker died (exit code {code})", pending, run)
            if task.rewards[1:]:
                pending.append(Task(task.rows, task.rewards[1:], task.attempt))

    def _timed_out(self, worker: Worker, pending: deque, run: "_Scoring") -> None:
        task = worker.task
        self._remove(worker)
        j, seconds = task.rewards[0], self.timeouts[task.rewards[0]]
        if len(task.rows) > 1 and j not in self._row_by_row:
            self._row_by_row.add(j)
            logger.info("reward %r: a call of %d rows ran over its timeout (%g s); it is scored "
                        "row by row from now on", self.specs[j].name, len(task.rows), seconds)
        self._failed(Task(task.rows, task.rewards[:1], task.attempt), "timeout",
                     f"no answer after {seconds:g} s (process tree killed)", pending, run)
        if task.rewards[1:]:  # the rewards after it never started
            pending.append(Task(task.rows, task.rewards[1:], task.attempt))

    def _failed(self, task: Task, kind: str, error: str, pending: deque, run: "_Scoring") -> None:
        """One reward of ``task`` failed: rows are isolated, infrastructure is retried."""
        if len(task.rows) > 1:
            pending.extend(Task([i], task.rewards, task.attempt) for i in task.rows)
        elif kind == "infra" and task.attempt < INFRA_RETRIES:
            pending.append(Task(task.rows, task.rewards, task.attempt + 1))
        else:
            attempts = f" ({task.attempt + 1} attempts)" if kind == "infra" else ""
            run.fail(task.rows[0], task.rewards[0], kind, error + attempts)

    def _remove(self, worker: Worker) -> None:
        """Kills ``worker`` and every process it started."""
        worker.kill()
        self._reaper.discard(worker.process.pid)
        if worker in self._workers:
            self._workers.remove(worker)

    def _stop_all(self, workers: Sequence[Worker], grace_s: float = 2.0) -> None:
        """Ends ``workers``: a busy one (a call running, perhaps forever) is killed at once; an
        idle one is told to stop, and killed if it has not within ``grace_s`` (all of them
        together: a hundred parked workers cost one grace, not a hundred); then what any of them
        left running in its session (a reward's background process) is killed."""
        idle = []
        for w in workers:
            if w.task is None:
                try:
                    w.conn.send(None)
                    idle.append(w)
                    continue
                except (OSError, ValueError):
                    pass
            w.kill()
            self._reaper.discard(w.process.pid)
        deadline = time.monotonic() + grace_s
        for w in idle:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            w.kill()
            self._reaper.discard(w.process.pid)

    def close(self) -> None:
        """Ends every worker (``_stop_all``), then the reaper, which kills any worker left (one
        started by a ``score`` running on another thread meanwhile). ``score`` raises after it."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        self._stop_all(workers)
        self._reaper.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: an environment's column as the rollouts scored it: per row (value, failure kind or "", error text)
GivenColumn = tuple[Sequence[float], Sequence[str], Sequence[str]]


def _not_given(n: int, source: str = "environment") -> GivenColumn:
    why = (f"the {source}'s column was not given to the scoring "
           + ("(no environment ran)" if source == "environment" else "(no judge was asked)"))
    return [math.nan] * n, ["error"] * n, [why] * n


class _Scoring:
    """Accumulates one score() call."""

    def __init__(self, n: int, k: int) -> None:
        self.values = np.full((n, k), np.nan, np.float32)
        self.errors = [[""] * k for _ in range(n)]
        self.seconds = np.zeros(k)
        self.scored = np.zeros(k)
        self.counts = {kind: np.zeros(k, int) for kind in ("error", "timeout", "infra")}

    @property
    def timeouts(self) -> np.ndarray:
        return self.counts["timeout"]

    def record(self, rows: list[int], k: int, values: list[float], seconds: float) -> None:
        self.values[rows, k] = values
        self.seconds[k] += seconds
        self.scored[k] += len(rows)

    def fail(self, row: int, k: int, kind: str, error: str) -> None:
        self.errors[row][k] = f"{kind}: {error or 'reward failed'}"
        self.counts[kind][k] += 1

    def take(self, k: int, values: Sequence[float], kinds: Sequence[str], errors: Sequence[str]) -> None:
        """Column ``k`` as given (an environment's): per row its value, and where it failed the
        failure's kind ("error" or "timeout") and text, or where it does not apply to the row
        ``NOT_APPLICABLE`` (another environment's column: no failure); the value is then NaN."""
        self.values[:, k] = values
        for row, (kind, error) in enumerate(zip(kinds, errors)):
            if kind == NOT_APPLICABLE:
                self.values[row, k] = np.nan
                self.errors[row][k] = f"{NOT_APPLICABLE}: {error}"
            elif kind:
                self.values[row, k] = np.nan
                self.fail(row, k, kind, error)

    def result(self, specs: Sequence[RewardSpec]) -> ScoreResult:
        stored = apply_conditions(self.values, specs)
        names = [s.name for s in specs]
        for k, spec in enumerate(specs):
            if spec.condition is None:
                continue
            gate = names.index(spec.condition.on)
            for i in np.flatnonzero(np.isnan(stored[:, k]) & ~np.isnan(self.values[:, k])):
                if failure_kind(self.errors[i][gate]) == NOT_APPLICABLE:  # nor does the reward it gates
                    self.errors[i][k] = f"{NOT_APPLICABLE}: on {spec.condition.on!r}, which does not apply"
                    continue
                self.errors[i][k] = f"condition: on {spec.condition.on!r}, " + (
                    self.errors[i][gate] or "which could not be computed")
        metrics: dict[str, float] = {}
        n = len(stored)
        for k, name in enumerate(names):
            col = stored[:, k]
            valid = col[~np.isnan(col)]
            failed = sum(1 for row in self.errors if row[k] and failure_kind(row[k]) != NOT_APPLICABLE)
            metrics[f"rewards/{name}/mean"] = float(valid.mean()) if len(valid) else math.nan
            metrics[f"rewards/{name}/std"] = float(valid.std(ddof=1)) if len(valid) > 1 else math.nan
            metrics[f"rewards/{name}/failure_rate"] = failed / n if n else 0.0
            metrics[f"rewards/{name}/errors"] = float(self.counts["error"][k])
            metrics[f"rewards/{name}/timeouts"] = float(self.counts["timeout"][k])
            metrics[f"rewards/{name}/infra_failures"] = float(self.counts["infra"][k])
            metrics[f"rewards/{name}/latency_s"] = (
                float(self.seconds[k] / self.scored[k]) if self.scored[k] else math.nan)
        return ScoreResult(stored, self.errors, metrics)
