"""Reward functions that misbehave, for tests of the scoring pool (imported by its workers)."""

import os
import subprocess
import sys
import time


def echo(prompts, completions, **columns):
    """The completion as a number."""
    return [float(c) for c in completions]


def hang_on_7(prompts, completions, **columns):
    """Hangs (with a child process that also hangs) when a completion is "7"."""
    if "7" in completions:
        marker = columns.get("marker", ["gdpo-pool-test"])[0]
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
        time.sleep(600)
    return [float(c) for c in completions]


def raise_on_3(prompts, completions, **columns):
    if "3" in completions:
        raise RuntimeError("cannot score 3")
    return [float(c) * 10 for c in completions]


def die_on_5(prompts, completions, **columns):
    if "5" in completions:
        os._exit(9)
    return [None if c == "4" else 1.0 for c in completions]
