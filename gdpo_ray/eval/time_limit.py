"""Bounds on the time scoring takes.

``ScoringPool``: worker processes that score, each task under its own time limit; a worker whose
task runs past it is killed, with everything it started, and replaced by a new one at the next
task. A scorer stuck in C code that holds the GIL (a huge ``round`` or ``**`` in BFCL's
``MathAPI``, a big integer's ``str``, a catastrophic regex) cannot be stopped by a thread or a
signal, only by ending its process: so a sample costs its limit and nothing more, and the eval
goes on (``gdpo_ray.run.eval_runner.score`` scores every suite but the sandbox ones here).
Workers start from the process's fork server (``gdpo_ray.forks``): milliseconds each, with the
modules it preloaded; the state they score with (a suite) is sent to each once. A pool's reaper
(``gdpo_ray.reaper.Reaper``) kills its workers' trees when the pool's process ends, however it
ends (a worker stuck in C would otherwise outlive a killed eval).

``time_limit``: a bound on a block of scoring in this process, on the main thread, nestable. A
timer thread sends the main thread ``SIGUSR2``, whose handler raises between two bytecodes; a
blocking wait (a sleep, a socket) is cut short by the signal, but a C call that computes and
never returns is not interrupted (hence ``ScoringPool``, and scans of model output that are
linear). Off the main thread there is no limit (a suite with ``parallel_scoring`` waits on the
sandbox, whose calls have their own). Limits nest: an item's (scored in this process) around
each reward call's (``gdpo_ray.eval.rewards_suite``, in a worker too); each raises its own
``ScoringTimeout`` (its ``limit`` says whose), and signals ``math_verify``'s ``SIGALRM``
timeouts do not touch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Hashable, Iterator, Sequence

import cloudpickle

from gdpo_ray.forks import WorkerProcess, answer_requests, fork_context, leader_of_own_group
from gdpo_ray.reaper import Reaper
from gdpo_ray.rewards.adapters import failure_text

SIGNAL = signal.SIGUSR2
#: seconds a scoring process may take to start (the fork server's start, imports, the state's
#: unpickling), before its first task's time starts
START_S = 120.0


class ScoringTimeout(BaseException):
    """Scoring ran past its time limit (a BaseException, so that no ``except Exception`` of a
    scorer swallows it); ``limit``: the ``time_limit`` block whose time was up."""

    def __init__(self, message: str, limit: object = None) -> None:
        super().__init__(message)
        self.limit = limit


def timeout_reason(seconds: float) -> str:
    """What a sample's failure says when its scoring ran past ``seconds``, in a worker or here."""
    return f"timeout: scoring took over {seconds:g} s"


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[object]:
    """Raises ``ScoringTimeout`` in the block once ``seconds`` have passed; yields the block's
    token (the exception's ``limit``)."""
    limit = object()
    if threading.current_thread() is not threading.main_thread():
        yield limit
        return
    deadline, armed = time.monotonic() + seconds, True

    def expire(signum: int, frame: Any) -> None:
        if armed and time.monotonic() >= deadline:
            raise ScoringTimeout(f"timed out after {seconds:g} s", limit)
        if callable(previous):  # an enclosing block's time may be up
            previous(signum, frame)

    previous = signal.signal(SIGNAL, expire)
    timer = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, SIGNAL))
    timer.daemon = True
    timer.start()
    try:
        yield limit
    finally:
        armed = False
        timer.cancel()
        timer.join()
        signal.signal(SIGNAL, previous)


# --- worker processes ---------------------------------------------------------------------------

def _serve(conn: Connection, path: list[str], cwd: str, payload: bytes) -> None:
    """A scoring worker: unpickles ``(fn, state)`` once and says it is ready, then answers each
    task ``fn(state, *args)`` with ``("ok", value)`` or ``("raised", text)``, until told to stop
    (then ``state.close()``, where it has one) or its owner is gone."""
    leader_of_own_group()
    sys.path[:] = path  # the owner's, now (the fork server has those of when it started)
    os.chdir(cwd)
    try:
        fn, state = cloudpickle.loads(payload)
    except BaseException as err:  # noqa: BLE001 - reported to the owner, which raises it
        conn.send(("failed", failure_text(err)))
        return
    conn.send(("ready", None))
    answer_requests(conn, lambda data: fn(state, *cloudpickle.loads(data)),
                    stop=getattr(state, "close", lambda: None))  # what the state started (a suite's) ends too


@dataclasses.dataclass
class _Task:
    key: Hashable
    data: bytes
    limit_s: float


