"""``Arithmetic``: the ``agent`` preset's environment, a calculator the model must call.

The task (``task:tool_arithmetic``) asks for a product or a sum of two-digit numbers, sometimes
followed by a second operation on the result ("What is 37 times 12 plus 5?"). A tiny model
cannot compute 444 itself; it can call ``multiply`` and copy the answer. Written as a TRL
environment (public methods are the tools, ``reset(**row)`` starts a rollout), so the preset
shows exactly what a user's own environment looks like.

Its reward column ``tool_success`` (``get_rewards``) is the environment's end state: 1 when a
call of this rollout returned the row's answer (the model computed what was asked, whatever it
then wrote), else 0.
"""

from __future__ import annotations


class Arithmetic:
    """Two integer operations; remembers what they returned."""

    def reset(self, **row) -> None:
        self.target, self.results = str(row.get("ground_truth", "")), []

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return self._record(_integer(a) + _integer(b))

    def multiply(self, a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return self._record(_integer(a) * _integer(b))

    def get_rewards(self) -> dict[str, float]:
        return {"tool_success": float(self.target in self.results)}

    def _record(self, value: int) -> int:
        self.results.append(str(value))
        return value


def _integer(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r}")
    return value
