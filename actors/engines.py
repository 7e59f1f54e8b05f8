"""The engine contracts: what the rollout actors call of a generation engine, and the registry.

Two kinds of engine, one ``Protocol`` each, holding exactly what the actors call:

- ``BatchEngine`` (``generation.mode='batched'``, ``actors.samplers.BatchedSampler``): plain
  methods, one batch of prompts per call;
- ``StreamingEngine`` (``generation.mode='streaming'``, ``actors.samplers.StreamingSampler``):
  coroutines on the actor's event loop, one request per sample, new weights pushed in flight.

An engine whose ``weight_transfer`` is True takes a learner's NCCL broadcast itself (vLLM's
weight transfer) and so is also a ``WeightReceiver`` (batch) or ``AsyncWeightReceiver``
(streaming): the receiving side's contracts, written in ``gdpo_ray.weights.channels``, which
calls them.

Every engine generates ``Sample``s: the response token ids (up to and including the stop
token), the log-probability of each sampled token under the distribution sampled from
(log_softmax(logits / temperature), renormalized over the tokens min-p/top-k/top-p kept, in
that order, where ``SamplingParams.truncated_logprobs`` is True, its default, else over the full
vocabulary: ``gdpo_ray.truncation``, which the learners apply the same way; an engine that cannot
record the one asked for refuses it in ``check_sampling``), and the finish reason. A streaming engine's are ``VersionedSample``s, which add the policy version that sampled
each token.

``ENGINES`` names the built-in engines' classes per mode (``hf``: batched; ``vllm`` and
``simulated``, a timing model's stand-in for a large run's engines: batched and streaming);
``engine_class(kind, mode)`` resolves a name or any ``package.module:Class`` and checks the
class against the mode's protocol when the config is validated, before any actor starts. This module imports nothing else of ``actors``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterable, Mapping, Protocol

from gdpo_ray.config import check_value, default
from gdpo_ray.registry import import_path
from gdpo_ray.truncation import Truncation
from gdpo_ray.weights.channels import AsyncWeightReceiver, WeightReceiver


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; defaults and rules are those of the generation fields of the same
    names (``gdpo_ray.config``)."""

    temperature: float = default("temperature")
    top_p: float = default("top_p")
    top_k: int = default("top_k")  # 0 = off
    max_tokens: int = default("max_tokens")  # new tokens per response
    stop: tuple[str, ...] = ()  # extra stop strings (the EOS token always stops)
    min_p: float = default("min_p")  # 0 = off
    truncated_logprobs: bool = default("truncated_logprobs")  # logprobs of the truncated distribution

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "top_k", "max_tokens", "min_p", "truncated_logprobs"):
            check_value(name, getattr(self, name), f"sampling {name}")

    @property
    def truncation(self) -> Truncation:
        return Truncation(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    def metadata(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "truncated_logprobs": self.truncated_logprobs}


@dataclasses.dataclass
class Sample:
    """One completion. ``finish_reason``: "stop" (an EOS token or a stop string, included in
    ``token_ids``), "length" (``max_tokens`` reached) or "abort" (the engine ended the request
    for any other reason, e.g. vLLM aborted it)."""

    token_ids: list[int]
    logprobs: list[float]  # per token (empty where the caller asked for none)
    finish_reason: str  # "stop" | "length" | "abort"


@dataclasses.dataclass
class VersionedSample(Sample):
    """A streaming engine's sample: its weights may change while it decodes."""

    versions: list[int] = dataclasses.field(default_factory=list)  # per token: the policy that sampled it


@dataclasses.dataclass(frozen=True)
class EngineTraits:
    """What the rest of the system asks about an engine, declared by its class as ``traits``
    (a class without it has these defaults), so that no module outside ``actors`` compares an
    engine's name.

    - ``exact_dtype``: the engine computes with the ``dtype`` it is built with (its
      ``engine_kwargs``; ``default_dtype`` where none is given) and holds a push of that dtype
      exactly; False: it may hold a float32 push in a lower precision (vLLM's ``auto``), so the
      attestation also accepts the push rounded to ``gdpo_ray.weights.digest.VARIANTS``.
    - ``adapter_slots``: the keyword that sets how many LoRA adapters it serves at once (a
      streaming actor keeps ``max_staleness + 1`` versions live), or None.
    - ``model_logits``: it holds its model as a torch module (``engine.model``, on
      ``engine.device``) whose forward gives logits, which a judge's ``scores`` decoding reads
      (``actors.judge_pool``).
    - ``kv_reuse``: its ``generate`` takes ``keys=`` (per sample, the rollout it continues) and
      keeps each sample's KV for that rollout's next turn, and ``release(keys)`` forgets them
      (a batched call's turn loop passes them for multi-turn rollouts: ``actors.samplers.Round``).
    - ``digests_by_name``: its ``weight_digests`` gives each pushed name's digest alone (no
      fused keys), so the call may be split, and it only reads the weights, so it may run on a
      thread beside ``generate``: the batched sampler takes the large tensors' so
      (``actors.samplers.BatchedSampler.digests``). A subclass that overrides ``weight_digests``
      keeps both promises or sets it False.
    - ``shares_module``: it can be built on a torch module it is given (``model=``: a learner's,
      whose weights it then shares and never loads into: ``generation.engine_in_learner``).
    - ``uses_torch``: False: it computes nothing with torch, so its actor imports none (nor
      sets torch's threads) and hands it pushed tensors as numpy arrays (``simulated``).
    - ``simulated``: it takes the timing model's settings (``engine_settings``).
    """

    exact_dtype: bool = False
    default_dtype: str = "auto"
    adapter_slots: str | None = None
    model_logits: bool = False
    kv_reuse: bool = False
    digests_by_name: bool = False
    shares_module: bool = False
    uses_torch: bool = True
    simulated: bool = False


def traits_of(cls: Any) -> EngineTraits:
    return getattr(cls, "traits", None) or EngineTraits()


def generation_mode(kind: str, mode: str | None) -> str:
    """``generation.mode``, its default filled in: streaming for an engine of ``ENGINES`` with a
    continuous-batching class (vllm), batched otherwise (a ``package.module:Class`` included)."""
    return mode or ("streaming" if "streaming" in ENGINES.get(kind, {}) else "batched")


#: the settings of section ``simulation`` that a simulated engine is built with
SIMULATION_KWARGS = ("timing", "response_lengths", "time_scale")


def engine_settings(kind: str, mode: str | None, engine_kwargs: Mapping[str, Any],
                    simulation: Mapping[str, Any]) -> dict:
    """The keyword arguments engine ``kind`` is built with: ``generation.engine_kwargs``, under
    them, for an engine whose traits say ``simulated``, those of ``simulation`` it takes."""
    if traits_of(engine_class(kind, generation_mode(kind, mode))).simulated:
        return {k: simulation[k] for k in SIMULATION_KWARGS if k in simulation} | dict(engine_kwargs)
    return dict(engine_kwargs)


def digest_variants(kind: str, mode: str | None, engine_kwargs: Mapping[str, Any]) -> tuple[str, ...]:
    """The lower precisions rollout engines of ``kind`` may hold a float32 push in (the
    attestation's accepted roundings): none for an engine that computes with exactly the
    float32 it is built with, else every one of ``gdpo_ray.weights.digest.VARIANTS``."""
    from gdpo_ray.weights.digest import VARIANTS

    traits = traits_of(engine_class(kind, generation_mode(kind, mode)))
    dtype = str(engine_kwargs.get("dtype", traits.default_dtype)).removeprefix("torch.")
    return () if traits.exact_dtype and dtype == "float32" else VARIANTS


class BatchEngine(Protocol):
    """What the rollout actor (``generation.mode='batched'``) calls of its engine, synchronously.

    The actor builds it as ``Engine(model_path, seed=seed, **generation.engine_kwargs)``
    (``model_path`` a local Hugging Face model directory; with ``llm.lora`` also ``lora=``, the
    PEFT settings: it then serves the base model plus the pushed adapter, the base model alone
    before the first push) and calls one method at a time. New
    weights arrive through ``load_weights`` (the object store, and the gloo or NCCL bucket
    broadcast); with ``weight_transfer`` True the engine is a ``WeightReceiver`` too.
    """

    tokenizer: Any  # a Hugging Face tokenizer: chat template, encode, decode
    device: str  # "cpu" or "cuda[:i]": where its weights live (picks the broadcast's backend)
    weight_transfer: bool  # True: it takes vLLM's NCCL weight transfer (a WeightReceiver)

    @classmethod
    def check_sampling(cls, sampling: SamplingParams) -> None:
        """Raises ValueError for sampling it cannot do with exact logprobs (asked when the
        config is validated, naming the fix)."""

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 logprobs: bool = True) -> list[list[Sample]]:
        """n samples of each of P prompts (token ids, the chat template already applied): P
        lists of n ``Sample``s, in prompt order. ``logprobs=True`` (training): each sample's
        logprobs as the module docstring says, one per token. ``logprobs=False`` (evaluation):
        none needed, so any sampling is allowed (top-p/top-k included) and they may be empty."""

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """New weights: (checkpoint name, tensor) of every parameter (tied ones under each
        name), an iterable read once (buckets behind it are fetched as it is read, so hold no
        more than the tensor in hand). With ``llm.lora`` (the engine built with ``lora=``, the
        PEFT settings) only the adapter's tensors, under the names PEFT saves them with."""

    def weight_digests(self, sent: Mapping[str, str]) -> dict[str, int]:
        """What the engine holds now, for the attestation of a push: for each pushed tensor
        name (``sent``: name -> the dtype it was sent in) the digest
        (``gdpo_ray.weights.digest.digest_as``) of the tensor the engine actually computes with,
        read back from it, not the bytes it was given; tensors it holds fused into one (laid end
        to end) under their names joined by ``digest.FUSED`` in the order it holds them (the
        digest counts every element's position)."""

    def sleep(self) -> None:
        """Frees its accelerator memory while colocated learners update (a no-op where none)."""

    def wake_up(self) -> None:
        """Takes back what ``sleep`` freed, before the next call."""

    def shutdown(self) -> None:
        """Releases what outlives the actor (processes of its own); a no-op where nothing does."""


