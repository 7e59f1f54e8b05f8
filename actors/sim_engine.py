"""The simulated engine (``generation.engine: simulated``): no model, no torch; token ids at the
rates of a timing model (``gdpo_ray.simulation``), so that many rollout actors of a large run fit
on one machine while everything around them (the actors, rewards, Arrow records, the buffer,
admission, pushes and their attestation, the driver) is the real system.

- ``SimulatedEngine`` (``generation.mode: batched``, an ``actors.engines.BatchEngine``): a call
  sleeps the seconds ``TimingModel.schedule`` gives its requests (continuous batching within the
  call), then returns them.
- ``SimulatedStreamingEngine`` (``streaming``, a ``StreamingEngine``): every request joins one
  continuous batch that advances in wall time (``_Batch``); a push pauses it for the model's load
  time and labels every later token with its version.

A response is ``ResponseLengths`` long (at most ``max_tokens``: then "length"; else it ends
with the EOS token: "stop"; stop strings are not looked for), its other tokens drawn uniformly
from the tokenizer's ordinary ids, each logprob the negative of an exponential draw (the
columns' shapes and signs real, their values not a distribution's). The tokenizer is the model
directory's (a fast tokenizer, loaded without torch): prompts, chat templates and the rewards'
texts are real. Pushed weights are held as the numpy arrays received and digested as held:
pushes are attested as any engine's. ``time_scale`` multiplies every modelled second.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from typing import Any, Iterable, Mapping

import numpy as np

from actors.engines import EngineTraits, Sample, SamplingParams, VersionedSample
from gdpo_ray.simulation import ResponseLengths, timing_model

TRAITS = EngineTraits(exact_dtype=True, default_dtype="float32", digests_by_name=True, uses_torch=False,
                      simulated=True)


class _Simulated:
    """What both modes share: the tokenizer, the draws, the held weights."""

    weight_transfer = False
    device = "cpu"
    traits = TRAITS

    @classmethod
    def check_sampling(cls, sampling: SamplingParams) -> None:
        pass  # any sampling: nothing is computed from it but max_tokens

    def __init__(self, model_path: str, seed: int = 0, timing: Any = None, response_lengths: Any = None,
                 time_scale: float = 1.0, lora: Any = None) -> None:
        """``lora``: the run's ``llm.lora`` (its adapter's tensors are held as any push's)."""
        from transformers import PreTrainedTokenizerFast  # (imports no torch)

        if not (isinstance(time_scale, (int, float)) and time_scale > 0):
            raise ValueError(f"simulation.time_scale must be a positive number; got {time_scale!r}")
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path, padding_side="left")
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {model_path} has no EOS token: the simulated engine ends "
                             "its responses with it")
        self.timing, self.lengths = timing_model(timing), ResponseLengths.of(response_lengths)
        self.time_scale = float(time_scale)
        self.rng = np.random.default_rng(seed)
        special = set(self.tokenizer.all_special_ids)
        self.ordinary = np.array([i for i in range(len(self.tokenizer)) if i not in special], dtype=np.int64)
        self.weights: dict[str, np.ndarray] = {}

    def _sample(self, length: int, max_tokens: int, logprobs: bool) -> tuple[list[int], list[float], str]:
        """A response of ``length`` tokens (the last the EOS token unless it reached ``max_tokens``)."""
        tokens = self.rng.choice(self.ordinary, size=length)
        reason = "length" if length >= max_tokens else "stop"
        if reason == "stop":
            tokens[-1] = self.tokenizer.eos_token_id
        lps = (-self.rng.exponential(1.0, size=length)).tolist() if logprobs else []
        return tokens.tolist(), lps, reason

    def _hold(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self.weights.update((name, np.asarray(t)) for name, t in named_tensors)

    def _digests(self, sent: Mapping[str, str]) -> dict[str, int]:
        from gdpo_ray.weights.digest import digest

        return {name: digest(self.weights[name]) for name, dtype in sent.items()
                if name in self.weights and str(self.weights[name].dtype) == dtype}

    def shutdown(self) -> None:
        pass  # nothing outlives the actor


class SimulatedEngine(_Simulated):
    """The batched simulated engine (see the module docstring)."""

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 logprobs: bool = True) -> list[list[Sample]]:
        lengths = self.lengths.draw(self.rng, len(prompt_token_ids) * n, sampling.max_tokens)
        prompts = [len(p) for p in prompt_token_ids for _ in range(n)]
        shared = [j > 0 for _ in prompt_token_ids for j in range(n)]  # n samples, one prefill
        seconds, _ = self.timing.schedule(prompts, lengths.tolist(), shared)
        time.sleep(seconds * self.time_scale)
        samples = [Sample(*self._sample(int(length), sampling.max_tokens, logprobs)) for length in lengths]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompt_token_ids))]

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self._hold(named_tensors)
        time.sleep(self.timing.load_s() * self.time_scale)

    def weight_digests(self, sent: Mapping[str, str]) -> dict[str, int]:
        return self._digests(sent)

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass


class _Request:
    def __init__(self, prompt: list[int], length: int, future: asyncio.Future) -> None:
        self.prompt, self.prompt_key = len(prompt), hash(tuple(prompt))
        self.length, self.future = length, future
        self.done = 0  # tokens decoded
        self.versions: list[tuple[int, int]] = []  # (first token, version) from its admission on


