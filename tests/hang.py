"""A hang guard, not a speed check: ``with hang_guard(120, "the scan"):`` fails the test when the
block has not finished after a bound far above its normal time (quadratic scans of hostile input
took minutes; a wait that never ends is the bug such a test exists to catch). Speed itself is
measured by the scripts in benchmarks/, never asserted here."""

import contextlib
import signal

import pytest


@contextlib.contextmanager
def hang_guard(seconds: int, what: str):
    def hung(signum, frame):
        pytest.fail(f"{what} has not finished after {seconds} s: it hangs (or is super-linear)")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
