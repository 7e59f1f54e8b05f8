"""The rollout actor: prompts in, complete scored groups out.

A ``RolloutActor`` (a Ray async actor) turns prompts into complete groups: apply the chat
template, run G rollouts per prompt through the turn loop (``actors.turn_loop``: one state
machine for single-turn samples and multi-turn rollouts with tools, training's and
evaluation's) on its engine (``hf``, ``vllm`` or a class of ``actors.engines``), through the
sampler of the engine's mode (``actors.samplers``: ``batched``, one engine call per round of a
call's turns; ``streaming``, each turn a request of its own, weights changed in flight), score
them with the K rewards (``actors.reward.RewardPool``, worker processes) and return them as Arrow
record batches (each group G contiguous rows) tagged with the policy version that generated them.
The driver calls ``stream`` (a Ray streaming generator) whose items come in pairs: a record batch
(written once into Ray's object store by the actor; the driver only ever holds its reference),
then small metadata (``CallMeta``: per group its rewards, errors, lengths, finish reasons and
version), all the driver reads. A batched call yields one pair for all its groups; a streaming
call one per group (or per groups done together) as soon as it is scored, so a group that
finishes early never waits for a slower one started before it.

New weights arrive through ``set_weights`` (object store) or ``receive_weights`` (a broadcast),
loaded between calls (batched) or in flight (streaming: fetched and written while the engine
generates, then the engine pauses with its requests kept, loads them, labels the new version and
resumes; each token records the version that sampled it, ``response_versions``). A group whose
oldest token is older than ``max_staleness`` behind the new version can never be trained: it is
aborted and reported (``CallMeta.aborted``) for the driver to re-issue (``rollout/aborted``).
The driver's side of the actors is ``actors.rollout_group.RolloutGroup``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import time
from typing import Any, AsyncIterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from actors.engines import SamplingParams, engine_class, make_engine, traits_of
from actors.judging import Judging, merged
from actors.prompts import Prompt
from actors.samplers import SAMPLERS
from actors.tool_loop import ToolEnvironment, preloaded_modules
from actors.turn_loop import Rollout, TurnLoop
from gdpo_ray.batch import CallMeta, CallTiming, GroupData, build_groups
from gdpo_ray.config import default
from gdpo_ray.eval.suite import Completion
from gdpo_ray.environments.tool_prompt import render_prompt
from gdpo_ray.forks import fork_context
from gdpo_ray.groups import describe_groups
from gdpo_ray.rewards import TrainerState, completion_text


class PromptsExhausted(RuntimeError):
    """Every prompt of an epoch was filtered before generation: the run cannot go on."""


class RolloutActor:
    """Generates and scores complete groups (run as a Ray actor by ``RolloutGroup``).

    Args:
        model_path: a local HF model directory (or anything the engine loads).
        rewards: the K reward declarations (see ``gdpo_ray.rewards.RewardSpec``); None: an actor
            that only completes prompts (evaluation: ``complete``).
        group_size: G, completions per prompt (>= 2).
        engine: "hf" (CPU default), "vllm", or a "package.module:Class" of the ``mode``'s
            protocol (``actors.engines``); ``engine_kwargs`` go to it.
        mode: ``generation.mode``, "batched" or "streaming" (``actors.samplers``).
        max_staleness: the buffer's: streaming groups that fall further behind a push are
            aborted in flight.
        sampling: ``SamplingParams`` fields.
        chat_template: apply the tokenizer's chat template to string prompts too (as one user
            message); chat-message prompts always get it.
        system_prompt: a system message put before every prompt that has none of its own
            (``data.system_prompt``).
        max_prompt_tokens: longer prompts are filtered ("prompt too long"), not generated.
        reward_workers: scoring worker processes of this actor (None: ``num_threads``).
        num_threads: torch threads in this actor.
        model_files: ``model_path``'s files in the object store (``gdpo_ray.model_files.pack``),
            used when this node cannot read ``model_path``.
        judges: the judge pool's actor handles (``actors.judge_pool.JudgePool``) for ``fn: judge``
            rewards without url, asked ``judge_batch_size`` messages per call (``actors.judging``).
        lora: ``llm.lora``'s PEFT settings (the engine serves the base model plus the pushed
            adapter), or None (full weights).
        environment: ``data.tool_environment``, 'module:Class': multi-turn rollouts with its tools
            (``actors.tool_loop``), at most ``max_turns`` model turns, each tool call within
            ``tool_timeout`` seconds; None: single-turn. ``tools_in_system_prompt``: where the
            model is shown the tools (``gdpo_ray.environments.tool_prompt``).
    """

    def __init__(self, model_path: str, rewards: Sequence[Mapping[str, Any]] | None, group_size: int,
                 engine: str = default("engine"), engine_kwargs: Mapping[str, Any] | None = None,
                 sampling: Mapping[str, Any] | None = None, chat_template: bool = default("chat_template"),
                 max_prompt_tokens: int = default("max_prompt_tokens"),
                 reward_workers: int | None = default("reward_workers"), num_threads: int = default("num_threads"),
                 seed: int = 0, model_files: Any = None, lora: Mapping[str, Any] | None = None,
                 environment: str | None = None, max_turns: int = default("max_turns"),
                 tool_timeout: float = default("tool_timeout"), system_prompt: str | None = None,
                 tools_in_system_prompt: str = default("tools_in_system_prompt"),
                 mode: str = "batched", max_staleness: int = 0, judges: Sequence[Any] | None = None,
                 judge_batch_size: int = default("judge_batch_size")) -> None:
        from actors.reward import RewardPool
        from gdpo_ray.batch import arrow_without_pandas
        from gdpo_ray.model_files import local_dir

        arrow_without_pandas()
        traits = traits_of(engine_class(engine, mode))
        if traits.uses_torch:  # (a simulated engine's actor imports no torch)
            import torch

            torch.set_num_threads(num_threads)
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2; got {group_size}")
        self.group_size, self.chat_template, self.system_prompt = group_size, chat_template, system_prompt
        self.max_prompt_tokens, self.max_staleness = max_prompt_tokens, max_staleness
        self.sampling = SamplingParams(**dict(sampling or {}))
        model_path = local_dir(model_path, model_files)  # a driver-only directory, shipped
        engine_kwargs = dict(engine_kwargs or {})
        slots = traits.adapter_slots
        if lora and slots and mode == "streaming":  # every live adapter version runs in a step
            engine_kwargs = {slots: max_staleness + 1, **engine_kwargs}
        extra = {"lora": dict(lora)} if lora else {}  # an engine without LoRA need not take it
        self.engine = make_engine(engine, model_path, mode=mode, seed=seed, **engine_kwargs, **extra)
        self.sampler = SAMPLERS[mode](self.engine, group_size, self._admit)
        self.tokenizer = self.engine.tokenizer
        if environment is not None:  # before the reward pool starts the fork server they share
            fork_context(preloaded_modules(environment))
        self.rewards = RewardPool(rewards, num_workers=reward_workers or num_threads) if rewards else None
        judged = rewards and self.rewards.judge_columns
        self.judging = Judging(self.rewards.specs, judges, judge_batch_size) if judged else None
        self.tools = None
        if environment is not None:
            specs = self.rewards.specs if self.rewards else []
            self.tools = ToolEnvironment(environment, self.tokenizer, max_turns, tool_timeout, tools_in_system_prompt,
                                         readers=[s for s in specs if s.name in self.rewards.local],
                                         floors={s.name: s.floor or 0.0 for s in specs})
        self.version, self.channel = 0, None
        self._order = 0  # the place of the push loaded last in its sender's sequence (set_weights)
        self._open: dict[str, list] = {}  # group_id -> [version its first request entered at or None, task]
        self._push = asyncio.Lock()
        self._pending: set[int] = set()  # versions whose push has arrived and not finished
        self._versions = asyncio.Condition()  # notified at the end of every push
        self._scorer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="score")
        self._closed = False

    def ready(self) -> str:
        """The id of the Ray node this actor runs on (once it has started)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def policy_version(self) -> int:
        return self.version

    async def settled(self, version: int = 0) -> int:
        """The version held once every push that has arrived is loaded, and ``version`` at least
        (a call may start before a push sent ahead of it: a caller that must see it waits here)."""
        async with self._versions:
            await self._versions.wait_for(lambda: not self._pending and self.version >= version)
        return self.version

    def engine_stats(self) -> dict:
        """Groups in flight here; the engine's requests now, slots and pauses (s), where counted."""
        return {"groups": len(self._open)} | {key: getattr(self.engine, name) for key, name in
                (("active", "active"), ("slots", "max_num_seqs"), ("push_pause_s", "pause_s"))
                if hasattr(self.engine, name)}

    async def sleep(self) -> None:
        """Frees the engine's accelerator memory while colocated learners update (vLLM's sleep mode)."""
        await self.sampler.sleep()

    async def wake_up(self) -> None:
        await self.sampler.wake_up()

    # -- weights ---------------------------------------------------------------------------

    async def set_weights(self, version: int, weights: Any, order: int | None = None) -> dict:
        """Loads new weights and becomes ``version``: a name -> tensor dict, or ObjectRefs of weight
        buckets (``gdpo_ray.weights.buckets``, zero-copy); returns the attestation. ``order``: the
        push's place in its sender's sequence (``RolloutGroup``'s): one arriving after a later one is
        skipped, whatever the versions (a restore sends an older one after a newer); None: its version."""
        from gdpo_ray.weights.buckets import unpack_bucket
        from gdpo_ray.weights.digest import recorded

        sizes: dict[str, int] = {}

        async def load() -> dict[str, str]:
            host = not traits_of(self.engine).uses_torch  # numpy arrays, for an engine without torch
            items = list(weights.items()) if isinstance(weights, Mapping) else [
                t for b in await asyncio.gather(*weights) for t in unpack_bucket(b, host)]
            sizes.update((name, int(t.nbytes)) for name, t in items)
            sent: dict[str, str] = {}
            await self.sampler.load(recorded(items, sent), version)
            return sent

        return await self._update(version, load, order=version if order is None else order, sizes=sizes)

    async def join_broadcast(self, host: str, port: int, rank: int, world_size: int) -> str:
        """Joins the learners' weight broadcast group as ``rank`` (``gdpo_ray.weights.channels``),
        off the event loop, proposing what its engine's device allows (gloo on CPU, NCCL on CUDA,
        vLLM's weight transfer for vllm on CUDA); returns the group's backend."""
        from gdpo_ray.weights.channels import open_channel, receiver_backend

        if self.channel is not None:
            self.channel.close()
        self.channel = await asyncio.get_running_loop().run_in_executor(
            None, open_channel, host, port, rank, world_size, receiver_backend(self.engine))
        async with self.sampler.exclusive():
            joined = self.channel.attach(self.engine)
            if inspect.isawaitable(joined):  # vLLM's weight transfer: the engine joins the group
                await joined
        return self.channel.backend

    async def receive_weights(self, version: int) -> dict:
        """One broadcast version into the engine (``actors.samplers``: ``receive``); returns the
        attestation. A broadcast is a collective: every member takes part, whatever its version."""
        channel = self.channel
        return await self._update(version, lambda: self.sampler.receive(channel, version), order=None)

    async def _update(self, version: int, load: Any, order: int | None, sizes: Mapping[str, int] | None = None) -> dict:
        """Runs ``load()`` (which puts ``version`` into the engine and returns what it sent: name
        -> dtype) as the one push in progress (and, batched, while no call generates), unless a
        push of a later ``order`` was loaded already (None: always), then aborts the groups it
        left too stale. Returns the attestation ``{"version", "digests"}``: the digests of what the
        engine holds of every tensor just loaded, read back from it, for the driver to compare
        with the sender's (``actors.attestation``); ``digests`` None where the push was skipped; an
        engine that cannot read its weights back (NotImplementedError) is reported ``unverified``.
        ``sizes``: name -> bytes loaded (the sampler may digest large tensors beside generation)."""
        self._pending.add(version)  # before any await: a stream call after this one sees it
        try:
            async with self._push:
                if self._closed or (order is not None and order <= self._order):
                    return {"version": self.version, "digests": None}
                async with self.sampler.exclusive():
                    sent = await load()
                self.version, self._order = int(version), self._order if order is None else order
                for fresh in filter(None, (self.tools, self.judging)):  # a new step: environments that
                    fresh.new_step()  # could not start are tried again, its rollouts judged anew
                oldest = self.version - self.max_staleness
                for started, task in list(self._open.values()):
                    if started is not None and started < oldest:
                        task.cancel()
                try:
                    return {"version": self.version, "digests": await self.sampler.digests(sent, sizes)}
                except NotImplementedError as err:
                    return {"version": self.version, "digests": None, "unverified": str(err)}
        finally:
            self._pending.discard(version)
            async with self._versions:
                self._versions.notify_all()

    async def _admit(self) -> None:
        """A group starts decoding only at a version the pushes on their way leave it time to be
        trained at: pushed after step P, it is trained at step P + 1 or later, at most
        max_staleness behind P; started at P - max_staleness it would have to make exactly that
        step, so it waits until the actor is within max(max_staleness - 1, 0) of P (a push lands
        in a fraction of a step; a fresh actor waits for its first push)."""
        slack = max(self.max_staleness - 1, 0)
        async with self._versions:
            await self._versions.wait_for(
                lambda: max(self._pending, default=self.version) - self.version <= slack)

    # -- rollouts --------------------------------------------------------------------------

    async def stream(self, prompts: Sequence[Prompt]) -> AsyncIterator[Any]:
        """The call the driver makes (``num_returns="streaming"``): pairs of (record batch or
        None, its metadata), the batch first, so that metadata that arrives vouches for its batch:
        the scored groups (all at once for a batched call, as they finish for a streaming one;
        the prompts filtered before generation reported with the first), and one pair per group
        aborted in flight."""
        kept, ids, filtered = self.split(prompts)
        await self._admit()
        if not kept:
            yield None
            yield CallMeta(groups=[], filtered=filtered)
            return
        start, version, loop = time.perf_counter(), self.version, asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as generating:
            await generating.enter_async_context(self.sampler.exclusive())  # batched: no push meanwhile
            sampler = self.sampler.round(len(kept) * self.group_size)
            tasks = {}
            for k, (p, tokens) in enumerate(zip(kept, ids)):
                entry = self._open[p.group_id] = [None, None]
                rollouts = [Rollout(k * self.group_size + j, {"prompt": p.prompt, **p.columns}, p.prompt,
                                    None if self.tools else tokens, entry) for j in range(self.group_size)]
                entry[1] = task = asyncio.ensure_future(self._loop(sampler, self.sampling).run(rollouts))
                tasks[task] = (p, rollouts)
            pending, done_groups = set(tasks), []
            try:
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    if not pending:
                        await generating.aclose()  # generated: a push may load while the call scores
                    for task in done:
                        p, rollouts = tasks[task]
                        self._open.pop(p.group_id, None)
                        if task.cancelled():
                            yield None
                            yield CallMeta(groups=[], filtered=[], aborted=(p.group_id,))
                        else:
                            task.result()  # (raises what the loop raised)
                            done_groups.append((p, rollouts))
                    if done_groups and (not self.sampler.one_batch or not pending):
                        done_groups.sort(key=lambda group: group[1][0].key)  # in the call's order
                        generated = time.perf_counter()
                        meta, batch = await loop.run_in_executor(self._scorer, self.score, done_groups, version,
                                                                 filtered, start, generated)
                        done_groups, filtered = [], []
                        yield batch
                        yield meta
            finally:  # the call itself was cancelled (or the actor is going away)
                for task in pending:
                    task.cancel()
                    self._open.pop(tasks[task][0].group_id, None)

    def _loop(self, sampler: Any, sampling: SamplingParams, logprobs: bool = True) -> TurnLoop:
        def entered(r: Rollout) -> None:
            if r.group is not None and r.group[0] is None:
                r.group[0] = self.version

        return TurnLoop(sampler, self.tokenizer, self.tokenize, self.tools, sampling, logprobs, entered)

    async def generate(self, prompts: Sequence[Prompt]) -> tuple[CallMeta, pa.RecordBatch | None]:
        """All of ``prompts``' groups as one batch (the batch call: tests and benchmarks)."""
        metas, batches = [], []
        async for item in self.stream(prompts):
            (batches if len(batches) == len(metas) else metas).append(item)
        real = [b for b in batches if b is not None]
        filtered = [f for m in metas for f in m.filtered]
        if not real:
            return CallMeta(groups=[], filtered=filtered), None
        batch = real[0] if len(real) == 1 else pa.Table.from_batches(real).combine_chunks().to_batches()[0]
        return CallMeta(groups=describe_groups(batch), filtered=filtered, tokens=sum(m.tokens for m in metas),
                        aborted=tuple(itertools.chain.from_iterable(m.aborted for m in metas)),
                        timing=metas[-1].timing, judge=merged([m.judge for m in metas])), batch

    async def complete(self, prompts: Sequence[str | list], n: int, sampling: Mapping[str, Any],
                       rows: Sequence[Mapping[str, Any]] | None = None, score: bool = False) -> list[list[Completion]]:
        """n completions of each prompt (evaluation: ``sampling`` as ``SamplingParams``' fields,
        top-p/top-k allowed, no logprobs kept), as ``gdpo_ray.eval.suite.Completion``s, once the
        pushes that have arrived are loaded (streaming: beside the groups in flight). A prompt
        over ``max_prompt_tokens`` is not generated: n empty completions with the reason
        "prompt_too_long". With a tool environment, each completion is a multi-turn rollout (its
        instance reset with the prompt and the prompt's ``rows`` entry): its conversation after
        the prompt, its turns and tool calls. ``score``: each completion scored with this actor's
        rewards as training scores a rollout (the environments' columns and the rewards that
        read them included; ``rows``: the dataset columns the rewards take)."""
        await self.settled()
        sampling = SamplingParams(**dict(sampling))
        rows = [dict(r) for r in rows] if rows is not None else [{} for _ in prompts]
        ids = [self.tokenize(p) for p in prompts]
        fits = [i for i, t in enumerate(ids) if len(t) <= self.max_prompt_tokens]
        rollouts = [Rollout(k, {**rows[i], "prompt": prompts[i]}, prompts[i], None if self.tools else ids[i])
                    for k, i in enumerate(i for i in fits for _ in range(n))]
        try:
            async with self.sampler.exclusive():
                await self._loop(self.sampler.round(len(rollouts)), sampling, logprobs=False).run(rollouts)
            return await asyncio.get_running_loop().run_in_executor(
                self._scorer, self._completions, n, len(prompts), fits, rollouts, score)
        finally:
            if self.tools is not None:
                self.tools.release([r.trajectory for r in rollouts])

    def _completions(self, n: int, count: int, fits: Sequence[int], rollouts: Sequence[Rollout],
                     score: bool) -> list[list[Completion]]:
        """``complete``'s results: ``rollouts`` holds n per prompt of ``fits``, in order; ``score``:
        scored with the rewards (their rows' columns)."""
        scored = None
        if score and rollouts:
            if self.rewards is None:
                raise ValueError("complete(score=True) on a rollout actor without rewards")
            names = [name for name in rollouts[0].row if name != "prompt"]
            columns = {name: [r.row.get(name) for r in rollouts] for name in names}
            scored = self._scored(rollouts, columns, self.version)
        out = [[Completion("", 0, "prompt_too_long")] * n for _ in range(count)]
        for k, i in enumerate(fits):
            out[i] = [self._completion(j, rollouts[j].trajectory, scored) for j in range(k * n, (k + 1) * n)]
        return out

    def _completion(self, j: int, t: Any, scored: Any) -> Completion:
        turns = {}
        if self.tools is not None:
            text, messages = completion_text(t.messages), t.messages
            turns = dict(turns=t.turns, tool_calls=t.tool_calls, tool_errors=t.tool_errors)
        else:
            text, messages = t.messages[0]["content"], None
        if scored is not None:
            names = self.rewards.names
            turns |= dict(rewards={name: float(v) for name, v in zip(names, scored.values[j])},
                          reward_errors={name: e for name, e in zip(names, scored.errors[j]) if e})
        return Completion(text, len(t.tokens), t.finish_reason, messages, **turns)

    def tokenize(self, prompt: str | list, tools: list[dict] | None = None) -> list[int]:
        """The prompt's token ids (chat template with ``tools``, by default the environment's,
        shown as ``gdpo_ray.environments.tool_prompt.render_prompt`` shows them)."""
        if isinstance(prompt, list) or self.chat_template:
            if tools is None and self.tools is not None:
                tools = self.tools.schemas
            text = render_prompt(self.tokenizer, prompt, self.system_prompt, tools,
                                 self.tools is not None and self.tools.in_system)
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

    # -- scoring ---------------------------------------------------------------------------

    def score(self, groups: Sequence[tuple[Prompt, Sequence[Rollout]]], version: int,
              filtered: list[tuple[str, str]], start: float, generated: float) -> tuple[CallMeta, pa.RecordBatch]:
        """Scores the G rollouts of each group and builds the groups: -> (metadata, one record
        batch). A rollout whose tokens carry versions (streaming) gives each token's policy
        version; a group's ``policy_version`` is the oldest of its tokens. Multi-turn rollouts
        keep each rollout's prompt (an environment's reset text may differ) and turns."""
        flat = [r for _, rollouts in groups for r in rollouts]
        columns = {name: [p.columns[name] for p, rollouts in groups for _ in rollouts] for name in groups[0][0].columns}
        scored = self._scored(flat, columns, version)
        out, g = [], self.group_size
        for i, (p, rollouts) in enumerate(groups):
            rows, group = slice(i * g, (i + 1) * g), [r.trajectory for r in rollouts]
            # per-token versions where the engine knows them (a batch engine's: all `version`)
            versions = [t.versions if _has_versions(t) else None for t in group]
            known = [v for v in versions if v is not None and len(v)]
            oldest = [int(min(v)) for v in known] + [version] * any(
                v is None and len(t.tokens) for v, t in zip(versions, group))
            out.append(GroupData(
                prompt_id=p.prompt_id, group_id=p.group_id, prompt_token_ids=rollouts[0].prompt_ids,
                response_token_ids=[t.tokens for t in group], response_logprobs=[t.logprobs for t in group],
                finish_reasons=[t.finish_reason for t in group],
                policy_version=min(oldest, default=version),  # of its oldest token
                response_versions=None if not known else [
                    v if v is not None else np.full(len(t.tokens), version, np.int32) for v, t in zip(versions, group)],
                rewards=scored.values[rows], reward_errors=scored.errors[rows], task_columns=p.columns,
                turns=None if self.tools is None else self.tools.turns(group, [r.prompt_ids for r in rollouts]),
            ))
        if self.tools is not None:  # their rewards are read: the instances serve later rollouts
            self.tools.release([r.trajectory for r in flat])
        batch = build_groups(out, self.rewards.names, self.sampling.metadata())
        timing = CallTiming(generated - start, time.perf_counter() - generated, time.time() + generated - time.perf_counter())
        meta = CallMeta(groups=describe_groups(batch), filtered=filtered,
                        tokens=sum(len(r.trajectory.tokens) for r in flat), timing=timing,
                        judge=self.judging.take_stats() if self.judging is not None else None)
        return meta, batch

    def _scored(self, rollouts: Sequence[Rollout], columns: Mapping[str, list], version: int) -> Any:
        """The K rewards of ``rollouts`` given the dataset ``columns`` (one value per rollout): a
        ``RewardPool`` ``ScoreResult``. Completions as TRL passes them: a conversational row's
        prompt is its messages, its completion one assistant message (multi-turn: the assistant
        and tool messages after the prompt); the environments' columns and the rewards that
        read their instances are scored here, where the instances live."""
        flat = [r.trajectory for r in rollouts]
        prompts_in = [r.prompt for r in rollouts]
        columns = {**columns, "response_length": [len(t.tokens) for t in flat]}
        completions = [t.messages if self.tools is not None or not isinstance(p, str) else t.messages[0]["content"]
                       for t, p in zip(flat, prompts_in)]
        ids_out, state = [list(t.tokens) for t in flat], TrainerState(global_step=version)
        given, judged = None, None
        if self.judging is not None:  # asked now, taken once the reward workers are done
            rows = [{name: values[i] for name, values in columns.items()} for i in range(len(flat))]
            judged = self.judging.collector(self.judging.submit(prompts_in, completions, rows), len(flat))
        if self.tools is not None:  # the environments' columns, and the rewards that read them
            given = self.tools.rewards(flat, self.rewards.environment_columns)
            rows = [{**{name: [values[i]] for name, values in columns.items()}, "prompts": [prompts_in[i]],
                     "completions": [completions[i]], "completion_ids": [ids_out[i]], "trainer_state": state}
                    for i in range(len(flat))]
            limits = {name: self.rewards.timeouts[self.rewards.names.index(name)] for name in self.rewards.local}
            given |= self.tools.read(flat, rows, limits)
        return self.rewards.score(prompts_in, completions, columns, completion_ids=ids_out,
                                  trainer_state=state, given=given, judged=judged)

    async def shutdown(self) -> None:
        """Cancels the groups in flight, lets a push in progress finish (no later one starts),
        then stops the reward workers, the environments and the engine."""
        self._closed = True
        for _, task in list(self._open.values()):
            task.cancel()
        async with self._push:
            self._scorer.shutdown(wait=False, cancel_futures=True)
            if self.rewards is not None:
                self.rewards.close()
            if self.judging is not None:
                self.judging.close()
            if self.tools is not None:
                self.tools.close()
            self.engine.shutdown()


def _has_versions(t: Any) -> bool:
    """A trajectory a streaming engine sampled: the policy version of every token is known."""
    return len(t.versions) == len(t.tokens) > 0