class StreamingEngine(Protocol):
    """What the rollout actor (``generation.mode='streaming'``) calls of its engine.
    Every method that touches the engine is a coroutine, run on the actor's one event loop, many
    at once (the engine batches every request in flight continuously).

    Built as a ``BatchEngine`` is. Policy versions: the actor's version is that of the last
    push; a ``push(path, version)`` (or, with ``weight_transfer`` True, an
    ``AsyncWeightReceiver.receive_broadcast``) lands while requests decode, and every token
    sampled after it is labelled ``version`` (``VersionedSample.versions``), its logprob that of
    the distribution it was sampled from.
    """

    tokenizer: Any  # a Hugging Face tokenizer: chat template, encode, decode
    device: str  # "cpu" or "cuda[:i]": where its weights live (picks the broadcast's backend)
    weight_transfer: bool  # True: it takes vLLM's NCCL weight transfer (an AsyncWeightReceiver)
    max_num_seqs: int  # sequences it decodes at once (the actor keeps that many requests + one group in it)
    active: int  # requests in it now (``engine_stats``)
    pause_s: list[float]  # per push, the seconds the engine was paused (``engine_stats``)

    @classmethod
    def check_sampling(cls, sampling: SamplingParams) -> None:
        """As ``BatchEngine.check_sampling``."""

    async def sample(self, prompt_token_ids: list[int], sampling: SamplingParams,
                     logprobs: bool = True) -> VersionedSample:
        """One completion of one prompt, a request of its own, with the version of every token.
        Cancelling the task aborts the request (the actor cancels a group left more than
        ``max_staleness`` behind a push)."""

    def write_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> str:
        """New weights (as ``BatchEngine.load_weights`` takes them) written where ``push`` reads
        them; returns that path. A plain method: the actor runs it in a thread while the engine
        keeps generating."""

    async def weight_digests(self, sent: Mapping[str, str]) -> dict[str, int]:
        """As ``BatchEngine.weight_digests``, of the weights of the latest push."""

    async def push(self, path: str, version: int) -> float:
        """Loads the weights ``write_weights`` wrote at ``path`` (and removes them) as policy
        ``version`` while requests are in flight: paused with every request kept, loaded,
        labelled, resumed. Returns the seconds it was paused (appended to ``pause_s``)."""

    async def sleep(self) -> None:
        """As ``BatchEngine.sleep``."""

    async def wake_up(self) -> None:
        """As ``BatchEngine.wake_up``."""

    def shutdown(self) -> None:
        """As ``BatchEngine.shutdown`` (a plain method: called as the actor goes)."""


