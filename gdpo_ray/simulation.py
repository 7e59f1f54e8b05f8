"""The timing model of a simulated run (``generation.engine: simulated``, ``learners.backend:
simulated``): how long a rollout engine and a learner of a named model on a named GPU take,
and how long the responses are. Pure: numbers in, seconds and lengths out.

An engine (one rollout actor: a GPU, or a tensor-parallel group) batches continuously, as vLLM
does: at most ``max_num_seqs`` sequences decode together, one token each per step, and a step
with ``b`` sequences takes

    decode_step_s(b) = step_s + step_s_per_seq * b                        (TPOT, linear in b)

so its output rate is ``b / decode_step_s(b)`` tokens/s, saturating at ``1 / step_s_per_seq``.
A sequence admitted into the batch first has its prompt prefilled at ``prefill_tokens_per_s``
(the decode steps wait meanwhile, as chunked prefill shares the step); the ``n`` samples of one
prompt share its prefill (prefix caching). A learner trains ``train_tokens_per_s`` tokens
(prompt and response) per second, per learner, and per epoch.

``PROFILES`` hold published figures (docs/scale.md names each source); ``TimingModel`` is any
profile with fields overridden (``simulation.timing``). Response lengths come from
``ResponseLengths`` (fixed, uniform, or lognormal with its long tail), capped at the call's
``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class TimingModel:
    """One engine's and one learner's speed (see the module docstring). ``weight_bytes``: the
    model's weights as pushed (bf16: 2 bytes a parameter), what an engine's load takes at
    ``load_bytes_per_s`` while its decoding pauses."""

    name: str = "custom"
    step_s: float = 0.0065  # a decode step's fixed cost (TPOT at batch 1), s
    step_s_per_seq: float = 0.000075  # added per sequence in the step, s
    prefill_tokens_per_s: float = 24_600.0  # prompt tokens per second of one engine
    max_num_seqs: int = 256  # sequences an engine decodes at once
    train_tokens_per_s: float = 5_762.0  # tokens a learner trains per second (forward + backward)
    weight_bytes: int = 16_060_000_000  # the weights as pushed (8.03e9 bf16 parameters)
    load_bytes_per_s: float = 2e10  # an engine's load of pushed weights (its decoding paused)

    def __post_init__(self) -> None:
        for field in ("step_s", "step_s_per_seq", "prefill_tokens_per_s", "train_tokens_per_s",
                      "load_bytes_per_s"):
            value = getattr(self, field)
            least = 0 if field == "step_s_per_seq" else None  # a step's cost may not grow with its batch
            if not (isinstance(value, (int, float)) and math.isfinite(value)
                    and (value >= least if least is not None else value > 0)):
                kind = "a number >= 0" if least is not None else "a positive number"
                raise ValueError(f"simulation.timing.{field} must be {kind}; got {value!r}")
        for field in ("max_num_seqs", "weight_bytes"):
            value = getattr(self, field)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"simulation.timing.{field} must be a positive integer; got {value!r}")

    def decode_step_s(self, batch: int) -> float:
        """Seconds of one decode step of ``batch`` sequences."""
        return self.step_s + self.step_s_per_seq * batch

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def load_s(self) -> float:
        """Seconds an engine's decoding pauses to load a push of the whole model."""
        return self.weight_bytes / self.load_bytes_per_s

    def update_s(self, tokens: int, epochs: int = 1) -> float:
        """Seconds one learner trains ``tokens`` tokens for ``epochs`` epochs."""
        return epochs * tokens / self.train_tokens_per_s

    def schedule(self, prompts: Sequence[int], lengths: Sequence[int], shared: Sequence[bool] | None = None,
                 ) -> tuple[float, list[float]]:
        """One engine call of requests with ``prompts`` tokens and ``lengths`` new tokens each,
        admitted in order as slots free (at most ``max_num_seqs`` decode at once); ``shared[i]``:
        request i's prompt was prefilled already (an earlier sample of the same prompt).
        Returns (the call's seconds, each request's finish time). Every request decodes one
        token a step from the step after its admission; the steps between two events (an
        admission, a finish) all have the same batch, so they are summed at once."""
        count = len(lengths)
        finish = [0.0] * count
        now, nxt, running = 0.0, 0, []  # running: (steps done at its end, request)
        steps = 0  # decode steps taken so far
        while nxt < count or running:
            while nxt < count and len(running) < self.max_num_seqs:  # admissions wait for the prefill
                if not (shared and shared[nxt]):
                    now += self.prefill_s(prompts[nxt])
                if lengths[nxt] <= 0:
                    finish[nxt] = now
                else:
                    heapq.heappush(running, (steps + int(lengths[nxt]), nxt))
                nxt += 1
            if not running:
                continue
            end = running[0][0]
            now += (end - steps) * self.decode_step_s(len(running))
            steps = end
            while running and running[0][0] == steps:
                finish[heapq.heappop(running)[1]] = now
        return now, finish


