"""A learner's torch threads, turned while an update runs.

On one CPU machine the rollout actors and the learners share the cores. While a rollout actor
generates beside an update, each side keeps ``training.num_threads``; once no rollout is in
flight (the staleness bound is reached, or the synchronous mode) their cores are idle, and the
driver lends them to the learners (``training.threads_alone``). torch's thread count belongs to
the thread that runs the ops, and an update can be one long forward and backward, so the wish,
set from any thread, is applied from inside the model: before each linear layer's forward and
before the backward reaches it.
"""

from __future__ import annotations

from typing import Any


class ThreadDial:
    """The torch threads wanted for the running update (``set`` from any thread) and the
    count applied in the thread that runs it (``apply``, called by the model's hooks)."""

    def __init__(self, threads: int) -> None:
        import torch

        self._torch = torch
        self.wanted = self.applied = threads
        self.turns = 0  # how many times the count changed (a metric of the update)
        self._hooks: list[Any] = []

    def set(self, threads: int) -> None:
        self.wanted = threads

    def apply(self) -> None:
        if self.wanted != self.applied:
            self._torch.set_num_threads(self.wanted)
            self.applied = self.wanted
            self.turns += 1

    def attach(self, model: Any) -> None:
        """Hooks on every linear layer of ``model``: ``apply`` before its forward and before
        its backward (a hook on its output's gradient; the gradient passes unchanged)."""
        for module in model.modules():
            if isinstance(module, self._torch.nn.Linear):
                self._hooks += [module.register_forward_pre_hook(self._before_forward),
                                module.register_forward_hook(self._after_forward)]

    def detach(self) -> None:
        """The hooks off (an update that keeps its threads throughout needs none; and a module
        that also generates would run them at every token)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _before_forward(self, module: Any, args: Any) -> None:
        self.apply()

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if isinstance(output, self._torch.Tensor) and output.requires_grad:
            output.register_hook(self._before_backward)

    def _before_backward(self, grad: Any) -> None:
        self.apply()
