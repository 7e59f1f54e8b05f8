"""Rollout actors and the group that owns them.

A ``RolloutActor`` (a Ray actor) turns prompts into complete groups: apply the chat template,
generate G completions per prompt with its engine (``hf`` or ``vllm``), score them with the K
rewards (``actors.reward.RewardPool``, worker processes), and return the groups as ONE Arrow
record batch (each group G contiguous rows) tagged with the policy version that generated them.
Every call is a Ray streaming generator (``stream``) whose items come in pairs: a record batch
(written once into Ray's object store by the actor; the driver only ever holds its reference,
and waits on it with ``fetch_local=False``), then small metadata (``CallMeta``: per group its
rewards, errors, lengths, finish reasons and version), all the driver reads. Here a call yields
one pair; the streaming actor (``actors.streaming``) one per group as it finishes. New weights
arrive between generations through ``set_weights(version, weights)`` (in flight when streaming).

``RolloutGroup`` (driver side) owns the actors: their number and resources (CPUs, GPUs, a
custom Ray resource that pins them to rollout nodes) are set apart from the learners. It keeps
every actor busy with queued calls within the buffer's admission bound, moves finished groups
into the ``ArrowBuffer``, restarts a dead actor (with the current weights) and re-issues its
prompts, and ``resize(n)`` adds or removes actors while a run goes on.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Any, Iterator, Mapping, Sequence

import pyarrow as pa

from actors.buffer import ArrowBuffer
from actors.engines import SamplingParams, make_engine
from actors.prompts import Prompt, PromptSource
from gdpo_ray.batch import CallMeta, CallTiming, GroupData, build_groups
from gdpo_ray.config import default
from gdpo_ray.groups import describe_groups
from gdpo_ray.rewards import TrainerState


class PromptsExhausted(RuntimeError):
    """Every prompt of an epoch was filtered before generation: the run cannot go on."""


class RolloutActor:
    """Generates and scores complete groups (run as a Ray actor by ``RolloutGroup``).

    Args:
        model_path: a local HF model directory (or anything the engine loads).
        rewards: the K reward declarations (see ``gdpo_ray.rewards.RewardSpec``).
        group_size: G, completions per prompt (>= 2).
        engine: "hf" (CPU default) or "vllm"; ``engine_kwargs`` go to it.
        sampling: ``SamplingParams`` fields.
        chat_template: apply the tokenizer's chat template to string prompts too (as one user
            message); chat-message prompts always get it.
        max_prompt_tokens: longer prompts are filtered ("prompt too long"), not generated.
        reward_workers: scoring worker processes of this actor.
        num_threads: torch threads in this actor.
        model_files: ``model_path``'s files in the object store (``gdpo_ray.model_files.pack``),
            used when this node cannot read ``model_path``.
    """

    def __init__(self, model_path: str, rewards: Sequence[Mapping[str, Any]], group_size: int,
                 engine: str = default("engine"), engine_kwargs: Mapping[str, Any] | None = None,
                 sampling: Mapping[str, Any] | None = None, chat_template: bool = default("chat_template"),
                 max_prompt_tokens: int = default("max_prompt_tokens"),
                 reward_workers: int = default("reward_workers"), num_threads: int = default("num_threads"),
                 seed: int = 0, model_files: Any = None) -> None:
        import torch

        from actors.reward import RewardPool
        from gdpo_ray.model_files import local_dir

        torch.set_num_threads(num_threads)
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2; got {group_size}")
        self.group_size, self.chat_template = group_size, chat_template
        self.max_prompt_tokens = max_prompt_tokens
        self.sampling = SamplingParams(**dict(sampling or {}))
        model_path = local_dir(model_path, model_files)  # a driver-only directory, shipped
        self.engine = make_engine(engine, model_path, seed=seed, **dict(engine_kwargs or {}))
        self.tokenizer = self.engine.tokenizer
        # no rewards: an actor that only completes prompts (evaluation: ``complete``)
        self.rewards = RewardPool(rewards, num_workers=reward_workers) if rewards else None
        self.version, self.channel = 0, None

    def ready(self) -> str:
        """The id of the Ray node this actor runs on (once it has started)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def sleep(self) -> None:
        """Frees the engine's accelerator memory while colocated learners update (vLLM's sleep
        mode); the hf engine keeps its weights where they are."""
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def policy_version(self) -> int:
        return self.version

    def set_weights(self, version: int, weights: Any) -> int:
        """Loads new weights and becomes ``version``: a name -> tensor dict, or a list of
        ObjectRefs of weight buckets (``gdpo_ray.weights.buckets``), read one at a time, zero-copy."""
        import ray

        from gdpo_ray.weights.buckets import unpack_bucket

        if isinstance(weights, Mapping):
            self.engine.load_weights(weights.items())
        else:  # one pass over all buckets, fetched lazily (vLLM reloads layer by layer)
            self.engine.load_weights(itertools.chain.from_iterable(
                unpack_bucket(ray.get(ref)) for ref in weights))
        self.version = int(version)
        return self.version

    def join_broadcast(self, host: str, port: int, rank: int, world_size: int) -> str:
        """Joins the learners' weight broadcast group as ``rank`` (``gdpo_ray.weights.channels``),
        proposing what its engine's device allows (gloo on CPU, NCCL on CUDA, vLLM's weight
        transfer for vllm on CUDA); returns the group's backend."""
        from gdpo_ray.weights.channels import open_channel, receiver_backend

        if self.channel is not None:
            self.channel.close()
        self.channel = open_channel(host, port, rank, world_size, receiver_backend(self.engine))
        self.channel.attach(self.engine)
        return self.channel.backend

    def receive_weights(self, version: int) -> int:
        """Loads one broadcast version into the engine and becomes ``version``."""
        self.channel.receive_into(self.engine)
        self.version = int(version)
        return self.version

    def greedy(self, prompts: Sequence[str | list], max_tokens: int) -> list[list[int]]:
        """Greedy completions of prompts (chat template applied as for generation)."""
        return self.engine.greedy([self.tokenize(p) for p in prompts], max_tokens)

    def complete(self, prompts: Sequence[str | list], n: int,
                 sampling: Mapping[str, Any]) -> list[list[tuple[str, int, str]]]:
        """n completions of each prompt (evaluation: ``sampling`` as ``SamplingParams``'
        fields, top-p/top-k allowed, no logprobs kept): per prompt, (text, tokens, finish
        reason). A prompt over ``max_prompt_tokens`` is not generated: n empty completions
        with the reason "prompt_too_long" (scored as the empty answer they are)."""
        ids, fits = self._eval_prompts(prompts)
        samples = self.engine.generate([ids[i] for i in fits], n, SamplingParams(**dict(sampling)),
                                       logprobs=False) if fits else []
        return self._eval_results(n, ids, fits, samples)

    def _eval_prompts(self, prompts: Sequence[str | list]) -> tuple[list[list[int]], list[int]]:
        """(every prompt's token ids, the indices of those within max_prompt_tokens)."""
        ids = [self.tokenize(p) for p in prompts]
        return ids, [i for i, t in enumerate(ids) if len(t) <= self.max_prompt_tokens]

    def _eval_results(self, n: int, ids: list, fits: list[int], samples: Sequence[Sequence[Any]]) -> list:
        out = [[("", 0, "prompt_too_long")] * n for _ in ids]
        for i, group in zip(fits, samples):
            out[i] = [(self.tokenizer.decode(s.token_ids, skip_special_tokens=True), len(s.token_ids),
                       s.finish_reason) for s in group]
        return out

    def tokenize(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) or self.chat_template:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def split(self, prompts: Sequence[Prompt]) -> tuple[list[Prompt], list[list[int]], list[tuple[str, str]]]:
        """-> (the prompts to generate, their token ids, (group_id, reason) of those filtered)."""
        kept, ids, filtered = [], [], []
        for p in prompts:
            tokens = self.tokenize(p.prompt)
            if len(tokens) > self.max_prompt_tokens:
                filtered.append((p.group_id, f"prompt too long ({len(tokens)} > {self.max_prompt_tokens} tokens)"))
            else:
                kept.append(p)
                ids.append(tokens)
        return kept, ids, filtered

    def generate(self, prompts: Sequence[Prompt]) -> tuple[CallMeta, pa.RecordBatch | None]:
        """-> (metadata, one record batch of the complete groups)."""
        start = time.perf_counter()
        version = self.version
        kept, ids, filtered = self.split(prompts)
        if not kept:
            return CallMeta(groups=[], filtered=filtered), None
        samples = self.engine.generate(ids, self.group_size, self.sampling)
        return self.score(kept, ids, samples, version, filtered, start, time.perf_counter())

    def stream(self, prompts: Sequence[Prompt]) -> Iterator[Any]:
        """The call the driver makes (``num_returns="streaming"``): pairs of (record batch or
        None, its metadata), the batch first, so that metadata that arrives vouches for its batch.
        Here one pair for the whole call."""
        meta, batch = self.generate(prompts)
        yield batch
        yield meta

    def score(self, kept: Sequence[Prompt], ids: Sequence[list[int]], samples: Sequence[Sequence[Any]],
              version: int, filtered: list[tuple[str, str]], start: float,
              generated: float) -> tuple[CallMeta, pa.RecordBatch]:
        """Scores the G samples of each prompt of ``kept`` and builds their groups: -> (metadata,
        one record batch). A sample with ``versions`` (streaming) gives each token's policy
        version; a group's ``policy_version`` is the oldest of its tokens."""
        flat = [s for group in samples for s in group]
        texts = self.tokenizer.batch_decode([s.token_ids for s in flat], skip_special_tokens=True)
        g = self.group_size
        columns = {name: [value for p in kept for value in [p.columns[name]] * g]
                   for name in kept[0].columns}
        columns["response_length"] = [len(s.token_ids) for s in flat]
        # as TRL passes them: a conversational row's prompt is its messages, its completion one
        # assistant message
        chat = [not isinstance(p.prompt, str) for p in kept for _ in range(g)]
        prompts_in = [p.prompt for p in kept for _ in range(g)]
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
        scored = self.rewards.score(prompts_in, completions, columns,
                                    completion_ids=[list(s.token_ids) for s in flat],
                                    trainer_state=TrainerState(global_step=version))
        groups = []
        for i, (p, group) in enumerate(zip(kept, samples)):
            rows = slice(i * g, (i + 1) * g)
            versions = [getattr(s, "versions", None) or [version] * len(s.token_ids) for s in group]
            groups.append(GroupData(
                prompt_id=p.prompt_id, group_id=p.group_id, prompt_token_ids=ids[i],
                response_token_ids=[s.token_ids for s in group],
                response_logprobs=[s.logprobs for s in group],
                finish_reasons=[s.finish_reason for s in group],
                policy_version=min((v for vs in versions for v in vs), default=version),
                response_versions=versions,
                rewards=scored.values[rows], reward_errors=scored.errors[rows],
                task_columns=p.columns,
            ))
        batch = build_groups(groups, self.rewards.names, self.sampling.metadata())
        timing = CallTiming(generate_s=generated - start, score_s=time.perf_counter() - generated)
        meta = CallMeta(groups=describe_groups(batch),
                        filtered=filtered, tokens=sum(len(s.token_ids) for s in flat), timing=timing)
        return meta, batch

    def shutdown(self) -> None:
        if self.rewards is not None:
            self.rewards.close()
        if callable(getattr(self.engine, "shutdown", None)):  # an engine with processes of its own
            self.engine.shutdown()


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
    node_id: str | None = None  # where the actor runs, once started


