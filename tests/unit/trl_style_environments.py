"""Environment classes in the shape TRL's environment_factory takes (written here, not copied):
public methods are the tools, typed and documented; ``reset(**row)`` starts a rollout."""

import asyncio
import sys
import threading


# --8<-- [start:calculator]
class Calculator:
    """A calculator with a memory, scored on whether the memory holds the row's target."""

    def reset(self, **row):
        self.memory, self.target = 0.0, float(row.get("target", 0))
        return f"The memory starts at {self.memory:g}."

    def add(self, value: float) -> str:
        """Adds a number to the memory.

        Args:
            value: The number to add.
        """
        self.memory += value
        return f"memory = {self.memory:g}"

    def divide(self, by: float) -> str:
        """Divides the memory by a number.

        Args:
            by: The divisor.
        """
        self.memory /= by  # ZeroDivisionError for 0: the model is told
        return f"memory = {self.memory:g}"

    def recall(self) -> float:
        """The number in the memory."""
        return self.memory

    def get_rewards(self):
        return {"state": float(self.memory == self.target), "memory_used": float(self.memory != 0)}

    def _helper(self):  # private: not a tool
        return None
# --8<-- [end:calculator]


class Counter:
    """TRL's one-reward form: get_reward() is a column named after the class; an async tool, a
    class method tool; static methods and properties are not tools."""

    def reset(self, **row):
        self.count = 0

    async def bump(self) -> int:
        """Adds one to the count."""
        await asyncio.sleep(0)
        self.count += 1
        return self.count

    @classmethod
    def unit(cls) -> str:
        """The counting unit."""
        return "items"

    @staticmethod
    def helper() -> str:
        return "not a tool"

    @property
    def doubled(self) -> int:
        return 2 * self.count

    def get_reward(self):
        return float(self.count)


class Sleepy:
    RELEASE = threading.Event()

    def reset(self, **row):
        return None

    def nap(self, seconds: float) -> str:
        """Waits.

        Args:
            seconds: How long.
        """
        Sleepy.RELEASE.wait(seconds)
        return "awake"

    def get_rewards(self):
        raise RuntimeError("scoring backend down")


class NoTools:
    def reset(self, **row):
        return None


class NoReset:
    def act(self) -> str:
        """Acts."""
        return "ok"


class Undocumented:
    def reset(self, **row):
        return None

    def act(self, x):
        return x


class NeedsArguments:
    def __init__(self, url):
        self.url = url

    def reset(self, **row):
        return None

    def act(self) -> str:
        """Acts."""
        return "ok"


class Fragile(Calculator):
    """A Calculator whose reset fails for the rows that say so."""

    def reset(self, **row):
        if row.get("broken"):
            raise ConnectionError("backend unreachable")
        return super().reset(**row)


class Counted(Calculator):
    """A Calculator whose instances are counted by the processes that make them (one each)."""


class NoReward:
    """Tools and no reward: its rollouts are scored by reward functions only."""

    def reset(self, **row):
        pass

    def echo(self, text: str) -> str:
        """Echoes a text.

        Args:
            text: The text.
        """
        return text


class NeverText:
    def __str__(self):
        while True:
            pass


class Hostile:
    """Tools a policy's calls can turn against the run (each answered, none stops it)."""

    def reset(self, **row):
        self.calls = 0

    def leave(self, code: int) -> str:
        """Exits, as argparse does on a bad command line.

        Args:
            code: The exit code.
        """
        self.calls += 1
        raise SystemExit(code)

    def power(self, base: int, exponent: int) -> int:
        """A power.

        Args:
            base: The base.
            exponent: The exponent.
        """
        self.calls += 1
        return base ** exponent

    def spin(self, n: int) -> int:
        """Sums the integers below n in C, holding the GIL.

        Args:
            n: How many.
        """
        self.calls += 1
        return sum(range(n))

    def endless(self) -> str:
        """A result whose text never ends."""
        self.calls += 1
        return NeverText()

    def crash(self) -> str:
        """Ends its process."""
        _crash()

    def interrupt(self) -> str:
        """Raises KeyboardInterrupt."""
        raise KeyboardInterrupt

    def get_rewards(self):
        return {"calls": float(self.calls)}


class SlowStart:
    """An __init__ that waits on a server that never answers (in an environment process: the
    check's instance, in the process that checks the class, is made)."""

    def __init__(self):
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            threading.Event().wait()

    def reset(self, **row):
        return None

    def act(self) -> str:
        """Acts."""
        return "ok"


class SlowReset:
    def reset(self, **row):
        if row.get("stall"):
            threading.Event().wait()

    def act(self) -> str:
        """Acts."""
        return "ok"


def _crash():
    import os

    os._exit(3)


#: what ``ByRow.act`` does, by the row's ``mode``: each a way a call can turn against the run
HOSTILE = {
    "fine": lambda: "ok",
    "exit": lambda: sys.exit(2),
    "huge": lambda: 10 ** 5000,
    "spin": lambda: sum(range(10 ** 13)),
    "hang": lambda: threading.Event().wait(),
    "crash": _crash,
    "endless": NeverText,
}


class ByRow:
    """One tool whose behaviour the row chooses (``HOSTILE``); counts its calls."""

    def reset(self, **row):
        self.mode, self.calls = row.get("mode", "fine"), 0

    def act(self) -> str:
        """Acts."""
        self.calls += 1
        return HOSTILE[self.mode]()

    def get_rewards(self):
        return {"acted": float(self.calls)}


class HangsOnInit:
    """An __init__ that never returns, wherever it is made."""

    def __init__(self):
        threading.Event().wait()

    def reset(self, **row):
        return None

    def act(self) -> str:
        """Acts."""
        return "ok"


class LeavesWork:
    """A tool that answers at once and leaves work running in its process, by the row's ``mode``:
    a thread that ends the process, or holds the GIL, once the rewards are being read; a child
    process; a detached grandchild."""

    def reset(self, **row):
        self.mode, self.reading = row.get("mode", "none"), threading.Event()

    def act(self) -> str:
        """Acts."""
        import subprocess

        if self.mode == "thread_exit":
            threading.Thread(target=lambda: (self.reading.wait(), _crash()), daemon=True).start()
        elif self.mode == "thread_spin":
            threading.Thread(target=lambda: (self.reading.wait(), sum(range(10 ** 13))), daemon=True).start()
        elif self.mode == "child":
            subprocess.Popen(["sleep", "6001"])
        elif self.mode == "detached":  # a double fork into a session of its own
            subprocess.Popen(["setsid", "-f", "sleep", "6002"])
        return "ok"

    def get_rewards(self):
        import time

        self.reading.set()
        time.sleep(0.5)
        return {"done": 1.0}


def hangs(environments, **kwargs):
    threading.Event().wait()


def reads(environments, **kwargs):
    return [1.0 for _ in environments]
