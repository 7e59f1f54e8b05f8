"""The turn loop: every rollout of a rollout actor, training's and evaluation's, single-turn or
with tools, on any engine, as one state machine.

A rollout (``Rollout``) moves through these states, each a handler of ``TurnLoop``:

    pending ──> generating ──> calling ──> generating ...
                    │    └───> asking ───> generating ...
                    └──> done

- ``pending``: its environment instance is made and reset with its row (tools only), its prompt
  (``reset``'s text appended) tokenized with its tools;
- ``generating``: its next turn sampled through the sampler seam (``actors.samplers``: a batch
  engine serves a round of every rollout's turn in one call, a streaming engine each as a
  request of its own), appended (``actors.tool_loop.take_turn``);
- ``calling``: the turn's tool calls run on its environment, their answers appended as the
  template's tool turn; ``asking``: the environment's next user message appended;
- ``done``: the model answered without a call, ``max_turns`` turns, the token budget
  (``sampling.max_tokens`` bounds the whole trajectory, tool turns included), or an engine that
  stopped it. A single-turn sample is a one-turn trajectory: generating, then done.

Where the next changes plug in: ``_environment`` is the one place environment code is called
(each call a request to the rollout's environment process, ``actors.tool_loop.ToolEnvironment``,
waited for on a thread of its pool, so the engine decodes the other rollouts meanwhile);
``Rollout.key`` names a rollout across its turns (what
a cache kept across turns is looked up by); a rollout's scoring happens once it is done, in
``actors.rollout.RolloutActor.score``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Sequence

from actors.engines import SamplingParams
from actors.tool_loop import ToolEnvironment, Trajectory, answered, next_message, take_turn, with_observation

PENDING, GENERATING, CALLING, ASKING, DONE = "pending", "generating", "calling", "asking", "done"


@dataclasses.dataclass
class Rollout:
    """One trajectory on its way through the loop."""

    key: int  # its place in the actor's call (a batch engine's round serves turns in this order)
    row: dict  # its prompt and dataset columns (the environment's ``reset`` takes them)
    prompt: str | list  # as the model sees it (``reset``'s text appended once reset)
    prompt_ids: list[int] | None = None  # the prompt's tokens (chat template and tools applied)
    group: list | None = None  # the actor's entry of its group: [version it started at or None, task]
    trajectory: Trajectory = dataclasses.field(default_factory=lambda: Trajectory(None))
    state: str = PENDING
    calls: list = dataclasses.field(default_factory=list)  # its last turn's tool calls


class TurnLoop:
    """Runs rollouts to their end (``run``).

    Args:
        sampler: a call's ``Round`` (``actors.samplers``): ``sample`` and ``leave``.
        tokenizer: the engine's (a turn is decoded once, for its message and its calls).
        tokenize: (prompt, tools) -> token ids (``RolloutActor.tokenize``).
        tools: the actor's ``ToolEnvironment``, or None: single-turn rollouts.
        sampling: the call's sampling settings (``max_tokens``: each trajectory's budget).
        logprobs: keep the sampled tokens' logprobs (training), or not (evaluation: zeros).
        entered: called with a rollout when its request enters the engine (the actor takes the
            version its group starts at).
    """

    def __init__(self, sampler: Any, tokenizer: Any, tokenize: Callable[[Any, list | None], list[int]],
                 tools: ToolEnvironment | None, sampling: SamplingParams, logprobs: bool = True,
                 entered: Callable[[Rollout], None] = lambda rollout: None) -> None:
        self.sampler, self.tokenizer, self.tokenize, self.tools = sampler, tokenizer, tokenize, tools
        self.sampling, self.logprobs, self.entered = sampling, logprobs, entered
        self.handlers = {PENDING: self.pending, GENERATING: self.generating, CALLING: self.calling,
                         ASKING: self.asking}

    async def run(self, rollouts: Sequence[Rollout]) -> None:
        await asyncio.gather(*(self._run(r) for r in rollouts))

    async def _run(self, r: Rollout) -> None:
        try:
            while r.state != DONE:
                r.state = await self.handlers[r.state](r)
        finally:
            self.sampler.leave(r.key)  # a round no longer waits for its turns (nor keeps its KV)

    async def pending(self, r: Rollout) -> str:
        if self.tools is not None:
            r.trajectory, observation = await self._environment(self.tools.start_one, r.row)
            r.prompt = with_observation(r.row["prompt"], observation)
            r.prompt_ids = self.tokenize(r.prompt, self.tools.schemas_of(r.trajectory))
        elif r.prompt_ids is None:
            r.prompt_ids = self.tokenize(r.prompt, None)
        return GENERATING

    async def generating(self, r: Rollout) -> str:
        t, budget = r.trajectory, self.sampling.max_tokens
        room = dataclasses.replace(self.sampling, max_tokens=budget - len(t.tokens))
        sample = await self.sampler.sample(r.key, r.prompt_ids + t.tokens, room, self.logprobs,
                                           first=r.group is not None and r.group[0] is None,
                                           entered=lambda: self.entered(r), keep=self.tools is not None)
        if not self.logprobs:
            sample = dataclasses.replace(sample, logprobs=[0.0] * len(sample.token_ids))
        step = take_turn(t, sample, budget, self.tools.max_turns if self.tools else 1, self.tokenizer)
        if step is None:
            return DONE
        r.calls = step[1]
        return CALLING if step[0] == "call" else ASKING

    async def calling(self, r: Rollout) -> str:
        t = r.trajectory
        answers = await self._environment(lambda: [t.session.call(c) for c in r.calls])
        answered(t, r.calls, answers, self.tools.tool_turns, self.sampling.max_tokens)
        return DONE if t.done else GENERATING

    async def asking(self, r: Rollout) -> str:
        t = r.trajectory
        text, failure = await self._environment(t.session.next_message)
        next_message(t, text, failure, self.tools.tool_turns, self.sampling.max_tokens)
        return DONE if t.done else GENERATING

    async def _environment(self, fn: Callable, *args: Any) -> Any:
        """Environment code (reset, tool calls, next messages), in the rollout's environment
        process, waited for off the event loop: the engine decodes the other rollouts meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.tools.pool, fn, *args)


def run_batched(engine: Any, tools: ToolEnvironment, prompt_ids: Sequence[list[int]],
                trajectories: Sequence[Trajectory], sampling: SamplingParams) -> None:
    """Runs trajectories already started (``ToolEnvironment.start``; ``prompt_ids`` their prompts)
    to their end on a batch engine, in place, as a batched call's turn loop does, without an
    actor (benchmarks, tests)."""
    from actors.samplers import Round

    rollouts = [Rollout(k, {}, "", list(ids), trajectory=t, state=GENERATING)
                for k, (ids, t) in enumerate(zip(prompt_ids, trajectories))]
    asyncio.run(TurnLoop(Round(engine, len(rollouts)), engine.tokenizer, None, tools, sampling).run(rollouts))