class _Batch:
    """One continuous batch in wall time: at most ``max_num_seqs`` requests decode, one token
    each per ``decode_step_s(batch)``; an admission stalls the steps for its prefill (not again
    for a prompt prefilled lately: the prefix cache), a push for the load. Steps count from
    ``mark``; every event (an arrival, a cancel, a push, the next finish's timer) first counts
    the whole steps taken since (``advance``)."""

    def __init__(self, timing: Any, scale: float) -> None:
        self.timing, self.scale = timing, scale
        self.running: list[_Request] = []
        self.waiting: collections.deque[_Request] = collections.deque()
        self.mark = time.monotonic()
        self.version = 0
        self.prefilled: collections.OrderedDict = collections.OrderedDict()  # recent prompts (prefix cache)
        self.timer: asyncio.TimerHandle | None = None

    def step_s(self) -> float:
        return self.timing.decode_step_s(len(self.running)) * self.scale

    def advance(self) -> None:
        now = time.monotonic()
        if not self.running:
            self.mark = max(self.mark, now)
            return
        step = self.step_s()
        steps = min(int((now - self.mark) / step) if now > self.mark else 0,
                    min(r.length - r.done for r in self.running))
        for r in self.running:
            r.done += steps
        self.mark += steps * step

    def stall(self, seconds: float) -> None:
        self.mark = max(self.mark, time.monotonic()) + seconds * self.scale

    def settle(self) -> None:
        """After ``advance``: finished requests out, waiting ones in, the timer set again."""
        for r in [r for r in self.running if r.done >= r.length]:
            self.running.remove(r)
            if not r.future.done():
                r.future.set_result(None)
        while self.waiting and len(self.running) < self.timing.max_num_seqs:
            r = self.waiting.popleft()
            if r.future.done():  # cancelled while it waited
                continue
            key = r.prompt_key
            if key in self.prefilled:  # its prefix cached: no prefill
                self.prefilled.move_to_end(key)
            else:
                self.stall(self.timing.prefill_s(r.prompt))
                self.prefilled[key] = None
                if len(self.prefilled) > 4096:
                    self.prefilled.popitem(last=False)
            r.versions.append((0, self.version))
            self.running.append(r)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.running:
            due = self.mark + min(r.length - r.done for r in self.running) * self.step_s()
            self.timer = asyncio.get_running_loop().call_at(_loop_time(due), self.tick)

    def tick(self) -> None:
        self.timer = None
        self.advance()
        self.settle()

    def push(self, version: int, pause_s: float) -> None:
        self.advance()
        self.stall(pause_s)
        self.version = version
        for r in self.running:
            r.versions.append((r.done, version))
        self.settle()


def _loop_time(monotonic: float) -> float:
    """A ``time.monotonic()`` instant on the running loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic - time.monotonic())


class SimulatedStreamingEngine(_Simulated):
    """The streaming simulated engine (see the module docstring)."""

    def __init__(self, model_path: str, seed: int = 0, timing: Any = None, response_lengths: Any = None,
                 time_scale: float = 1.0, lora: Any = None, max_num_seqs: int | None = None) -> None:
        super().__init__(model_path, seed, timing, response_lengths, time_scale, lora)
        if max_num_seqs is not None:
            import dataclasses

            self.timing = dataclasses.replace(self.timing, max_num_seqs=max_num_seqs)
        self.max_num_seqs = self.timing.max_num_seqs
        self.pause_s: list[float] = []
        self._batch = _Batch(self.timing, self.time_scale)
        self._paths = itertools.count()
        self._written: dict[str, dict[str, np.ndarray]] = {}

    @property
    def active(self) -> int:
        return len(self._batch.running) + len(self._batch.waiting)

    async def sample(self, prompt_token_ids: list[int], sampling: SamplingParams,
                     logprobs: bool = True) -> VersionedSample:
        length = int(self.lengths.draw(self.rng, 1, sampling.max_tokens)[0])
        request = _Request(prompt_token_ids, length, asyncio.get_running_loop().create_future())
        batch = self._batch
        batch.advance()
        batch.waiting.append(request)
        batch.settle()
        try:
            await request.future
        except asyncio.CancelledError:  # the actor aborted it: out of the batch
            batch.advance()
            if request in batch.running:
                batch.running.remove(request)
            batch.settle()
            raise
        tokens, lps, reason = self._sample(length, sampling.max_tokens, logprobs)
        versions = np.empty(length, dtype=np.int64)
        for (start, version), (end, _) in zip(request.versions, request.versions[1:] + [(length, 0)]):
            versions[start:end] = version
        return VersionedSample(tokens, lps, reason, versions.tolist())

    def write_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> str:
        path = f"simulated-{next(self._paths)}"
        self._written[path] = {name: np.asarray(t) for name, t in named_tensors}
        return path

    async def push(self, path: str, version: int) -> float:
        pause = self.timing.load_s() * self.time_scale
        self.weights.update(self._written.pop(path))
        self._batch.push(version, self.timing.load_s())
        await asyncio.sleep(pause)
        self.pause_s.append(pause)
        return pause

    async def weight_digests(self, sent: Mapping[str, str]) -> dict[str, int]:
        return self._digests(sent)

    async def sleep(self) -> None:
        pass

    async def wake_up(self) -> None:
        pass
