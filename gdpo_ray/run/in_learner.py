"""The rollout engine inside the learner's process (``generation.engine_in_learner``).

On one machine without an accelerator, a separate rollout actor costs a process (a second copy
of torch, the model and the tokenizer) and a weight push per step, though the synchronous mode
never generates and learns at once. Here learner rank 0 hosts the run's one rollout actor: a
``actors.rollout.RolloutActor`` built in its process on an engine that shares the learner's
module (``EngineTraits.shares_module``: the hf engine, ``HFEngine(model=...)``): the weights the
update just wrote are the weights the next call samples from; nothing is pushed, nothing
copied. The rollout group sees an actor like any other (``ready``, ``set_weights``,
``stream``, ``complete``, ``shutdown``: those a rollout group calls, by the same names; not
``sleep``, which only the colocated layout calls): the learner's handle, with these methods mixed
into its class (``RolloutHost``); a push is an empty load that gives the engine its version
(``gdpo_ray.run.transports.SharedTransport``).

The learner's actor runs one call at a time, in the order they were sent: an update, the push
after it and the next generation follow one another, as the synchronous mode wants them. The
rollout actor's coroutines run on an event loop of their own, driven by the call's thread (the
one the updates run on) until the call's coroutine is done: with the loop on a thread of its own
the demo's step took 0.32 s where it takes 0.26 (generation 0.106 s against 0.082, the update
0.165 against 0.138: two threads' torch work in one process, each on its own memory).
The rollout group never kills this actor: it is the learners' (a learner recovery hosts the
rollouts again on the new learner, ``GDPO._recover``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator, Mapping, Sequence


class RolloutHost:
    """Mixed into the learner's class (``LearnerGroup(host=RolloutHost)``): the rollout actor's
    methods, served by the ``RolloutActor`` that ``host_rollouts`` builds in this process."""

    _rollouts: Any = None
    _hosting_error: str | None = None

    def host_rollouts(self, actor_kwargs: Mapping[str, Any]) -> None:
        """Builds the hosted rollout actor (``RolloutActor``'s arguments) on an engine that
        shares this learner's module; an error is kept for ``ready`` to raise."""
        from actors.rollout import RolloutActor

        kwargs = dict(actor_kwargs)
        # the module carries the learner's LoRA layers (if any): the engine generates through them
        kwargs.update(lora=None, engine_kwargs={**kwargs.get("engine_kwargs", {}), "model": self.module})
        # generation and the update take turns in one process: each takes the threads an update
        # takes alone (training.threads_alone), from its start (the dial's hooks are not needed)
        self._threads = self.config.threads_alone or self.config.num_threads
        self.dial.detach()
        self.shutdown()  # one hosted at a time
        try:
            self._rollouts = RolloutActor(**kwargs)
        except Exception as err:  # noqa: BLE001 - told by ready(), with what failed
            self._hosting_error = f"{type(err).__name__}: {err}"
            return
        self._loop = asyncio.new_event_loop()

    def _run(self, coroutine: Any) -> Any:
        """``coroutine`` run to its end on this thread, at the generation's torch threads."""
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(self._threads)
        try:
            return self._loop.run_until_complete(coroutine)
        finally:
            torch.set_num_threads(threads)

    def _hosted(self) -> Any:
        if self._rollouts is None:
            raise RuntimeError("the learner could not host the rollout engine "
                               f"(generation.engine_in_learner): {self._hosting_error or 'not asked to'}")
        return self._rollouts

    def ready(self) -> str:
        return self._hosted().ready()

    def policy_version(self) -> int:
        return self._hosted().version

    def set_weights(self, version: int, weights: Any, order: int | None = None) -> dict:
        """Becomes ``version``: ``weights`` is empty (``SharedTransport``), the engine holds the
        learner's weights already (checked: its module is this learner's)."""
        rollouts = self._hosted()
        if rollouts.engine.model is not self.module:
            raise RuntimeError("the hosted engine no longer generates from the learner's module")
        return self._run(rollouts.set_weights(version, weights, order))

    def stream(self, prompts: Sequence[Any]) -> Iterator[Any]:
        """``RolloutActor.stream``'s items, as a generator of this thread; one that is closed
        early (the call cancelled) closes the actor's, which cancels its groups."""
        items = self._hosted().stream(prompts)

        async def following() -> tuple[bool, Any]:
            try:
                return True, await items.__anext__()
            except StopAsyncIteration:
                return False, None

        try:
            while True:
                more, item = self._run(following())
                if not more:
                    return
                yield item
        finally:
            self._run(items.aclose())

    def complete(self, prompts: Sequence[Any], n: int, sampling: Mapping[str, Any],
                 rows: Sequence[Mapping[str, Any]] | None = None, score: bool = False) -> list:
        return self._run(self._hosted().complete(prompts, n, sampling, rows, score))

    def shutdown(self) -> None:
        """Stops the hosted rollout actor (its reward workers, environments); the learner goes on."""
        rollouts, self._rollouts = self._rollouts, None
        if rollouts is not None:
            self._run(rollouts.shutdown())
            self._loop.close()
