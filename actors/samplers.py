"""The sampler seam: how a rollout actor's turns and weights reach its engine, the one place
where the engine's mode (``generation.mode``) matters.

- ``BatchedSampler`` over a ``BatchEngine`` (``batched``): one call of the actor generates at a
  time, and a push waits for it (``exclusive``); within a call the next turn of every rollout
  still going reaches the engine as ONE engine call, once each of them asks for it (a ``Round``:
  the batch engine is idle while tools run, as it would be anyway), rollouts of one context
  sharing their prompt's prefill (``n`` samples of it).
- ``StreamingSampler`` over a ``StreamingEngine`` (``streaming``): every turn is a request of
  its own, batched continuously by the engine beside every other call's; pushes land in flight.

Both are built as ``Sampler(engine, group_size, admit)`` (``admit``: the actor's wait for the
pushes on their way) and offer the same coroutines to ``actors.rollout.RolloutActor``: ``exclusive()`` (held by a
call while it generates, and by a push while it loads), ``round(live)`` (what a call's turn loop
samples through), ``load`` / ``receive`` (new weights into the engine), ``digests``, ``sleep``
and ``wake_up``. ``one_batch`` says how a call's groups leave the actor: all in one record batch
(batched), or each as soon as it is scored (streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence

from actors.engines import Sample, SamplingParams, traits_of

THREADED_DIGEST_BYTES = 1 << 20  # a pushed tensor this large is digested on a thread (BatchedSampler.digests)

_ROUNDS = itertools.count()  # rounds' scopes: the keys of their rollouts' kept KV


class Round:
    """The turns a batched call's rollouts ask for, sent to the engine together: once as many
    requests wait as rollouts are still going (``live``; a rollout that ends ``leave``s), one
    ``generate`` call serves them all, in the order of their ``index``."""

    def __init__(self, engine: Any, live: int) -> None:
        self.engine, self.live = engine, live
        self.waiting: list[tuple[int, list[int], SamplingParams, bool, asyncio.Future, bool]] = []
        self.reuse = traits_of(engine).kv_reuse  # (an instance's, a wrapper's forwarded)
        self.scope = next(_ROUNDS)  # keys of this round's rollouts are (scope, index)
        self.kept: set[int] = set()

    async def sample(self, index: int, tokens: list[int], sampling: SamplingParams, logprobs: bool = True,
                     first: bool = False, entered: Callable[[], None] = lambda: None, keep: bool = False) -> Sample:
        """The turn of rollout ``index`` (``first``: its group's first request, which a batched
        call need not admit: no push loads while it generates); ``entered()`` is called as the
        request joins the round; ``keep``: the rollout will ask again (multi-turn), so an engine
        that can keeps its KV for that turn (``EngineTraits.kv_reuse``)."""
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((index, tokens, sampling, logprobs, future, keep))
        entered()
        self._dispatch()
        return await future

    def leave(self, index: int | None = None) -> None:
        """Rollout ``index`` asks no more (the engine forgets its KV)."""
        self.live -= 1
        if index in self.kept:
            self.kept.discard(index)
            self.engine.release([(self.scope, index)])
        self._dispatch()

    def _dispatch(self) -> None:
        self.waiting = [w for w in self.waiting if not w[4].done()]  # (a rollout cancelled meanwhile)
        if not self.waiting or len(self.waiting) < self.live:
            return
        waiting, self.waiting = sorted(self.waiting, key=lambda w: w[0]), []
        keys = None
        if self.reuse and any(w[5] for w in waiting):
            keys = [(self.scope, w[0]) if w[5] else None for w in waiting]
            self.kept.update(w[0] for w in waiting if w[5])
        try:
            samples = self._generate([w[1] for w in waiting], waiting[0][2], any(w[3] for w in waiting),
                                     max(w[2].max_tokens for w in waiting), keys)
        except BaseException as err:  # noqa: BLE001 - every rollout of the round hears of it
            for w in waiting:
                w[4].set_exception(err)
            return
        for w, sample in zip(waiting, samples):
            w[4].set_result(sample)

    def _generate(self, contexts: Sequence[list[int]], sampling: SamplingParams, logprobs: bool,
                  room: int, keys: list | None = None) -> list[Sample]:
        """One engine call for ``contexts`` (in order): runs of one context all of one length are
        asked as ``n`` samples of it (their prompt prefilled once), anything else one each;
        ``keys`` (per context, an engine with ``kv_reuse``) go along."""
        import dataclasses

        runs: list[list[int]] = []
        for context in contexts:
            if runs and runs[-1][0] == context:
                runs[-1][1] += 1
            else:
                runs.append([context, 1])
        n = runs[0][1] if len({count for _, count in runs}) == 1 else 1
        unique = [context for context, _ in runs] if n > 1 else list(contexts)
        sampling = dataclasses.replace(sampling, max_tokens=room)
        extra = {} if keys is None else {"keys": keys}
        out = self.engine.generate(unique, n, sampling, logprobs=logprobs, **extra)
        return [sample for group in out for sample in group]


class BatchedSampler:
    """A ``BatchEngine``'s side of the seam (see the module docstring)."""

    one_batch = True  # a call's groups leave the actor together, in one record batch

    def __init__(self, engine: Any, group_size: int, admit: Callable[[], Awaitable[None]]) -> None:
        self.engine = engine
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """One call generates (or one push loads) at a time: the engine is a plain object (whose
        ``weight_digests`` alone may run beside, where its traits say ``digests_by_name``)."""
        async with self._lock:
            yield

    def round(self, live: int) -> Round:
        return Round(self.engine, live)

    async def load(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        self.engine.load_weights(named_tensors)

    async def receive(self, channel: Any, version: int) -> dict[str, str]:
        return channel.receive_into(self.engine, version)

    async def digests(self, sent: Mapping[str, str], sizes: Mapping[str, int] | None = None) -> dict[str, int]:
        """The engine's digests of ``sent``; of an engine that digests by name, those of tensors
        of THREADED_DIGEST_BYTES or more (``sizes``: name -> bytes) on a thread, so the actor
        generates meanwhile: their host digest runs without the GIL, where a thread with many
        small tensors would wait for it behind generation's Python."""
        if not sizes or not traits_of(type(self.engine)).digests_by_name:
            return self.engine.weight_digests(sent)
        large = {n: d for n, d in sent.items() if sizes.get(n, 0) >= THREADED_DIGEST_BYTES}
        held = self.engine.weight_digests({n: d for n, d in sent.items() if n not in large})
        if large:
            held |= await asyncio.to_thread(self.engine.weight_digests, large)
        return held

    async def sleep(self) -> None:
        async with self._lock:
            self.engine.sleep()

    async def wake_up(self) -> None:
        async with self._lock:
            self.engine.wake_up()


class StreamingSampler:
    """A ``StreamingEngine``'s side of the seam (see the module docstring). Requests in the
    engine at once: its sequence slots and one group more, so that a slot that frees is
    refilled at once while a group's version is still taken when it starts decoding."""

    one_batch = False  # each group leaves the actor as soon as it is scored

    def __init__(self, engine: Any, group_size: int, admit: Callable[[], Awaitable[None]]) -> None:
        self.engine, self.admit = engine, admit
        self._slots = asyncio.Semaphore(engine.max_num_seqs + group_size)

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Nothing to wait for: calls and pushes share the engine while it runs."""
        yield

    def round(self, live: int) -> StreamingSampler:
        return self

    async def sample(self, index: int, tokens: list[int], sampling: SamplingParams, logprobs: bool = True,
                     first: bool = False, entered: Callable[[], None] = lambda: None, keep: bool = False) -> Sample:
        """One request (vLLM's prefix cache finds a multi-turn rollout's earlier turns: ``keep``
        asks nothing more). A group's first is admitted again (``admit``: it may have waited while
        pushes arrived) and takes its version as it enters the engine (``entered()``)."""
        if first:
            await self.admit()
        async with self._slots:
            entered()
            return await self.engine.sample(tokens, sampling, logprobs)

    def leave(self, index: int | None = None) -> None:
        """(Nothing waits for a rollout that ends.)"""

    async def load(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Written off the event loop while the engine generates, then pushed (paused, loaded,
        labelled, resumed)."""
        path = await asyncio.get_running_loop().run_in_executor(None, self.engine.write_weights,
                                                                list(named_tensors))
        await self.engine.push(path, version)

    async def receive(self, channel: Any, version: int) -> dict[str, str]:
        """One broadcast version: through vLLM's NCCL weight transfer (the engine paused for the
        transfer), or as host buckets received and written while the engine generates, then
        pushed."""
        from gdpo_ray.weights.digest import recorded

        if channel.backend == "vllm":
            info = channel.update_info()
            await self.engine.receive_broadcast(info, version)
            return dict(zip(info["names"], info["dtype_names"]))
        sent: dict[str, str] = {}
        path = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.engine.write_weights(recorded(channel.receive(), sent)))
        await self.engine.push(path, version)
        return sent

    async def digests(self, sent: Mapping[str, str], sizes: Mapping[str, int] | None = None) -> dict[str, int]:
        return await self.engine.weight_digests(sent)

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()


SAMPLERS = {"batched": BatchedSampler, "streaming": StreamingSampler}
