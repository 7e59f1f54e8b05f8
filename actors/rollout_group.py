"""The driver's side of the rollout actors.

``RolloutGroup`` owns the actors (``actors.rollout.RolloutActor``, batched or streaming as
``generation.mode`` says): their number and resources (CPUs, GPUs, a custom Ray resource that pins them to rollout nodes) are set apart
from the learners. It keeps every actor busy with queued calls within the buffer's admission
bound, moves finished groups into the ``ArrowBuffer``, restarts a dead actor (with the current
weights) and re-issues its prompts, and ``resize(n)`` adds or removes actors while a run goes on.
Every actor's report of the weights it loaded goes to the group's ``PushLedger``
(``actors.attestation``), checked as the reports arrive.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

from ray import ObjectRef
from ray.actor import ActorHandle

from actors.attestation import PushLedger
from actors.buffer import ArrowBuffer
from actors.judging import JudgeStats
from actors.prompts import Prompt, PromptSource
from actors.rollout import PromptsExhausted, RolloutActor
from gdpo_ray.batch import CallMeta

logger = logging.getLogger(__name__)

#: an actor that dies this many times in a row before it has started stops the group (its model
#: or engine cannot load): replacing it again would wait forever
MAX_FAILED_STARTS = 3


@dataclasses.dataclass
class _Call:
    """One ``stream`` call in flight: its items come in pairs (batch ref, metadata ref)."""

    gen: Any  # ray.ObjectRefGenerator of the actor's stream(prompts)
    prompts: list[Prompt]
    batch: Any = None  # the ref of the batch whose metadata comes next
    has_batch: bool = False
    reported: set = dataclasses.field(default_factory=set)  # group ids emitted, filtered or aborted

    def unreported(self) -> list[Prompt]:
        return [p for p in self.prompts if p.group_id not in self.reported]


@dataclasses.dataclass
class _Slot:
    handle: Any
    starting: Any  # ObjectRef of handle.ready() until the actor has started, then None
    calls: list[_Call] = dataclasses.field(default_factory=list)
    restarts: int = 0
    failed_starts: int = 0  # deaths while starting, in a row
    node_id: str | None = None  # where the actor runs, once started


class RolloutGroup:
    """The rollout actors of a run, fed from a PromptSource into an ArrowBuffer; ``complete``
    spreads evaluation prompts over the same actors the same way.

    Args:
        actor_kwargs: ``RolloutActor`` arguments, ``mode`` among them: "batched" (one batch per
            call) or "streaming" (groups stream out of every call as they finish, weights change
            in flight; ``max_staleness`` is the buffer's).
        num_actors: how many actors to start.
        prompts, buffer: the run's prompt source and buffer (driver objects); None for a group
            that only evaluates (``complete``).
        prompts_per_call: prompts per call (batched: their groups travel in one object).
        calls_per_actor: queued calls per batched actor, so that it keeps generating while the
            driver does something else (a streaming actor takes every call admission allows).
        num_cpus, num_gpus, resources: Ray resources of each actor (``resources={"rollout": 1}``
            places them on nodes that offer a custom ``rollout`` resource).
        placement_group: the colocated layout: actor i runs in bundle i of this placement group
            (the learners', whose bundles hold room for it).
        start: ``start(i, actor_kwargs)`` -> the handle of an actor that serves rollout actor i
            and that another part of the run owns (a learner hosting the engine in its process:
            ``generation.engine_in_learner``); such an actor is never killed here.
    """

    def __init__(self, actor_kwargs: Mapping[str, Any], num_actors: int, prompts: PromptSource | None,
                 buffer: ArrowBuffer | None, prompts_per_call: int = 1, calls_per_actor: int = 2,
                 num_cpus: float = 1, num_gpus: float = 0,
                 resources: Mapping[str, float] | None = None, placement_group: Any = None,
                 start: Callable[[int, Mapping[str, Any]], ActorHandle] | None = None) -> None:
        import ray

        self._ray = ray
        self._placement_group = placement_group  # colocated: actor i in bundle i
        self._start = start
        actor_kwargs = dict(actor_kwargs)
        self.streaming = actor_kwargs.get("mode", "batched") == "streaming"
        if self.streaming:
            actor_kwargs["max_staleness"] = buffer.max_staleness
        self._remote = ray.remote(RolloutActor)
        self._options = dict(num_cpus=num_cpus, num_gpus=num_gpus, resources=dict(resources or {}),
                             max_restarts=0, runtime_env={"env_vars": {
                                 "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                 # vLLM logs every pause, reload and cache reset at INFO
                                 "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}})
        self.actor_kwargs = actor_kwargs
        self.prompts, self.buffer = prompts, buffer
        self.prompts_per_call, self.calls_per_actor = prompts_per_call, calls_per_actor
        self.version, self._weights, self._pushes = 0, None, 0
        self.ledger = PushLedger()  # the attestation of every push
        self.slots: list[_Slot] = []
        self.stats = {"groups": 0, "tokens": 0, "filtered": 0, "actor_restarts": 0, "reissued": 0, "aborted": 0,
                      "generate_s": 0.0, "score_s": 0.0}  # summed over the actors' calls
        self._busy_at_last_step = (0.0, 0.0)  # generate_s, score_s at the last step_metrics()
        self.judge_stats = JudgeStats()  # the judges' work since the last step_metrics()
        self._filtered_in_a_row = 0  # prompts filtered since a group was last generated
        self.resize(num_actors)

    @property
    def in_flight(self) -> int:
        """Groups being generated (handed out, not yet reported)."""
        return sum(len(c.prompts) - len(c.reported) for s in self.slots for c in s.calls)

    def _start_actor(self, index: int) -> _Slot:
        options = dict(self._options)
        if self._placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group, placement_group_bundle_index=index)
        # each actor its own sampling stream (a restarted one takes up its predecessor's)
        seed = self.actor_kwargs.get("seed", 0) + 7919 * index
        kwargs = dict(self.actor_kwargs, seed=seed)
        handle = self._start(index, kwargs) if self._start else self._remote.options(**options).remote(**kwargs)
        if self._weights is not None:
            self.ledger.awaiting(self.label(handle, index), self.version,
                                 handle.set_weights.remote(self.version, self._weights, self._pushes))
        # no work goes to an actor before it has started: prompts wait for a ready one instead
        return _Slot(handle, handle.ready.remote())

    def resize(self, n: int) -> None:
        """Grows or shrinks to ``n`` actors; a removed actor's prompts are re-issued."""
        if n < 1:
            raise ValueError(f"a rollout group needs >= 1 actor; got {n}")
        while len(self.slots) < n:
            self.slots.append(self._start_actor(len(self.slots)))
        while len(self.slots) > n:  # actors still waiting to be placed go first
            waiting = [s for s in self.slots if s.starting is not None]
            slot = waiting[-1] if waiting else self.slots[-1]
            self.slots.remove(slot)
            self._reissue(slot.calls)
            self._kill(slot.handle)

    def _kill(self, handle: ActorHandle) -> None:
        if self._start is None:  # (an actor served by another part of the run is its to end)
            self._ray.kill(handle)

    def receivers(self) -> list[ActorHandle]:
        """The actors' handles, in slot order (the receivers of a weight push)."""
        return [s.handle for s in self.slots]

    def placement(self) -> list[str | None]:
        """The node id of every actor (None: not started yet, e.g. waiting for a node)."""
        return [None if s.starting is not None else s.node_id for s in self.slots]

    def sleep(self) -> None:
        """Every actor's engine releases its accelerator memory (colocated layout)."""
        self._ray.get([s.handle.sleep.remote() for s in self.slots if s.starting is None])

    def wake_up(self) -> None:
        self._ray.get([s.handle.wake_up.remote() for s in self.slots if s.starting is None])

    def set_weights(self, version: int, weights: Any) -> None:
        """Queues new weights on every actor (applied between generations): the refs of a push's
        buckets, or (tests) a ref of a dict of named arrays; ``RolloutActor.set_weights``."""
        self.version, self._weights = version, weights
        self._pushes += 1  # its place: a push after a restore may send an older version than the last
        for i, slot in enumerate(self.slots):
            self.ledger.awaiting(self.label(slot.handle, i), version,
                                 slot.handle.set_weights.remote(version, weights, self._pushes))

    def label(self, handle: ActorHandle, index: int | None = None) -> str:
        """How messages name an actor: its slot and Ray actor id."""
        if index is None:
            index = next((i for i, s in enumerate(self.slots) if s.handle == handle), -1)
        return f"rollout actor {index} (Ray actor {handle._actor_id.hex()[:12]})"

    def pump(self, timeout: float = 0.0, until: Sequence[Any] = ()) -> None:
        """Collects finished calls (waiting up to ``timeout`` s for one, or for one of ``until``:
        refs of other work the caller awaits), then starts new ones."""
        self.collect(timeout, until)
        self._submit()

    def collect(self, timeout: float = 0.0, until: Sequence[Any] = ()) -> None:
        """Takes in what has finished (waiting up to ``timeout`` s for something, or for one of
        ``until``: with nothing in flight the wait is on those alone, never a spin): started
        actors, finished calls into the buffer, dead actors replaced with their calls re-issued;
        starts no new call. Weight reports that arrived are checked (``PushLedger.poll``)."""
        self.ledger.poll()
        starting = [s.starting for s in self.slots if s.starting is not None]
        waitables = [c.gen for s in self.slots for c in s.calls] + starting
        if not waitables:
            if until and timeout > 0:
                self._ray.wait(list(until), num_returns=1, timeout=timeout, fetch_local=False)
            return
        wait = timeout
        while waitables:  # every item that is ready now (a stream may hold several)
            # fetch_local=False: a ready batch stays where its actor wrote it
            ready, _ = self._ray.wait(waitables, num_returns=len(waitables), timeout=0, fetch_local=False)
            if not ready and wait > 0:
                ready, _ = self._ray.wait(waitables + list(until), num_returns=1, timeout=wait, fetch_local=False)
            ready = set(ready).difference(until)
            if not ready:
                return
            wait = 0
            for slot in list(self.slots):
                if slot.starting in ready:
                    self._started(slot)
                for call in [c for c in slot.calls if c.gen in ready]:
                    if call in slot.calls:  # a restart may have re-issued it meanwhile
                        self._next_item(slot, call)
            waitables = [c.gen for s in self.slots for c in s.calls] + [
                s.starting for s in self.slots if s.starting is not None]

    def wait_for(self, groups: int, timeout: float | None = None) -> None:
        """Pumps until the buffer holds ``groups`` groups."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._submit()
        while len(self.buffer) < groups:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the buffer holds {len(self.buffer)} of {groups} groups after {timeout} s")
            self.pump(timeout=1.0)

    def complete(self, prompts: Sequence[str | list], n: int, sampling: Mapping[str, Any],
                 progress: Callable[[int], Any] | None = None,
                 rows: Sequence[Mapping[str, Any]] | None = None, score: bool = False) -> list[list[Any]]:
        """n completions of every prompt (evaluation; ``RolloutActor.complete``: ``Completion``s,
        scored with the actors' rewards where ``score``), in
        calls of ``prompts_per_call`` prompts spread as training calls are: to the started actor
        with the fewest calls in flight, at most ``calls_per_actor`` each. An actor that dies is
        replaced (its training calls re-issued as always) and its evaluation calls go out again.
        Training calls in flight go on meanwhile; their finished groups are collected into the
        buffer. ``progress(k)`` is called as each call of k prompts returns. ``rows``: per prompt,
        what a tool environment's ``reset`` and the rewards get besides it."""
        todo = collections.deque(range(0, len(prompts), self.prompts_per_call))
        out: list[Any] = [None] * len(prompts)
        pending: dict[Any, tuple[_Slot, Any, int]] = {}  # ref -> (slot, its handle then, start)
        while todo or pending:
            self.collect(0)  # actors that finished starting; training streams go on
            load = collections.Counter(id(slot) for slot, _, _ in pending.values())
            while todo:
                free = [s for s in self.slots if s.starting is None and load[id(s)] < self.calls_per_actor]
                if not free:
                    break
                slot = min(free, key=lambda s: load[id(s)])
                start = todo.popleft()
                chunk = list(prompts[start:start + self.prompts_per_call])
                chunk_rows = None if rows is None else [dict(r) for r in rows[start:start + self.prompts_per_call]]
                pending[slot.handle.complete.remote(chunk, n, dict(sampling), chunk_rows, score)] = (slot, slot.handle, start)
                load[id(slot)] += 1
            starting = [s.starting for s in self.slots if s.starting is not None]
            ready, _ = self._ray.wait(list(pending) + starting, num_returns=1, timeout=1.0)
            for ref in [r for r in ready if r in pending]:
                slot, handle, start = pending.pop(ref)
                try:
                    results = self._ray.get(ref)
                except self._ray.exceptions.RayActorError:
                    todo.append(start)
                    if slot.handle is handle:  # not replaced yet (one death fails all its calls)
                        self._actor_lost(slot)
                    continue
                out[start:start + len(results)] = results
                if progress is not None:
                    progress(len(results))
        return out

    def step_metrics(self) -> dict[str, float]:
        """``rollout/*`` of a training step: the actors' generate and score seconds since the last
        call (summed over actors), how many actors on how many nodes, and the event counts."""
        stats, last = self.stats, self._busy_at_last_step
        self._busy_at_last_step = busy = (stats["generate_s"], stats["score_s"])
        placement = self.placement()
        return {"rollout/generate_s": busy[0] - last[0], "rollout/score_s": busy[1] - last[1],
                "rollout/actors": float(len(placement)),
                "rollout/nodes": float(len({n for n in placement if n is not None})),
                "rollout/reissued": float(stats["reissued"]),
                "rollout/aborted": float(stats["aborted"]),
                "rollout/actor_restarts": float(stats["actor_restarts"]),
                "rollout/prompts_filtered": float(stats["filtered"]), **self.judge_stats.take()}

    def fit_to_cluster(self, low: int, high: int) -> None:
        """Actors on nodes the cluster reports dead replaced (``replace_lost``); elastic rollouts
        (``num_env_runners = [low, high]``): as many actors as the nodes offering the actors'
        custom resource can hold, within the range; shrinking drops actors still waiting for a
        node first, and re-issues the prompts of any removed actor."""
        self.replace_lost()
        if low == high:
            return
        need = self._options["resources"]
        total = self._ray.cluster_resources()
        capacity = min(int(total.get(k, 0) // v) for k, v in need.items() if v)
        current = len(self.slots)
        if capacity < current:
            self.resize(max(low, capacity))
        elif current < high and None not in self.placement():
            free = self._ray.available_resources()
            room = min(int(free.get(k, 0) // v) for k, v in need.items() if v)
            if room > 0:
                self.resize(min(high, current + room))

    def replace_lost(self) -> None:
        """Actors on a node the cluster reports dead (its raylet lost) are replaced, their calls
        re-issued, without waiting for a call of theirs to fail: an idle one has none."""
        placed = [s for s in self.slots if s.starting is None and s.node_id is not None]
        if not placed or self._start is not None:  # (a hosted actor's owner is the learners')
            return
        alive = {n["NodeID"] for n in self._ray.nodes() if n["Alive"]}
        for slot in [s for s in placed if s.node_id not in alive]:
            self._actor_lost(slot)

    def _started(self, slot: _Slot) -> None:
        try:
            slot.node_id = self._ray.get(slot.starting)
            slot.starting, slot.failed_starts = None, 0
        except self._ray.exceptions.RayActorError as err:  # died while starting: start another
            if self._start is not None:  # its owner died (a learner): the owner's recovery hosts it anew
                raise
            self._kill(slot.handle)
            slot.failed_starts += 1
            if slot.failed_starts >= MAX_FAILED_STARTS:
                raise RuntimeError(f"rollout actor {self.slots.index(slot)} failed to start "
                                   f"{slot.failed_starts} times in a row (a model or engine_kwargs "
                                   f"its engine cannot load?); the last error: {err}") from None
            self._replace(slot)

    def restart(self, handles: Sequence[ActorHandle]) -> None:
        """Replaces the actors ``handles`` (dead, or stuck in a broken weight broadcast): their
        calls in flight are re-issued, each gets a fresh actor."""
        for slot in [s for s in self.slots if any(s.handle is h for h in handles)]:
            self._reissue(slot.calls)
            self._kill(slot.handle)
            self._replace(slot)

    def _replace(self, slot: _Slot) -> None:
        fresh = self._start_actor(self.slots.index(slot))
        slot.handle, slot.starting, slot.calls = fresh.handle, fresh.starting, []  # failed_starts kept
        slot.node_id = None  # (until it has started, somewhere)
        slot.restarts += 1
        self.stats["actor_restarts"] += 1

    def _submit(self) -> None:
        """New calls while admission allows: batched, up to ``calls_per_actor`` per actor;
        streaming, every admitted prompt at once, to the actor with the fewest in flight."""
        if self.prompts is None:  # a group that only evaluates
            return
        limit = float("inf") if self.streaming else self.calls_per_actor
        while True:
            started = [s for s in self.slots if s.starting is None and len(s.calls) < limit]
            n = min(self.prompts_per_call, self.buffer.room(self.in_flight))
            if not started or n <= 0:
                return
            slot = min(started, key=lambda s: sum(len(c.prompts) - len(c.reported) for c in s.calls))
            batch = self.prompts.take(n)
            if not batch:  # a bounded source that has handed out everything
                return
            gen = slot.handle.stream.options(num_returns="streaming").remote(batch)
            slot.calls.append(_Call(gen, batch))

    def _next_item(self, slot: _Slot, call: _Call) -> None:
        """Takes the next item of a ready stream: a batch ref (kept, never fetched), or the
        metadata that follows it (read); the stream's end; or its actor's death."""
        try:
            ref = next(call.gen)
        except StopIteration:  # the call is over
            slot.calls.remove(call)
            if call.has_batch:  # it ended between a batch and its metadata: it failed
                try:  # the failure (a batch is fetched only if the actor died right after it)
                    self._ray.get(call.batch)
                except self._ray.exceptions.RayActorError:
                    self._reissue([call])
                    self._actor_lost(slot)
                    return
            self._reissue_prompts(call.unreported())  # anything not reported goes out again
            return
        if not call.has_batch:
            call.batch, call.has_batch = ref, True
            return
        call.has_batch = False
        try:
            meta = self._ray.get(ref)
        except self._ray.exceptions.RayActorError:  # the actor died: all its calls are lost
            self._actor_lost(slot)
            return
        except self._ray.exceptions.ObjectLostError:
            slot.calls.remove(call)
            self._reissue([call])
            return
        self._take(call, meta)

    def _actor_lost(self, slot: _Slot) -> None:
        """A dead actor: its calls' unreported prompts re-issued, a fresh actor in its place."""
        if slot in self.slots:
            self._reissue(slot.calls)
            self._kill(slot.handle)
            self._replace(slot)

    def _take(self, call: _Call, meta: CallMeta) -> None:
        for group_id, reason in meta.filtered:
            self.prompts.mark_filtered(group_id, reason)
        call.reported.update(g for g, _ in meta.filtered)
        call.reported.update(meta.aborted)
        call.reported.update(g.group_id for g in meta.groups)
        self.prompts.reissue(list(meta.aborted))
        self.stats["aborted"] += len(meta.aborted)
        self.stats["filtered"] += len(meta.filtered)
        if meta.groups:
            self._filtered_in_a_row = 0
        elif meta.filtered:
            self._filtered_in_a_row += len(meta.filtered)
        if meta.filtered and self._filtered_in_a_row >= len(self.prompts):
            raise PromptsExhausted(
                f"no prompt could be generated for a whole epoch ({self._filtered_in_a_row} "
                f"prompts in a row were filtered before generation; the last: "
                f"{meta.filtered[-1][1]}); raise llm.max_prompt_tokens (within the model's "
                f"context, minus generation.max_tokens) or shorten the prompts")
        finished_at = meta.timing.finished_at if meta.timing is not None else None
        refs = [dataclasses.replace(g, ref=call.batch, finished_at=finished_at) for g in meta.groups]
        stale = self.buffer.add(refs)
        self.prompts.reissue(stale)
        self.stats["reissued"] += len(stale)
        self.stats["groups"] += len(refs) - len(stale)
        self.stats["tokens"] += meta.tokens
        if meta.timing is not None:
            self.stats["generate_s"] += meta.timing.generate_s
            self.stats["score_s"] += meta.timing.score_s
        if meta.judge is not None:
            self.judge_stats.add(meta.judge)

    def _reissue(self, calls: list[_Call]) -> None:
        for call in calls:
            self._reissue_prompts(call.unreported())

    def _reissue_prompts(self, prompts: list[Prompt]) -> None:
        self.prompts.reissue([p.group_id for p in prompts])
        self.stats["reissued"] += len(prompts)

    def discard_in_flight(self) -> None:
        """Forgets every call in flight (their results are ignored, their prompts NOT re-issued):
        for a restore, whose prompt state re-issues what was in flight when it was saved. The
        calls are cancelled (queued ones never run; a streaming one aborts its requests)."""
        for slot in self.slots:
            self._cancel(slot.calls)
            slot.calls = []

    def _cancel(self, calls: list[_Call]) -> None:
        for call in calls:
            try:
                self._ray.cancel(call.gen)
            except Exception:  # noqa: BLE001 - finished, or its actor is gone
                pass

    def on_update(self, version: int, weights: list[ObjectRef] | None) -> None:
        """After a learner update: new weights out (``None``: they were broadcast already; an
        actor started later gets them at the next push), too-stale buffered groups re-issued."""
        if weights is None:
            self.version, self._weights = version, None
        else:
            self.set_weights(version, weights)
        stale = self.buffer.set_version(version)
        self.prompts.reissue(stale)
        self.stats["reissued"] += len(stale)

    def shutdown(self) -> None:
        for slot in self.slots:
            self._cancel(slot.calls)  # queued calls would otherwise run before shutdown
            try:
                self._ray.get(slot.handle.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - the actor may be dead already
                pass
            self._kill(slot.handle)
        self.slots = []


def request_rollout_nodes(per_actor: Mapping[str, float], actors: int) -> None:
    """Asks the autoscaler (where one runs) for room for ``actors`` rollout actors."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[dict(per_actor)] * actors)
    except Exception as err:  # noqa: BLE001 - no autoscaler (a local or fixed cluster): fine
        logger.info("no autoscaler to ask for rollout nodes: %s", err)
