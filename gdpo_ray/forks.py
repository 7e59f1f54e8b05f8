"""Worker processes that user code runs in, so that it can be killed: started from one fork
server per process that has imported the modules they need, so a new one starts in milliseconds.

``fork_context(modules)``: the multiprocessing context to start them with, the fork server's
preload widened with ``modules`` (a process's fork server is one, shared by the reward pool and
the environment processes: the preload is the union of what each asked before it started;
modules asked after are imported by each worker). ``starting()``: held while a process starts
(``main_script_hidden``). ``leader_of_own_group()``: the first thing a worker does.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from typing import Iterable, Iterator

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
    """A worker's first step: its own session, so that a kill of its tree
    (``gdpo_ray.reaper.kill_tree``) reaches every process it starts, and a terminal's Ctrl-C
    reaches the run, which stops it, not it directly. Not killed with its parent: its owner's
    reaper (``gdpo_ray.reaper.Reaper``) kills its tree when the owner ends, which a worker dead
    first would leave the processes that left its session out of reach of."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