#: published figures, by name (docs/scale.md: their sources and how each field was derived);
#: the defaults are Llama-3.1-8B's on one H100 (bf16, vLLM; torchtitan's FSDP training)
PROFILES: dict[str, TimingModel] = {
    "llama3-8b-h100": TimingModel(name="llama3-8b-h100"),
    "llama3-70b-h100x4": TimingModel(name="llama3-70b-h100x4", step_s=0.020, step_s_per_seq=0.00016,
                                     prefill_tokens_per_s=11_300.0, train_tokens_per_s=660.0,
                                     weight_bytes=141_100_000_000),
    "qwen3-0.6b-h100": TimingModel(name="qwen3-0.6b-h100", step_s=0.0024, step_s_per_seq=0.000012,
                                   prefill_tokens_per_s=330_000.0, train_tokens_per_s=70_000.0,
                                   weight_bytes=1_200_000_000),
}


def timing_model(setting: str | Mapping[str, Any] | TimingModel | None) -> TimingModel:
    """``simulation.timing``: a profile's name, or {profile: name, field: value, ...} (the
    profile with fields overridden; without ``profile``, the defaults), or a TimingModel."""
    if isinstance(setting, TimingModel):
        return setting
    if setting is None or isinstance(setting, str):
        name = setting or DEFAULT_PROFILE
        if name not in PROFILES:
            raise ValueError(f"simulation.timing {name!r} is not a profile; known: {', '.join(PROFILES)} "
                             "(or a mapping of TimingModel's fields)")
        return PROFILES[name]
    if not isinstance(setting, Mapping):
        raise ValueError(f"simulation.timing must be a profile's name or a mapping; got {setting!r}")
    fields = dict(setting)
    base = timing_model(fields.pop("profile")) if "profile" in fields else TimingModel()
    known = {f.name for f in dataclasses.fields(TimingModel)} - {"name"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"simulation.timing has no field {', '.join(map(repr, unknown))}; its fields: "
                         f"profile, {', '.join(sorted(known))}")
    return dataclasses.replace(base, name=f"{base.name}+" + ",".join(sorted(fields)) if fields else base.name,
                               **fields)


@dataclasses.dataclass(frozen=True)
class ResponseLengths:
    """New tokens per response: ``fixed`` (``tokens``), ``uniform`` (``low``..``high``,
    inclusive) or ``lognormal`` (median ``tokens``, log-space spread ``sigma``: a long tail; 0.8
    puts the mean at 1.38x the median and the 99th percentile at 6.4x). Every draw is at least 1
    and at most the call's ``max_tokens`` (a response that reaches it finishes "length"). The
    default's mean, 1,100, is near the 1,060 tokens of NeMo RL's published GRPO run of
    Llama-3.1-8B (docs/scale.md)."""

    dist: str = "lognormal"
    tokens: float = 800.0
    sigma: float = 0.8
    low: int = 1
    high: int = 1024

    def __post_init__(self) -> None:
        if self.dist not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"simulation.response_lengths.dist must be fixed, uniform or lognormal; got {self.dist!r}")
        if not self.tokens >= 1 or self.sigma < 0 or not 1 <= self.low <= self.high:
            raise ValueError("simulation.response_lengths needs tokens >= 1, sigma >= 0 and 1 <= low <= high; "
                             f"got tokens={self.tokens}, sigma={self.sigma}, low={self.low}, high={self.high}")

    @classmethod
    def of(cls, setting: Mapping[str, Any] | ResponseLengths | None) -> ResponseLengths:
        if setting is None or isinstance(setting, ResponseLengths):
            return setting or cls()
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(setting) - known)
        if unknown:
            raise ValueError(f"simulation.response_lengths has no field {', '.join(map(repr, unknown))}; "
                             f"its fields: {', '.join(sorted(known))}")
        return cls(**setting)

    def draw(self, rng: np.random.Generator, count: int, max_tokens: int) -> np.ndarray:
        """``count`` lengths (int64), each in [1, max_tokens]."""
        if self.dist == "fixed":
            out = np.full(count, round(self.tokens))
        elif self.dist == "uniform":
            out = rng.integers(self.low, self.high + 1, size=count)
        else:
            out = np.rint(self.tokens * np.exp(self.sigma * rng.standard_normal(count)))
        return np.clip(out, 1, max_tokens).astype(np.int64)


DEFAULT_PROFILE = "llama3-8b-h100"
