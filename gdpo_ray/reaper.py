"""Worker processes reaped whatever happens to their owner: ``kill_tree`` and ``Reaper``.

``kill_tree(leader)`` kills a worker that leads its own session (``gdpo_ray.forks.
leader_of_own_group``) and everything it started: the processes of its session or process
group and every descendant of those (a child that made a session of its own included), found in
/proc and stopped (SIGSTOP) until no new one appears, so that none forks away while they are
killed, then killed (SIGKILL). Without /proc: its process group.

``Reaper``: a small process that an owner of workers (the reward pool) tells of each worker it
starts and of each it has reaped. When the owner's process ends, however it ends (a Ray actor
killed, SIGKILL, a crash: none of the owner's code runs), the reaper's end of the pipe closes and
it kills the tree of every worker still on its list, then exits; ``close()`` (the owner's own
end) does the same. A worker blocked in a reward (a sleep, a socket, C code holding the GIL)
would otherwise outlive the run, with everything it started. The reaper is this file run by a
bare interpreter (``python -I -S``: the standard library only, ~10 MiB, ~20 ms to start), and it
detaches (a second fork, a session of its own), so that whoever kills the owner's children with
it (Ray kills a dead worker's child processes) does not kill the reaper before it has reaped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Iterable

logger = logging.getLogger(__name__)

#: rounds of looking for new processes of a tree being stopped (a tree that still grows after
#: them is killed as found: only a fork bomb gets that far)
STOP_ROUNDS = 50


def _stat(pid: int) -> tuple[int, int, int, int] | None:
    """(parent, process group, session, start time in clock ticks) of a process, from /proc; None
    where it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None where it is gone or unknown:
    with the pid, it names one process (a pid is reused, never with the same start time)."""
    stat = _stat(pid)
    return None if stat is None else stat[3]


def _table() -> dict[int, tuple[int, int, int, int]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


def left_behind(leaders: Iterable[int]) -> set[int]:
    """Those of ``leaders`` (idle workers) that run more than one thread, or have a process in
    their session or below them: work a call started and left running. Without /proc: none."""
    if not os.path.isdir("/proc"):
        return set()
    leaders, out = set(leaders), set()
    for pid, (parent, _, session, _) in _table().items():
        if pid not in leaders:
            out |= {parent, session} & leaders
    for pid in leaders - out:
        try:
            with open(f"/proc/{pid}/status") as f:
                if next(int(line.split()[1]) for line in f if line.startswith("Threads:")) > 1:
                    out.add(pid)
        except (OSError, StopIteration, ValueError):
            continue
    return out


def _tree(leader: int) -> set[int]:
    """``leader``, the processes of its session or process group, and every descendant of those.
    A session or group keeps its number while any process is in it, so the number cannot name
    another's (Linux does not reuse a pid still in use as a group or session id)."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (parent, *_) in table.items():
        children.setdefault(parent, []).append(pid)
    found = {pid for pid, (_, group, session, _) in table.items()
             if pid == leader or group == leader or session == leader}
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    found.discard(os.getpid())
    return found


def kill_tree(leader: int, started: int | None = None) -> None:
    """Kills ``leader`` (a worker that leads its session), its session, its process group and
    all their descendants (the module docstring). ``started``: the leader's ``start_time`` when
    it was known to be the worker; where the pid now names a process that started at another
    time, the worker and its session are long gone and nothing is killed."""
    if not os.path.isdir("/proc"):
        with contextlib.suppress(OSError):
            os.killpg(leader, signal.SIGKILL)
        return
    if started is not None and start_time(leader) not in (None, started):
        return
    stopped: set[int] = set()
    for _ in range(STOP_ROUNDS):
        new = _tree(leader) - stopped
        if not new:
            break
        for pid in new:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= new
    with contextlib.suppress(OSError):
        os.killpg(leader, signal.SIGKILL)
    for pid in stopped:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


class Reaper:
    """The owner's side (the module docstring): ``add`` each worker started, ``discard`` each
    reaped, ``close`` at the end. Where the reaper cannot start (no interpreter to run), the
    owner goes on without it, warned: its own ``close`` still reaps, only its sudden end does not."""

    def __init__(self) -> None:
        self.pid: int | None = None  # the reaper's process
        self._pipe = None
        self._lock = threading.Lock()
        try:
            # no stderr of the owner's: it outlives the owner by a moment, and a caller reading
            # the owner's output to its end (``subprocess.run(capture_output=True)``) would wait on it
            starter = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       start_new_session=True)
        except (OSError, ValueError, TypeError) as err:  # no interpreter to run it (an embedded Python)
            logger.warning("no reaper for worker processes (%s): workers blocked when this process "
                           "is killed outlive it", err)
            return
        line = starter.stdout.readline()
        starter.stdout.close()
        starter.wait()  # the first fork, which exits once the reaper is on its own
        if not line.strip().isdigit():
            starter.stdin.close()
            logger.warning("no reaper for worker processes (it did not start: %r): workers blocked "
                           "when this process is killed outlive it", line)
            return
        self.pid, self._pipe = int(line), starter.stdin

    def add(self, pid: int) -> None:
        self._tell(f"+{pid}\n")

    def discard(self, pid: int) -> None:
        self._tell(f"-{pid}\n")

    def _tell(self, line: str) -> None:
        with self._lock:
            if self._pipe is None:
                return
            try:
                self._pipe.write(line.encode())
                self._pipe.flush()
            except OSError as err:  # it died (killed by hand): go on without it
                logger.warning("the reaper of worker processes is gone (%s)", err)
                self._pipe = None

    def close(self) -> None:
        """The reaper kills the trees of the workers still on its list, then exits."""
        with self._lock:
            pipe, self._pipe = self._pipe, None
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def _serve() -> None:
    """The reaper: detaches, says its pid, then keeps the list until its input ends."""
    if os.fork():
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.stdout.write(f"{os.getpid()}\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    workers: dict[int, int | None] = {}
    for line in sys.stdin.buffer:
        op, pid = line[:1], line[1:].strip()
        if not pid.isdigit():
            continue
        if op == b"+":
            workers[int(pid)] = start_time(int(pid))
        elif op == b"-":
            workers.pop(int(pid), None)
    for pid, started in workers.items():
        kill_tree(pid, started)


if __name__ == "__main__":
    _serve()