MODES = ("batched", "streaming")
#: generation.mode -> (the protocol of its engines, the receiving side's when weight_transfer)
PROTOCOLS = {"batched": (BatchEngine, WeightReceiver), "streaming": (StreamingEngine, AsyncWeightReceiver)}

#: engine name -> generation.mode -> "package.module:Class" (every name has a batched class;
#: a streaming one where the engine batches continuously)
ENGINES = {
    "hf": {"batched": "actors.hf_engine:HFEngine"},
    "vllm": {"batched": "actors.vllm_engine:VLLMEngine",
             "streaming": "actors.vllm_stream_engine:AsyncVLLMEngine"},
    "simulated": {"batched": "actors.sim_engine:SimulatedEngine",
                  "streaming": "actors.sim_engine:SimulatedStreamingEngine"},
}


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """How a class falls short of a protocol: methods it lacks, methods that must be coroutines
    and are not, and coroutines where the actor makes a plain call."""

    missing: tuple[str, ...] = ()
    not_async: tuple[str, ...] = ()
    not_sync: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.missing or self.not_async or self.not_sync)

    def __str__(self) -> str:
        parts = [("missing", self.missing), ("not async (declare them async def)", self.not_async),
                 ("async where the actor calls them plainly (declare them def)", self.not_sync)]
        return "; ".join(f"{what}: {', '.join(names)}" for what, names in parts if names)


