"""Worker processes that user code runs in, so that it can be killed: started from one fork
server per process that has imported the modules they need, so a new one starts in milliseconds.

``fork_context(modules)``: the multiprocessing context to start them with, the fork server's
preload widened with ``modules`` (a process's fork server is one, shared by the reward pool and
the environment processes: the preload is the union of what each asked before it started;
modules asked after are imported by each worker). ``starting()``: held while a process starts
(``main_script_hidden``). ``leader_of_own_group()``: the first thing a worker does.
``answer_requests(conn, handle)``: a worker's loop, every request answered whatever the code
it runs does. ``WorkerProcess``: the owner's handle on one (its pipe, its kill).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterable, Iterator

_WANTED: dict[str, None] = {}
_LOCK = threading.Lock()


def fork_context(modules: Iterable[str]):
    """The context worker processes start in: a fork server that has imported ``modules`` (and
    those earlier callers asked for), or spawn where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    with _LOCK:
        _WANTED.update(dict.fromkeys(modules))
        ctx.set_forkserver_preload(list(_WANTED))  # takes effect only before the server starts
    return ctx


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """While a worker (or the fork server) starts: multiprocessing re-runs the parent's
    ``__main__`` script in each child (as ``__mp_main__``, for functions pickled by reference from
    it). A Ray actor's is Ray's ``default_worker.py``, which imports Ray: ~40 MiB and 0.3 s per
    worker. A worker's function lives in a module, and user functions travel by value
    (cloudpickle), so no child needs the script."""
    main = sys.modules["__main__"]
    with _LOCK:
        path = main.__dict__.pop("__file__", None)
        try:
            yield
        finally:
            if path is not None:
                main.__file__ = path


def leader_of_own_group() -> None:
    """A worker's first step: its own session, and the reaper of its descendants' orphans (a
    double fork that detaches stays below it), so that a kill of its tree
    (``gdpo_ray.reaper.kill_tree``) reaches every process it starts, and a terminal's Ctrl-C
    reaches the run, which stops it, not it directly. Not killed with its parent: its owner's
    reaper (``gdpo_ray.reaper.Reaper``) kills its tree when the owner ends, which a worker dead
    first would leave the processes that left its session out of reach of."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):  # a process it starts that detaches stays below it, in reach
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def answer_requests(conn: Any, handle: Callable[[Any], Any], stop: Callable[[], None] = lambda: None) -> None:
    """Answers each request read from ``conn`` with ``("ok", handle(request))``, or ``("raised",
    text)`` where it raised anything (``SystemExit`` included: the code's failure, answered) or
    its value cannot be sent back, until a request is None (then ``stop()``) or the owner is gone."""
    from gdpo_ray.rewards.adapters import failure_text

    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the owner is gone: so is this
            return
        if request is None:
            with contextlib.suppress(Exception):
                stop()
            return
        try:
            reply = ("ok", handle(request))
        except BaseException as err:  # noqa: BLE001 - answered
            reply = ("raised", failure_text(err))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except BaseException as err:  # noqa: BLE001 - a value that cannot be pickled
            conn.send(("raised", f"the result cannot be sent back: {failure_text(err)}"))


class WorkerProcess:
    """A worker process started from ``ctx`` running ``target(conn, *args)``, and the owner's
    end of its pipe (``conn``); on ``reaper``'s list while it lives, where one is given.
    ``daemon``: ended with its owner's interpreter (a daemon cannot start processes of
    multiprocessing's own)."""

    def __init__(self, ctx: Any, target: Callable, args: tuple, reaper: Any = None, daemon: bool = True,
                 name: str | None = None) -> None:
        from gdpo_ray.reaper import start_time

        try:  # starting a process needs a current directory: Ray may have replaced the job's
            os.getcwd()  # working-dir copy under this process (the same path, a new copy)
        except FileNotFoundError:
            os.chdir("/")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=daemon, name=name)
        with starting():
            self.process.start()
        child.close()
        self.started_at, self.reaper = start_time(self.process.pid), reaper  # with the pid: this process
        if reaper is not None:
            reaper.add(self.process.pid)
        self.alive = True

    def kill(self) -> None:
        """Kills it and every process it started (``gdpo_ray.reaper.kill_tree``; ended already:
        what it left), and reaps it."""
        from gdpo_ray.reaper import kill_tree

        if self.alive:
            self.alive = False
            kill_tree(self.process.pid, self.started_at)
            if self.process.is_alive():
                self.process.kill()
            self.process.join(timeout=5)
            self.conn.close()
            if self.reaper is not None:
                self.reaper.discard(self.process.pid)
