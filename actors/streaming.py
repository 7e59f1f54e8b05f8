"""The streaming rollout actor (``generation.mode: streaming``, the default on vllm).

A Ray async actor over an ``actors.engines.StreamingEngine`` (vllm's: ``actors.vllm_stream_engine.
AsyncVLLMEngine``): every ``stream(prompts)`` call the driver makes runs concurrently with the
others on the actor's event loop, each of its prompts as G engine requests, so the engine batches
everything in flight continuously and a prompt the driver admits joins at once. A group is
scored (in the reward worker processes, off the event loop) the moment its G samples end and
emitted at once as one Arrow record batch: a group that finishes early never waits for a slower
one started before it.

``set_weights`` (object store) and ``receive_weights`` (a broadcast: gloo, or vLLM's NCCL
weight transfer on CUDA) run in flight: the weights are fetched and written while the engine
keeps generating (NCCL: received into the paused engine), then the engine pauses (requests
kept), loads them, labels the new version and resumes; each token records the version that
sampled it (``response_versions``). A group whose oldest token is older than ``max_staleness``
behind the new version can never be trained: it is aborted and reported (``CallMeta.aborted``)
for the driver to re-issue (``rollout/aborted``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import itertools
import time
from typing import Any, AsyncIterator, Mapping, Sequence

from actors.prompts import Prompt
from actors.rollout import RolloutActor
from actors.tool_loop import with_observation
from gdpo_ray.batch import CallMeta


class StreamingRolloutActor(RolloutActor):
    """``RolloutActor``'s arguments (``engine``: the streaming class of a name of
    ``actors.engines.ENGINES``, or a "package.module:Class" of ``actors.engines.
    StreamingEngine``), plus ``max_staleness`` (the buffer's): groups that fall further behind a
    push are aborted in flight."""

    mode = "streaming"

    def __init__(self, *args: Any, engine: str = "vllm", max_staleness: int = 0, **kwargs: Any) -> None:
        if kwargs.get("lora") and engine == "vllm":  # every live adapter version runs in a step
            kwargs["engine_kwargs"] = {"max_loras": max_staleness + 1, **(kwargs.get("engine_kwargs") or {})}
        super().__init__(*args, engine=engine, **kwargs)
        self.max_staleness = max_staleness
        # group_id -> [version when its first request entered the engine (None: not yet), task]
        self._open: dict[str, list] = {}
        # requests in the engine: its sequence slots and one group more, so that a slot that frees
        # is refilled at once while a group's version is still taken when it starts decoding
        self._slots = asyncio.Semaphore(self.engine.max_num_seqs + self.group_size)
        self._push = asyncio.Lock()
        self._pending: set[int] = set()  # versions whose push has arrived and not finished
        self._versions = asyncio.Condition()  # notified at the end of every push
        self._scorer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="score")
        self._closed = False

    async def stream(self, prompts: Sequence[Prompt]) -> AsyncIterator[Any]:
        """Pairs (record batch or None, metadata), one per group as it is scored, one for the
        prompts filtered before generation, one per group aborted in flight."""
        kept, ids, filtered = self.split(prompts)
        await self._admit()
        if filtered:
            yield None
            yield CallMeta(groups=[], filtered=filtered)
        tasks = {}
        for p, tokens in zip(kept, ids):
            task = asyncio.ensure_future(self._group(p, tokens))
            tasks[task] = p.group_id
            self._open[p.group_id] = [None, task]
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    self._open.pop(tasks[task], None)
                    if task.cancelled():
                        yield None
                        yield CallMeta(groups=[], filtered=[], aborted=(tasks[task],))
                    else:
                        meta, batch = task.result()
                        yield batch
                        yield meta
        finally:  # the call itself was cancelled (or the actor is going away)
            for task in pending:
                task.cancel()
                self._open.pop(tasks[task], None)

    async def _admit(self) -> None:
        """A group starts decoding only at a version the pushes on their way leave it time to be
        trained at: the driver pushed version P after its step P, so the group is trained at
        step P + 1 or later, where it may be at most max_staleness behind P; started at
        P - max_staleness it would have to make exactly that step, so it waits until the actor
        is within max(max_staleness - 1, 0) of P (a push lands in a fraction of a step; a fresh
        actor waits for its first push, from version 0 to the run's)."""
        slack = max(self.max_staleness - 1, 0)
        async with self._versions:
            await self._versions.wait_for(
                lambda: max(self._pending, default=self.version) - self.version <= slack)

    async def _sample(self, group_id: str | None, tokens: list[int], sampling: Any = None,
                      logprobs: bool = True) -> Any:
        entry = self._open.get(group_id)
        if entry is not None and entry[0] is None:
            await self._admit()  # it may have waited for a slot while pushes arrived
        async with self._slots:
            entry = self._open.get(group_id)
            if entry is not None and entry[0] is None:
                entry[0] = self.version
            return await self.engine.sample(tokens, sampling or self.sampling, logprobs)

    async def _group(self, p: Prompt, tokens: list[int]) -> tuple[CallMeta, Any]:
        if self.tools is not None:
            return await self._group_turns(p)
        start, version = time.perf_counter(), self.version
        samples = await asyncio.gather(*(self._sample(p.group_id, tokens) for _ in range(self.group_size)))
        generated = time.perf_counter()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._scorer, self.score, [p], [tokens], [samples],
                                          version, [], start, generated)

    async def _group_turns(self, p: Prompt) -> tuple[CallMeta, Any]:
        """A group of multi-turn rollouts (``actors.tool_loop``), each going on by itself: a
        rollout's tools run on the environments' threads while the engine decodes the others."""
        start, version, loop = time.perf_counter(), self.version, asyncio.get_running_loop()
        rows = [{"prompt": p.prompt, **p.columns} for _ in range(self.group_size)]
        prompts, ids, trajectories = await self._start_rollouts(rows)
        await asyncio.gather(*(self._turns(p.group_id, i, t, self.sampling) for i, t in zip(ids, trajectories)))
        generated = time.perf_counter()
        out = await loop.run_in_executor(self._scorer, self.score, [p], ids, [trajectories], version, [],
                                         start, generated, prompts)
        self.tools.release(trajectories)  # (not when aborted: a call may still run in an instance)
        return out

    async def _start_rollouts(self, rows: Sequence[Mapping[str, Any]]) -> tuple[list, list, list]:
        """(prompts with the reset texts, their token ids, trajectories) of fresh rollouts."""
        started = await asyncio.get_running_loop().run_in_executor(None, self.tools.start, rows)
        prompts = [with_observation(row["prompt"], observation) for row, (_, observation) in zip(rows, started)]
        trajectories = [t for t, _ in started]
        return prompts, [self.tokenize(q, self.tools.schemas_of(t)) for q, t in zip(prompts, trajectories)], trajectories

    async def _turns(self, group_id: str | None, prompt_ids: list[int], t: Any, sampling: Any,
                     logprobs: bool = True) -> None:
        """One multi-turn rollout to its end: a turn, its calls (or the environment's next
        message) on the environments' threads, the next turn; ``sampling.max_tokens`` bounds the
        whole trajectory."""
        from actors.tool_loop import answered, next_message, take_turn

        loop, budget = asyncio.get_running_loop(), sampling.max_tokens
        while not t.done:
            room = dataclasses.replace(sampling, max_tokens=budget - len(t.tokens))
            sample = await self._sample(group_id, prompt_ids + t.tokens, room, logprobs)
            if not logprobs:  # evaluation: no logprobs kept
                sample = dataclasses.replace(sample, logprobs=[0.0] * len(sample.token_ids))
            step = take_turn(t, sample, budget, self.tools.max_turns, self.tokenizer)
            if step is None:
                return
            if step[0] == "call":
                answers = await loop.run_in_executor(self.tools.pool, lambda: [t.session.call(c) for c in step[1]])
                answered(t, step[1], answers, self.tools.tool_turns, budget)
            else:
                text, failure = await loop.run_in_executor(self.tools.pool, t.session.next_message)
                next_message(t, text, failure, self.tools.tool_turns, budget)

    async def generate(self, prompts: Sequence[Prompt]) -> tuple[CallMeta, Any]:
        """All of ``prompts``' groups as one batch (the batch call, e.g. for a test)."""
        metas, batches = [], []
        async for item in self.stream(prompts):
            (batches if len(batches) == len(metas) else metas).append(item)
        import pyarrow as pa

        real = [b for b in batches if b is not None]
        if not real:
            return CallMeta(groups=[], filtered=[f for m in metas for f in m.filtered]), None
        batch = pa.Table.from_batches(real).combine_chunks().to_batches()[0]
        from gdpo_ray.groups import describe_groups

        return CallMeta(groups=describe_groups(batch), filtered=[f for m in metas for f in m.filtered],
                        tokens=sum(m.tokens for m in metas),
                        aborted=tuple(itertools.chain.from_iterable(m.aborted for m in metas))), batch

    async def set_weights(self, version: int, weights: Any) -> dict:
        """Loads ``version`` in flight (see the module docstring); the weights as a name ->
        tensor dict or a list of ObjectRefs of weight buckets. Returns the attestation
        (``_update``)."""
        from gdpo_ray.weights.buckets import unpack_bucket
        from gdpo_ray.weights.digest import recorded

        async def load() -> dict[str, str]:
            if isinstance(weights, Mapping):
                items = list(weights.items())
            else:
                buckets = await asyncio.gather(*weights)
                items = [t for b in buckets for t in unpack_bucket(b)]
            sent: dict[str, str] = {}
            path = await asyncio.get_running_loop().run_in_executor(
                None, self.engine.write_weights, list(recorded(items, sent)))
            await self.engine.push(path, version)
            return sent

        return await self._update(version, load, skip_older=True)

    async def join_broadcast(self, host: str, port: int, rank: int, world_size: int) -> str:
        """``RolloutActor.join_broadcast`` off the event loop: generation goes on while the
        group forms."""
        from gdpo_ray.weights.channels import open_channel, receiver_backend

        if self.channel is not None:
            self.channel.close()
        self.channel = await asyncio.get_running_loop().run_in_executor(
            None, open_channel, host, port, rank, world_size, receiver_backend(self.engine))
        joined = self.channel.attach(self.engine)
        if inspect.isawaitable(joined):  # vLLM's weight transfer: the engine joins the group
            await joined
        return self.channel.backend

    async def receive_weights(self, version: int) -> dict:
        """One broadcast version, in flight: through vLLM's NCCL weight transfer (the engine
        paused for the transfer), or as host buckets received and written while the engine
        generates (gloo, or NCCL into this GPU), then pushed. Returns the attestation."""
        from gdpo_ray.weights.digest import recorded

        channel = self.channel

        async def load() -> dict[str, str]:
            if channel.backend == "vllm":
                info = channel.update_info()
                await self.engine.receive_broadcast(info, version)
                return dict(zip(info["names"], info["dtype_names"]))
            sent: dict[str, str] = {}
            loop = asyncio.get_running_loop()
            path = await loop.run_in_executor(None, lambda: self.engine.write_weights(
                recorded(channel.receive(), sent)))
            await self.engine.push(path, version)
            return sent

        # a broadcast is a collective: every member takes part, whatever this actor's version
        return await self._update(version, load, skip_older=False)

    async def _update(self, version: int, load: Any, skip_older: bool) -> dict:
        """Runs ``load()`` (which pushes ``version`` into the engine and returns what it sent:
        name -> dtype) as the one push in progress, then aborts the groups it left too stale.
        Returns the attestation: ``{"version", "digests"}`` of what the engine holds after the
        push (``RolloutActor.attest``; ``digests`` None when a newer version was held already
        and this one was skipped)."""
        self._pending.add(version)  # before any await: a stream call after this one sees it
        try:
            async with self._push:
                if self._closed or (skip_older and version <= self.version):
                    return {"version": self.version, "digests": None}
                sent = await load()
                self.version = int(version)
                oldest = self.version - self.max_staleness
                for group_id, (started, task) in list(self._open.items()):
                    if started is not None and started < oldest:
                        task.cancel()
                try:
                    return {"version": self.version, "digests": await self.engine.weight_digests(sent)}
                except NotImplementedError as err:  # as RolloutActor.attest
                    return {"version": self.version, "digests": None, "unverified": str(err)}
        finally:
            self._pending.discard(version)
            async with self._versions:
                self._versions.notify_all()

    async def complete(self, prompts: Sequence[str | list], n: int, sampling: Mapping[str, Any],
                       rows: Sequence[Mapping[str, Any]] | None = None, score: bool = False) -> list:
        """``RolloutActor.complete`` (evaluation), its requests beside the groups in flight,
        once the pushes that have arrived are loaded; each multi-turn rollout goes on by itself,
        and the scoring runs on the actor's scoring thread, as its groups' does."""
        from actors.engines import SamplingParams

        async with self._versions:
            await self._versions.wait_for(lambda: not self._pending)
        sampling = SamplingParams(**dict(sampling))
        rows = [dict(r) for r in rows] if rows is not None else [{} for _ in prompts]
        ids, fits = self._eval_prompts(prompts)
        chosen = [i for i in fits for _ in range(n)]
        loop = asyncio.get_running_loop()
        if self.tools is not None:
            rollout_prompts, prompt_ids, flat = await self._start_rollouts(
                [{**rows[i], "prompt": prompts[i]} for i in chosen])
            await asyncio.gather(*(self._turns(None, q, t, sampling, logprobs=False)
                                   for q, t in zip(prompt_ids, flat)))
        else:
            groups = await self.engine.generate([ids[i] for i in fits], n, sampling, logprobs=False)
            rollout_prompts, flat = [prompts[i] for i in chosen], [s for group in groups for s in group]
        try:
            return await loop.run_in_executor(self._scorer, self._completions, n, len(prompts), fits, flat,
                                              rollout_prompts, [rows[i] for i in chosen] if score else None)
        finally:
            if self.tools is not None:
                self.tools.release(flat)

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    def engine_stats(self) -> dict:
        """Requests in the engine now, its sequence slots, and the pause of every push (s)."""
        return {"active": self.engine.active, "slots": self.engine.max_num_seqs,
                "push_pause_s": list(self.engine.pause_s)}

    async def shutdown(self) -> None:
        """Cancels the groups in flight, lets a push in progress finish (no later one starts),
        then stops the reward workers and the engine."""
        self._closed = True
        for _, task in list(self._open.values()):
            task.cancel()
        async with self._push:
            self._scorer.shutdown(wait=False, cancel_futures=True)
            super().shutdown()