def protocol_members(protocol: type) -> tuple[dict[str, bool], tuple[str, ...]]:
    """({method name: whether it is a coroutine}, attribute names) that ``protocol`` declares,
    its protocol bases' included."""
    methods: dict[str, bool] = {}
    attributes: list[str] = []
    for base in reversed(protocol.__mro__):
        if base in (object, Protocol) or not getattr(base, "_is_protocol", False):
            continue
        attributes += [a for a in vars(base).get("__annotations__", {}) if a not in attributes]
        for name, value in vars(base).items():
            if isinstance(value, classmethod):
                value = value.__func__
            if inspect.isfunction(value) and not name.startswith("_"):
                methods[name] = inspect.iscoroutinefunction(value)
    return methods, tuple(attributes)


def mismatch(cls: Any, protocol: type) -> Mismatch:
    """What ``cls`` (a class, or an engine) lacks of ``protocol``'s methods."""
    methods, _ = protocol_members(protocol)
    found = {name: getattr(cls, name, None) for name in methods}
    return Mismatch(
        missing=tuple(n for n, f in found.items() if not callable(f)),
        not_async=tuple(n for n, f in found.items() if callable(f) and methods[n]
                        and not inspect.iscoroutinefunction(f)),
        not_sync=tuple(n for n, f in found.items() if callable(f) and not methods[n]
                       and inspect.iscoroutinefunction(f)))


def engine_class(kind: str, mode: str = "batched") -> type:
    """The class of engine ``kind`` for ``generation.mode`` ``mode``: a name of ``ENGINES`` or a
    ``package.module:Class``, imported and checked against the mode's protocol (and, where it
    has either of their methods, the receiving side's); ValueError naming what it lacks."""
    if mode not in MODES:
        raise ValueError(f"generation.mode must be one of {MODES}; got {mode!r}")
    protocol, receiver = PROTOCOLS[mode]
    if kind in ENGINES and mode not in ENGINES[kind]:
        streamers = [name for name, classes in ENGINES.items() if "streaming" in classes]
        raise ValueError(f"generation.mode='streaming' needs a continuous-batching engine "
                         f"({', '.join(streamers)}, or a class of actors.engines.StreamingEngine); "
                         f"engine {kind!r} takes batch calls: use generation.mode='batched' or "
                         f"generation.engine={streamers[0]!r}")
    path = ENGINES[kind][mode] if kind in ENGINES else kind
    module, sep, name = path.partition(":")
    if not sep:
        raise ValueError(f"unknown engine {kind!r}; known: {', '.join(ENGINES)} (or "
                         f"'package.module:Class' of an actors.engines.{protocol.__name__})")
    cls = import_path(path, f"engine {kind!r}")
    short = mismatch(cls, protocol)
    if not short and any(callable(getattr(cls, m, None)) for m in protocol_members(receiver)[0]):
        protocol, short = receiver, mismatch(cls, receiver)  # it offers the weight transfer: all of it
    if short:
        other = MODES[1 - MODES.index(mode)]
        fix = (f"; or, as it fulfils {PROTOCOLS[other][0].__name__}, use generation.mode={other!r}"
               if not mismatch(cls, PROTOCOLS[other][0]) else "")
        raise ValueError(f"engine {kind!r} ({path}) does not fulfil {_name(protocol)}, what "
                         f"generation.mode={mode!r} calls: {short}. Write them as the protocol's "
                         f"docstrings say{fix}")
    return cls


def make_engine(kind: str, model_path: str, mode: str = "batched",
                **kwargs: Any) -> BatchEngine | StreamingEngine:
    """Engine ``kind`` for ``mode`` built on ``model_path`` (``engine_class``), its attributes
    checked too: those of the mode's protocol, and, where ``weight_transfer`` is True, the
    receiving side's methods."""
    engine = engine_class(kind, mode)(model_path, **kwargs)
    protocol, receiver = PROTOCOLS[mode]
    lacking = [a for a in protocol_members(protocol)[1] if not hasattr(engine, a)]
    if lacking:
        raise ValueError(f"engine {kind!r} was built without the attributes {', '.join(lacking)} "
                         f"of {_name(protocol)}: set them in its __init__")
    if engine.weight_transfer and (short := mismatch(engine, receiver)):
        raise ValueError(f"engine {kind!r} has weight_transfer=True but does not fulfil "
                         f"{_name(receiver)}: {short}")
    return engine


def _name(protocol: type) -> str:
    return f"{protocol.__module__}.{protocol.__qualname__}"