class _Worker(WorkerProcess):
    def __init__(self, ctx: Any, payload: bytes, reaper: Reaper) -> None:
        super().__init__(ctx, _serve, (sys.path, os.getcwd(), payload), reaper, daemon=False,  # a scorer may
                         name="gdpo-scoring")  # start processes
        self.task: _Task | None = None
        self.ready = False  # until then its deadline is its start's, after it its task's
        self.deadline = time.monotonic() + START_S

    def send(self, task: _Task) -> None:
        self.task = task
        if self.ready:
            self.deadline = time.monotonic() + task.limit_s
        try:
            self.conn.send(task.data)
        except OSError:  # it has ended: its answer is the end of its pipe (``_answer``)
            pass



class ScoringPool:
    """Up to ``workers`` processes, each holding ``state`` (sent once, with cloudpickle: the
    constructor raises what pickling it raises), that run ``fn(state, *args)`` for the tasks
    ``submit`` hands in, one at a time each. ``results()`` yields ``(key, value, failure)`` as
    tasks end, tasks submitted meanwhile included: ``failure`` is None and ``value`` is ``fn``'s,
    or ``value`` is None and ``failure`` says why: ``timeout_reason`` (the worker ran past the
    task's limit and was killed), the exception ``fn`` raised (``"Type: text"``), or the worker's
    end (``"the scoring process ended (exit code N)"``). ``fn`` must be importable by reference
    (a module's function or a class's method); ``modules``: those the fork server should import
    (the first user of the process's fork server decides). Use it as a context manager: leaving
    it ends every worker."""

    def __init__(self, fn: Callable[..., Any], state: Any, workers: int, modules: Sequence[str] = ()) -> None:
        self._payload = cloudpickle.dumps((fn, state))
        wanted = ["gdpo_ray.eval.time_limit", fn.__module__, *modules]
        self._ctx = fork_context([m for m in wanted if m != "__main__"])  # a script's: by value
        self._most = max(1, workers)
        self._queue: collections.deque[_Task] = collections.deque()
        self._idle: list[_Worker] = []
        self._busy: list[_Worker] = []
        self._reaper: Reaper | None = None  # started with the first worker

    def submit(self, key: Hashable, args: Sequence[Any], limit_s: float) -> None:
        """Queues ``fn(state, *args)``, to end within ``limit_s`` seconds of its start."""
        self._queue.append(_Task(key, cloudpickle.dumps(tuple(args)), limit_s))

    def results(self) -> Iterator[tuple[Hashable, Any, str | None]]:
        while self._queue or self._busy:
            self._dispatch()
            now = time.monotonic()
            ready = wait([w.conn for w in self._busy], max(0.0, min(w.deadline for w in self._busy) - now))
            for worker in [w for w in self._busy if w.conn in ready]:
                answer = self._answer(worker)
                if answer is not None:
                    yield answer
            now = time.monotonic()
            for worker in [w for w in self._busy if w.deadline <= now]:
                self._busy.remove(worker)
                worker.kill()
                yield worker.task.key, None, (timeout_reason(worker.task.limit_s) if worker.ready else
                                              f"the scoring process did not start within {START_S:g} s")

    def _dispatch(self) -> None:
        while self._queue and (self._idle or len(self._busy) < self._most):
            if not self._idle and self._reaper is None:
                self._reaper = Reaper()
            worker = self._idle.pop() if self._idle else _Worker(self._ctx, self._payload, self._reaper)
            worker.send(self._queue.popleft())
            self._busy.append(worker)

    def _answer(self, worker: _Worker) -> tuple[Hashable, Any, str | None] | None:
        """The task's outcome from its worker's reply (the worker idle again), or from its end;
        None when the worker only said it is ready (its task's time starts then)."""
        key = worker.task.key
        try:
            kind, value = worker.conn.recv()
        except (EOFError, OSError):  # it ended: killed for memory, os._exit, a crash in C
            self._busy.remove(worker)
            worker.process.join(timeout=5)
            code = worker.process.exitcode
            worker.kill()
            return key, None, f"the scoring process ended (exit code {code})"
        if kind == "ready":
            worker.ready, worker.deadline = True, time.monotonic() + worker.task.limit_s
            return None
        self._busy.remove(worker)
        if kind == "failed":
            worker.kill()
            raise RuntimeError(f"a scoring process could not unpickle what it scores with: {value}")
        self._idle.append(worker)
        return (key, value, None) if kind == "ok" else (key, None, value)

    def close(self) -> None:
        """Ends every worker (a busy one killed)."""
        for worker in self._busy:
            worker.kill()
        for worker in self._idle:  # told to stop, all at once, then killed if still there
            with contextlib.suppress(OSError):
                worker.conn.send(None)
        for worker in self._idle:
            worker.process.join(timeout=1)
            worker.kill()
        self._busy, self._idle = [], []
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None

    def __enter__(self) -> "ScoringPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
