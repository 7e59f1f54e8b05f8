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


def infra_twice(prompts, completions, folder, **columns):
    """An infrastructure failure on the first two calls (counted in ``folder``), then 1.0."""
    from pathlib import Path

    from gdpo_ray.rewards import RewardInfraError

    calls = len(list(Path(folder).iterdir()))
    (Path(folder) / f"call{calls}").touch()
    if calls < 2:
        raise RewardInfraError("judge server restarting")
    return [1.0 for _ in completions]


def infra_always(prompts, completions, **columns):
    from gdpo_ray.rewards import RewardInfraError

    raise RewardInfraError("sandbox gone")


def fails_on_model_output(prompts, completions, **columns):
    """Passes the start-up check (its placeholders: "" and the ground truth) and raises on
    anything a model writes: a reward broken only in training."""
    truths = columns.get("ground_truth", [None] * len(completions))
    if any(c not in ("", str(t)) for c, t in zip(completions, truths)):
        raise ValueError("model output is not JSON")
    return [0.0 for _ in completions]


def call_sizes(prompts, completions, folder, **columns):
    """1.0 per row; writes the size of each call it gets into ``folder``."""
    import uuid
    from pathlib import Path

    (Path(folder) / f"{len(completions)}-{uuid.uuid4().hex[:8]}").touch()
    return [1.0 for _ in completions]


def parent_main_ran(prompts, completions, **columns):
    """1.0 where this worker ran its parent's ``__main__`` script (as multiprocessing's ``__mp_main__``)."""
    return [float(sys.modules["__main__"].__name__ == "__mp_main__") for _ in completions]


class Stop(BaseException):
    """A user's own BaseException."""


def base_exceptions(prompts, completions, **columns):
    """Raises a BaseException other than KeyboardInterrupt for completions "exit", "stop",
    "generator" and "math-verify" (math-verify's own timeout); 1.0 for the others."""
    from math_verify.errors import TimeoutException

    raised = {"exit": SystemExit("the reward called sys.exit"), "stop": Stop("my own"),
              "generator": GeneratorExit(), "math-verify": TimeoutException("Operation timed out!")}
    for c in completions:
        if c in raised:
            raise raised[c]
    return [1.0 for _ in completions]


def sleep_forever_on_odd(prompts, completions, **columns):
    """Sleeps forever on an odd number, after starting a child that leaves the worker's session
    and process group (``start_new_session``) and sleeps too, its command line carrying the marker."""
    if any(int(c) % 2 for c in completions):
        marker = columns.get("marker", ["gdpo-pool-test"])[0]
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker], start_new_session=True)
        time.sleep(10_000)
    return [float(c) for c in completions]
