"""Rollout actors: prompts in, complete scored groups out.

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
The driver's side of the actors is ``actors.rollout_group.RolloutGroup``.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from actors.engines import SamplingParams, VersionedSample, make_engine
from actors.prompts import Prompt
from actors.tool_loop import ToolEnvironment, with_observation
from gdpo_ray.batch import CallMeta, CallTiming, GroupData, build_groups
from gdpo_ray.config import default
from gdpo_ray.eval.suite import Completion
from gdpo_ray.environments.tool_prompt import render_prompt
from gdpo_ray.groups import describe_groups
from gdpo_ray.rewards import TrainerState, completion_text


class PromptsExhausted(RuntimeError):
    """Every prompt of an epoch was filtered before generation: the run cannot go on."""


class RolloutActor:
    """Generates and scores complete groups (run as a Ray actor by ``RolloutGroup``).

    Args:
        model_path: a local HF model directory (or anything the engine loads).
        rewards: the K reward declarations (see ``gdpo_ray.rewards.RewardSpec``).
        group_size: G, completions per prompt (>= 2).
        engine: "hf" (CPU default), "vllm", or a "package.module:Class" of the ``mode``'s
            protocol (``actors.engines.BatchEngine`` here); ``engine_kwargs`` go to it.
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
        lora: ``llm.lora``'s PEFT settings (the engine serves the base model plus the pushed
            adapter), or None (full weights).
        environment: ``data.tool_environment``, 'module:Class': multi-turn rollouts with its tools
            (``actors.tool_loop``), at most ``max_turns`` model turns, each tool call within
            ``tool_timeout`` seconds; None: single-turn. ``tools_in_system_prompt``: where the
            model is shown the tools (``gdpo_ray.environments.tool_prompt``).
    """

    mode = "batched"  # generation.mode: which of an engine's classes, and its protocol

    def __init__(self, model_path: str, rewards: Sequence[Mapping[str, Any]], group_size: int,
                 engine: str = default("engine"), engine_kwargs: Mapping[str, Any] | None = None,
                 sampling: Mapping[str, Any] | None = None, chat_template: bool = default("chat_template"),
                 max_prompt_tokens: int = default("max_prompt_tokens"),
                 reward_workers: int | None = default("reward_workers"), num_threads: int = default("num_threads"),
                 seed: int = 0, model_files: Any = None, lora: Mapping[str, Any] | None = None,
                 environment: str | None = None, max_turns: int = default("max_turns"),
                 tool_timeout: float = default("tool_timeout"), system_prompt: str | None = None,
                 tools_in_system_prompt: str = default("tools_in_system_prompt")) -> None:
        import torch

        from actors.reward import RewardPool
        from gdpo_ray.batch import arrow_without_pandas
        from gdpo_ray.model_files import local_dir

        arrow_without_pandas()
        torch.set_num_threads(num_threads)
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2; got {group_size}")
        self.group_size, self.chat_template, self.system_prompt = group_size, chat_template, system_prompt
        self.max_prompt_tokens = max_prompt_tokens
        self.sampling = SamplingParams(**dict(sampling or {}))
        model_path = local_dir(model_path, model_files)  # a driver-only directory, shipped
        extra = {"lora": dict(lora)} if lora else {}  # an engine without LoRA need not take it
        self.engine = make_engine(engine, model_path, mode=self.mode, seed=seed,
                                  **dict(engine_kwargs or {}), **extra)
        self.tokenizer = self.engine.tokenizer
        self.tools = None if environment is None else ToolEnvironment(environment, self.tokenizer, max_turns,
                                                                     tool_timeout, tools_in_system_prompt)
        # no rewards: an actor that only completes prompts (evaluation: ``complete``)
        self.rewards = RewardPool(rewards, num_workers=reward_workers or num_threads) if rewards else None
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

    def set_weights(self, version: int, weights: Any) -> dict:
        """Loads new weights and becomes ``version``: a name -> tensor dict, or a list of
        ObjectRefs of weight buckets (``gdpo_ray.weights.buckets``), read one at a time,
        zero-copy. Returns the attestation (``attest``)."""
        import ray

        from gdpo_ray.weights.buckets import unpack_bucket
        from gdpo_ray.weights.digest import recorded

        sent: dict[str, str] = {}
        if isinstance(weights, Mapping):
            self.engine.load_weights(recorded(weights.items(), sent))
        else:  # one pass over all buckets, fetched lazily (vLLM reloads layer by layer)
            self.engine.load_weights(recorded(itertools.chain.from_iterable(
                unpack_bucket(ray.get(ref)) for ref in weights), sent))
        self.version = int(version)
        return self.attest(sent)

    def attest(self, sent: Mapping[str, str]) -> dict:
        """``{"version", "digests"}``: the version now held and the digests of what the engine
        holds of every tensor just loaded (``sent``: name -> dtype), read back from the engine,
        for the driver to compare with the sender's (``actors.attestation``); an engine that
        cannot read its weights back (NotImplementedError) is reported ``unverified``."""
        try:
            return {"version": self.version, "digests": self.engine.weight_digests(sent)}
        except NotImplementedError as err:  # an engine that cannot read back what it holds
            return {"version": self.version, "digests": None, "unverified": str(err)}

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

    def receive_weights(self, version: int) -> dict:
        """Loads one broadcast version into the engine and becomes ``version``; returns the
        attestation (``attest``)."""
        sent = self.channel.receive_into(self.engine, version)
        self.version = int(version)
        return self.attest(sent)

    def complete(self, prompts: Sequence[str | list], n: int, sampling: Mapping[str, Any],
                 rows: Sequence[Mapping[str, Any]] | None = None, score: bool = False) -> list[list[Completion]]:
        """n completions of each prompt (evaluation: ``sampling`` as ``SamplingParams``' fields,
        top-p/top-k allowed, no logprobs kept), as ``gdpo_ray.eval.suite.Completion``s. A prompt
        over ``max_prompt_tokens`` is not generated: n empty completions with the reason
        "prompt_too_long". With a tool environment, each completion is a multi-turn rollout (its
        instance reset with the prompt and the prompt's ``rows`` entry): its conversation after
        the prompt, its turns and tool calls. ``score``: each completion scored with this actor's
        rewards as training scores a rollout (the environments' columns and the rewards that
        read them included; ``rows``: the dataset columns the rewards take)."""
        sampling = SamplingParams(**dict(sampling))
        rows = [dict(r) for r in rows] if rows is not None else [{} for _ in prompts]
        ids, fits = self._eval_prompts(prompts)
        chosen = [i for i in fits for _ in range(n)]
        if self.tools is not None:
            started = self.tools.start([{**rows[i], "prompt": prompts[i]} for i in chosen])
            trajectories = [t for t, _ in started]
            rollout_prompts = [with_observation(prompts[i], o) for i, (_, o) in zip(chosen, started)]
            try:
                self.tools.run(self.engine, [self.tokenize(q, self.tools.schemas_of(t))
                                             for q, t in zip(rollout_prompts, trajectories)], trajectories, sampling)
                return self._completions(n, len(prompts), fits, trajectories, rollout_prompts,
                                         [rows[i] for i in chosen] if score else None)
            finally:
                self.tools.release(trajectories)
        samples = self.engine.generate([ids[i] for i in fits], n, sampling, logprobs=False) if fits else []
        return self._completions(n, len(prompts), fits, [s for group in samples for s in group],
                                 [prompts[i] for i in chosen], [rows[i] for i in chosen] if score else None)

    def _completions(self, n: int, count: int, fits: Sequence[int], flat: Sequence[Any],
                     rollout_prompts: Sequence[Any],
                     rows: Sequence[Mapping[str, Any]] | None) -> list[list[Completion]]:
        """``complete``'s results: ``flat`` holds n samples (or trajectories) per prompt of
        ``fits``, in order; ``rows`` (per sample): score them with the rewards."""
        scored = None
        if rows is not None and flat:
            if self.rewards is None:
                raise ValueError("complete(score=True) on a rollout actor without rewards")
            columns = {name: [r.get(name) for r in rows] for name in rows[0]}
            scored = self._scored(rollout_prompts, flat, columns, self.version)
        out = [[Completion("", 0, "prompt_too_long")] * n for _ in range(count)]
        for k, i in enumerate(fits):
            out[i] = [self._completion(j, flat[j], scored) for j in range(k * n, (k + 1) * n)]
        return out

    def _completion(self, j: int, sample: Any, scored: Any) -> Completion:
        turns = {}
        if self.tools is not None:
            text, messages = completion_text(sample.messages), sample.messages
            turns = dict(turns=sample.turns, tool_calls=sample.tool_calls, tool_errors=sample.tool_errors)
        else:
            text, messages = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True), None
        if scored is not None:
            names = self.rewards.names
            turns |= dict(rewards={name: float(v) for name, v in zip(names, scored.values[j])},
                          reward_errors={name: e for name, e in zip(names, scored.errors[j]) if e})
        return Completion(text, len(sample.token_ids), sample.finish_reason, messages, **turns)

    def _eval_prompts(self, prompts: Sequence[str | list]) -> tuple[list[list[int]], list[int]]:
        """(every prompt's token ids, the indices of those within max_prompt_tokens)."""
        ids = [self.tokenize(p) for p in prompts]
        return ids, [i for i, t in enumerate(ids) if len(t) <= self.max_prompt_tokens]

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

    def generate(self, prompts: Sequence[Prompt]) -> tuple[CallMeta, pa.RecordBatch | None]:
        """-> (metadata, one record batch of the complete groups)."""
        start = time.perf_counter()
        version = self.version
        kept, ids, filtered = self.split(prompts)
        if not kept:
            return CallMeta(groups=[], filtered=filtered), None
        if self.tools is not None:
            return self._generate_turns(kept, version, filtered, start)
        samples = self.engine.generate(ids, self.group_size, self.sampling)
        return self.score(kept, ids, samples, version, filtered, start, time.perf_counter())

    def _generate_turns(self, kept: Sequence[Prompt], version: int, filtered: list[tuple[str, str]],
                        start: float) -> tuple[CallMeta, pa.RecordBatch]:
        """Multi-turn rollouts (``actors.tool_loop``): an environment instance per rollout, reset
        with its row (the whole row, ``prompt`` included, as TRL calls it), the text it returns
        appended to the rollout's prompt."""
        g = self.group_size
        rows = [p for p in kept for _ in range(g)]
        started = self.tools.start([{"prompt": p.prompt, **p.columns} for p in rows])
        prompts = [with_observation(p.prompt, observation) for p, (_, observation) in zip(rows, started)]
        trajectories = [t for t, _ in started]
        ids = [self.tokenize(prompt, self.tools.schemas_of(t)) for prompt, t in zip(prompts, trajectories)]
        self.tools.run(self.engine, ids, trajectories, self.sampling)
        samples = [trajectories[i * g:(i + 1) * g] for i in range(len(kept))]
        try:
            return self.score(kept, ids, samples, version, filtered, start, time.perf_counter(), prompts)
        finally:
            self.tools.release(trajectories)  # their rewards are read: the instances serve later rollouts

    def stream(self, prompts: Sequence[Prompt]) -> Iterator[Any]:
        """The call the driver makes (``num_returns="streaming"``): pairs of (record batch or
        None, its metadata), the batch first, so that metadata that arrives vouches for its batch.
        Here one pair for the whole call."""
        meta, batch = self.generate(prompts)
        yield batch
        yield meta

    def score(self, kept: Sequence[Prompt], ids: Sequence[list[int]], samples: Sequence[Sequence[Any]],
              version: int, filtered: list[tuple[str, str]], start: float, generated: float,
              rollout_prompts: Sequence[Any] | None = None) -> tuple[CallMeta, pa.RecordBatch]:
        """Scores the G samples of each prompt of ``kept`` and builds their groups: -> (metadata,
        one record batch). A sample with ``versions`` (streaming) gives each token's policy
        version; a group's ``policy_version`` is the oldest of its tokens. Multi-turn rollouts
        (``samples`` of ``actors.tool_loop.Trajectory``): ``rollout_prompts`` and ``ids`` are per
        rollout (an environment's reset text may differ), the completions their conversations."""
        flat = [s for group in samples for s in group]
        g = self.group_size
        columns = {name: [value for p in kept for value in [p.columns[name]] * g]
                   for name in kept[0].columns}
        prompts_in = list(rollout_prompts) if rollout_prompts else [p.prompt for p in kept for _ in range(g)]
        scored = self._scored(prompts_in, flat, columns, version)
        groups = []
        for i, (p, group) in enumerate(zip(kept, samples)):
            rows = slice(i * g, (i + 1) * g)
            # per-token versions where the engine knows them (a batch engine's samples: all `version`)
            versions = [s.versions if _has_versions(s) else None for s in group]
            known = [v for v in versions if v is not None and len(v)]
            oldest = [int(min(v)) for v in known] + [version] * any(
                v is None and len(s.token_ids) for v, s in zip(versions, group))
            turns = None if self.tools is None else self.tools.turns(group, ids[rows])
            groups.append(GroupData(
                prompt_id=p.prompt_id, group_id=p.group_id, prompt_token_ids=ids[i * g] if turns else ids[i],
                response_token_ids=[s.token_ids for s in group],
                response_logprobs=[s.logprobs for s in group],
                finish_reasons=[s.finish_reason for s in group],
                policy_version=min(oldest, default=version),  # of its oldest token
                response_versions=None if not known else [
                    v if v is not None else np.full(len(s.token_ids), version, np.int32) for v, s in zip(versions, group)],
                rewards=scored.values[rows], reward_errors=scored.errors[rows],
                task_columns=p.columns, turns=turns,
            ))
        batch = build_groups(groups, self.rewards.names, self.sampling.metadata())
        timing = CallTiming(generate_s=generated - start, score_s=time.perf_counter() - generated)
        meta = CallMeta(groups=describe_groups(batch),
                        filtered=filtered, tokens=sum(len(s.token_ids) for s in flat), timing=timing)
        return meta, batch

    def _scored(self, prompts_in: Sequence[Any], flat: Sequence[Any], columns: Mapping[str, list],
                version: int) -> Any:
        """The K rewards of the samples ``flat`` (one per entry of ``prompts_in``, the prompt as
        the rollout saw it), given the dataset ``columns`` (one value per sample): a
        ``RewardPool`` ``ScoreResult``. Completions as TRL passes them: a conversational row's
        prompt is its messages, its completion one assistant message (multi-turn: the assistant
        and tool messages after the prompt); the environments' columns and the rewards that
        read their instances are scored here, where the instances live."""
        columns = {**columns, "response_length": [len(s.token_ids) for s in flat]}
        if self.tools is not None:
            completions = [t.messages for t in flat]
        else:
            texts = self.tokenizer.batch_decode([s.token_ids for s in flat], skip_special_tokens=True)
            completions = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                           for t, p in zip(texts, prompts_in)]
        ids_out, state = [list(s.token_ids) for s in flat], TrainerState(global_step=version)
        given = None
        if self.tools is not None:  # the environments' columns, and the rewards that read them
            instances = [t.session.instance if t.session else None for t in flat]
            given = self.tools.rewards(flat, self.rewards.environment_columns)
            given |= self.rewards.score_local(instances, prompts_in, completions, columns, ids_out, state)
        return self.rewards.score(prompts_in, completions, columns, completion_ids=ids_out,
                                  trainer_state=state, given=given)

    def shutdown(self) -> None:
        if self.rewards is not None:
            self.rewards.close()
        if self.tools is not None:
            self.tools.close()
        self.engine.shutdown()


def _has_versions(sample: Any) -> bool:
    """A streaming engine's sample (``VersionedSample``), or a multi-turn trajectory of one: the
    policy version of every token is known."""
    return isinstance(sample, VersionedSample) or len(getattr(sample, "versions", ())) == len(sample.token_ids) > 0
