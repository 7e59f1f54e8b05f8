"""The reward scoring pool's worker processes (``actors.reward.RewardPool`` runs them).

A worker (``worker_main``) resolves the reward functions once, then scores one reward call at a
time, calling each function as TRL does (``gdpo_ray.rewards.call_reward``), and sends back the
values or the failure (``error``: the reward raised, anything but ``KeyboardInterrupt``:
``SystemExit``, ``GeneratorExit`` and math-verify's ``TimeoutException`` are BaseExceptions, and
the reward's failure on its rows all the same; ``infra``: ``RewardInfraError``). It leads its own
session, so that a kill (``Worker.kill``: ``gdpo_ray.reaper.kill_tree``) reaches everything it
started; where the pool's process ends without closing it, the pool's reaper kills it so.
Workers fork from the process's fork server, which has imported the reward modules
(``gdpo_ray.forks.fork_context``), so a new one starts in milliseconds.

A call that has run ``PARK_AFTER_S`` while its worker sleeps (not runnable) and used at most half
a core meanwhile waits on something (``Worker.blocked``): the pool parks it (the pool's module
docstring).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Sequence

import cloudpickle

from gdpo_ray.forks import WorkerProcess, fork_context, leader_of_own_group
from gdpo_ray.rewards import RewardInfraError, RewardSpec, call_reward, failure_text, to_floats

#: a call waiting this long with an idle worker is parked (see the module docstring)
PARK_AFTER_S = 0.05
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclasses.dataclass
class Task:
    """Rows to score with rewards, one call per reward, by one worker."""

    rows: list[int]
    rewards: list[int]  # scored in this order, one call each, by one worker
    attempt: int = 0  # infra retries used


def worker_main(conn: Connection, payload: bytes) -> None:
    """A scoring worker: resolves the reward functions once, then scores calls until told to stop."""
    leader_of_own_group()
    specs, path, cwd = cloudpickle.loads(payload)
    sys.path[:] = path  # the pool's, now (the fork server has those of when it started)
    os.chdir(cwd)
    try:
        for module in preloaded_modules(specs):
            importlib.import_module(module)
        fns = [spec.resolve() if spec.scored_by_function else None for spec in specs]
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - SystemExit at import too: the pool raises it
        conn.send(("failed", failure_text(err)))
        return
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the pool's process ended (a run's end stops its actors): so does this
            return
        if msg is None:
            return
        k, kwargs = msg
        n = len(kwargs["completions"])
        start = time.perf_counter()
        try:
            values = to_floats(call_reward(fns[k], **kwargs), n, specs[k].name)
            kind, error = "", ""
        except RewardInfraError as err:
            values, kind, error = None, "infra", failure_text(err)
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # noqa: BLE001 - SystemExit, GeneratorExit, ...: the reward's failure
            values, kind, error = None, "error", failure_text(err)
        try:
            conn.send((values, kind, error, time.perf_counter() - start))
        except OSError:  # BrokenPipeError: the pool is gone
            return


def _proc_stat(pid: int) -> tuple[str, float] | None:
    """(scheduler state: R running or runnable, S sleeping, D waiting on I/O, ...; user +
    system CPU seconds) of a process (Linux /proc), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def preloaded_modules(specs: Sequence[RewardSpec]) -> list[str]:
    """The modules a worker scores with: imported before it says it is ready (or by the server
    it forks from), not at the first call."""
    modules = ["actors.reward_worker", "gdpo_ray.rewards"]
    for spec in specs:
        fn = spec.fn if spec.fn is not None else spec.name
        if isinstance(fn, str) and ":" in fn:
            modules.append(fn.removeprefix("verl:").split(":")[0])
        elif fn == "math_correctness":
            modules.append("math_verify")
    return list(dict.fromkeys(modules))


def fork_server(specs: Sequence[RewardSpec]):
    """The process's fork server, its preload widened with the reward modules (spawn where there
    is none)."""
    return fork_context(preloaded_modules(specs))


class Worker(WorkerProcess):
    """A scoring worker (the pool puts it on its reaper's list itself)."""

    def __init__(self, ctx, payload: bytes, cwd: str) -> None:
        try:  # starting a process needs a current directory: Ray may have replaced the job's
            os.getcwd()  # working-dir copy under this process (the same path, a new copy)
        except FileNotFoundError:
            os.chdir(cwd if os.path.isdir(cwd) else "/")
        super().__init__(ctx, worker_main, (payload,))
        self.ready = False
        self.task: Task | None = None  # the task whose first reward is being scored
        self.deadline = self.started = 0.0
        self.cpu_at_start: float | None = None
        self.parked = False

    def send(self, task: Task, kwargs: dict, timeout_s: float) -> None:
        self.task, self.parked = task, False
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s  # one sample's, for a call of several rows too
        stat = _proc_stat(self.process.pid)
        self.cpu_at_start = stat[1] if stat else None
        self.conn.send((task.rewards[0], kwargs))

    def blocked(self, now: float) -> bool:
        """Waiting (not computing) for at least PARK_AFTER_S since the call started: asleep now
        (a computing process is runnable, R, even while other processes hold the CPUs) and
        having used at most half a core meanwhile."""
        elapsed = now - self.started
        if elapsed < PARK_AFTER_S or self.cpu_at_start is None:
            return False
        stat = _proc_stat(self.process.pid)
        return stat is not None and stat[0] in "SD" and stat[1] - self.cpu_at_start <= 0.5 * elapsed