class RolloutGroup:
    """The rollout actors of a run, fed from a PromptSource into an ArrowBuffer.

    Args:
        actor_kwargs: ``RolloutActor`` arguments, plus ``mode``: "batched" (``RolloutActor``, one
            batch per call) or "streaming" (``actors.streaming.StreamingRolloutActor``: groups
            stream out of every call as they finish, weights change in flight).
        num_actors: how many actors to start.
        prompts, buffer: the run's prompt source and buffer (driver objects).
        prompts_per_call: prompts per call (batched: their groups travel in one object).
        calls_per_actor: queued calls per batched actor, so that it keeps generating while the
            driver does something else (a streaming actor takes every call admission allows).
        num_cpus, num_gpus, resources: Ray resources of each actor (``resources={"rollout": 1}``
            places them on nodes that offer a custom ``rollout`` resource).
        placement_group: the colocated layout: actor i runs in bundle i of this placement group
            (the learners', whose bundles hold room for it).
    """

    def __init__(self, actor_kwargs: Mapping[str, Any], num_actors: int, prompts: PromptSource,
                 buffer: ArrowBuffer, prompts_per_call: int = 1, calls_per_actor: int = 2,
                 num_cpus: float = 1, num_gpus: float = 0,
                 resources: Mapping[str, float] | None = None, placement_group: Any = None) -> None:
        import ray

        self._ray = ray
        self._placement_group = placement_group  # colocated: actor i in bundle i
        actor_kwargs = dict(actor_kwargs)
        self.streaming = actor_kwargs.pop("mode", "batched") == "streaming"
        if self.streaming:
            from actors.streaming import StreamingRolloutActor

            self._remote = ray.remote(StreamingRolloutActor)
            actor_kwargs["max_staleness"] = buffer.max_staleness
        else:
            self._remote = ray.remote(RolloutActor)
        self._options = dict(num_cpus=num_cpus, num_gpus=num_gpus, resources=dict(resources or {}),
                             max_restarts=0, runtime_env={"env_vars": {
                                 "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                 # vLLM logs every pause, reload and cache reset at INFO
                                 "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}})
        self.actor_kwargs = actor_kwargs
        self.prompts, self.buffer = prompts, buffer
        self.prompts_per_call, self.calls_per_actor = prompts_per_call, calls_per_actor
        self.version, self._weights = 0, None
        self.slots: list[_Slot] = []
        self.stats = {"groups": 0, "tokens": 0, "filtered": 0, "actor_restarts": 0, "reissued": 0, "aborted": 0,
                      "generate_s": 0.0, "score_s": 0.0}  # summed over the actors' calls
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
        handle = self._remote.options(**options).remote(**dict(self.actor_kwargs, seed=seed))
        if self._weights is not None:
            handle.set_weights.remote(self.version, self._weights)
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
            self._ray.kill(slot.handle)

    def receivers(self) -> list[Any]:
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
        """Queues new weights on every actor (applied between generations)."""
        self.version, self._weights = version, weights
        for slot in self.slots:
            slot.handle.set_weights.remote(version, weights)

    def pump(self, timeout: float = 0.0) -> None:
        """Collects finished calls (waiting up to ``timeout`` s for one), then starts new ones."""
        self.collect(timeout)
        self._submit()

    def collect(self, timeout: float = 0.0) -> None:
        """Takes in what has finished (waiting up to ``timeout`` s for something): started
        actors, finished calls into the buffer, dead actors replaced with their calls re-issued;
        starts no new call."""
        starting = [s.starting for s in self.slots if s.starting is not None]
        waitables = [c.gen for s in self.slots for c in s.calls] + starting
        wait = timeout
        while waitables:  # every item that is ready now (a stream may hold several)
            # fetch_local=False: a ready batch stays where its actor wrote it
            ready, _ = self._ray.wait(waitables, num_returns=len(waitables), timeout=0, fetch_local=False)
            if not ready and wait > 0:
                ready, _ = self._ray.wait(waitables, num_returns=1, timeout=wait, fetch_local=False)
            if not ready:
                return
            wait = 0
            ready = set(ready)
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

    def _started(self, slot: _Slot) -> None:
        try:
            slot.node_id = self._ray.get(slot.starting)
            slot.starting = None
        except self._ray.exceptions.RayActorError:  # died while starting: start another
            self._ray.kill(slot.handle)
            self._replace(slot)

    def restart(self, handles: Sequence[Any]) -> None:
        """Replaces the actors ``handles`` (dead, or stuck in a broken weight broadcast): their
        calls in flight are re-issued, each gets a fresh actor."""
        for slot in [s for s in self.slots if any(s.handle is h for h in handles)]:
            self._reissue(slot.calls)
            self._ray.kill(slot.handle)
            self._replace(slot)

    def _replace(self, slot: _Slot) -> None:
        fresh = self._start_actor(self.slots.index(slot))
        slot.handle, slot.starting, slot.calls = fresh.handle, fresh.starting, []
        slot.restarts += 1
        self.stats["actor_restarts"] += 1

    def _submit(self) -> None:
        """New calls while admission allows: batched, up to ``calls_per_actor`` per actor;
        streaming, every admitted prompt at once, to the actor with the fewest in flight."""
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
            self._ray.kill(slot.handle)
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
        refs = [dataclasses.replace(g, ref=call.batch) for g in meta.groups]
        stale = self.buffer.add(refs)
        self.prompts.reissue(stale)
        self.stats["reissued"] += len(stale)
        self.stats["groups"] += len(refs) - len(stale)
        self.stats["tokens"] += meta.tokens
        if meta.timing is not None:
            self.stats["generate_s"] += meta.timing.generate_s
            self.stats["score_s"] += meta.timing.score_s

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

    def on_update(self, version: int, weights: Any) -> None:
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
            self._ray.kill(slot.handle)
        self.slots = []
