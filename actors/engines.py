"""The engine contract: what a rollout actor asks of a generation engine, and the registry.

An engine (``Engine``) holds a policy's weights and generates: ``generate(prompt_token_ids, n,
sampling)`` returns, per prompt, n ``Sample``s: the response token ids (up to and including the
stop token), the log-probability of each sampled token under the distribution sampled from
(log_softmax(logits / temperature); top-p/top-k are recorded in the group metadata, not
renormalized into the logprobs, so that learners compute theirs the same way), and the finish
reason ("stop", "length" or "abort"). Engines are registered by import path (``ENGINES``:
``hf`` -> ``actors.hf_engine:HFEngine``, ``vllm`` -> ``actors.vllm_engine:VLLMEngine``); a
config may also name any ``package.module:Class`` that fulfils the contract. This module imports
nothing else of ``actors``.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Iterable, Protocol, runtime_checkable

from gdpo_ray.config import check_value, default


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; defaults and rules are those of the generation fields of the same
    names (``gdpo_ray.config``)."""

    temperature: float = default("temperature")
    top_p: float = default("top_p")
    top_k: int = default("top_k")  # 0 = off
    max_tokens: int = default("max_tokens")  # new tokens per response
    stop: tuple[str, ...] = ()  # extra stop strings (the EOS token always stops)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "top_k", "max_tokens"):
            check_value(name, getattr(self, name), f"sampling {name}")

    def metadata(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


@dataclasses.dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


@runtime_checkable
class Engine(Protocol):
    """What a rollout actor uses of an engine."""

    tokenizer: Any  # a Hugging Face tokenizer (chat template, decode)
    device: str  # "cpu" or "cuda": where its weights live (picks the weight transport)
    weight_transfer: bool  # True: it can join vLLM's NCCL weight transfer (receive_broadcast)

    @classmethod
    def check_sampling(cls, sampling: SamplingParams) -> None:
        """Raises ValueError for sampling it cannot do with exact logprobs (at config time)."""

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 logprobs: bool = True) -> list[list[Sample]]:
        """``logprobs=False``: the caller (evaluation) needs no logprobs, so any sampling is
        allowed (top-p/top-k included) and ``Sample.logprobs`` may be empty."""

    def greedy(self, prompt_token_ids: list[list[int]], max_tokens: int) -> list[list[int]]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None: ...

    def sleep(self) -> None:
        """Frees its accelerator memory while colocated learners update (a no-op where none)."""

    def wake_up(self) -> None: ...


#: engine name -> "package.module:Class"
ENGINES = {"hf": "actors.hf_engine:HFEngine", "vllm": "actors.vllm_engine:VLLMEngine"}


def engine_class(kind: str) -> type:
    """The class of engine ``kind``: a name of ``ENGINES`` or an import path."""
    path = ENGINES.get(kind, kind)
    module, sep, name = path.partition(":")
    if not sep:
        raise ValueError(f"unknown engine {kind!r}; known: {', '.join(ENGINES)} (or "
                         f"'package.module:Class' of an engine of the actors.engines.Engine contract)")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"engine {kind!r}: cannot import {path}: {err}") from None
    missing = [m for m in ("generate", "greedy", "load_weights", "sleep", "wake_up", "check_sampling")
               if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"engine {kind!r} ({path}) lacks {missing} of the actors.engines.Engine contract")
    return cls


def make_engine(kind: str, model_path: str, **kwargs: Any) -> Engine:
    return engine_class(kind)(model_path, **kwargs)
