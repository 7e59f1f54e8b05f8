"""``time_limit``: a bound on the time a block of scoring takes, on the main thread, nestable.

A timer thread sends the main thread ``SIGUSR2``, whose handler raises between two bytecodes; a
blocking wait (a sleep, a socket) is cut short by the signal, but a C call that computes and
never returns, such as a catastrophic regex, is not interrupted, which is why the scans of model
output are linear. Off the main thread there is no limit (a
suite with ``parallel_scoring`` waits on the sandbox, whose calls have their own). Limits nest:
an item's (``gdpo_ray.run.eval_runner.score``) around each reward call's
(``gdpo_ray.eval.rewards_suite``); each raises its own ``ScoringTimeout`` (its ``limit`` says
whose), and signals ``math_verify``'s ``SIGALRM`` timeouts do not touch.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Iterator

SIGNAL = signal.SIGUSR2


class ScoringTimeout(BaseException):
    """Scoring ran past its time limit (a BaseException, so that no ``except Exception`` of a
    scorer swallows it); ``limit``: the ``time_limit`` block whose time was up."""

    def __init__(self, message: str, limit: object = None) -> None:
        super().__init__(message)
        self.limit = limit


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
