"""The eval suite contract: the items to complete and how one completion of an item is scored.

A suite (``Suite``) has a ``name``, the ``metrics`` it reports, its ``items()`` (``EvalItem``:
an id, the prompt as the rollout actors take it, a category and the reference the scorer
needs) and ``score(item, completions)``, which scores every sample of one item at once (code
suites run all n programs of an item in one sandbox call). The families of suites and the
registry that builds one from its name are ``gdpo_ray.eval.suites``.

``correct_metric()`` names the metric that pass@k counts correct samples by, and
``overall_of`` aggregates pass@k over items as the suite aggregates that metric
(``gdpo_ray.eval.pass_at_k``).

``exceeds`` is the paper's length-exceed test shared by the suites that report ``exceed_ratio``.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
from typing import Any, Mapping, Sequence

from gdpo_ray.eval.report import mean_over_items

#: the paper's length limit (math and code: a response over 4,000 tokens exceeds it)
LENGTH_LIMIT = 4000


@dataclasses.dataclass(frozen=True)
class EvalItem:
    id: str
    prompt: str | list  # a string, or chat messages (as training prompts)
    category: str
    reference: Any  # what the suite's scorer needs (answer, tests, possible answers)


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str
    tokens: int | None = None  # response tokens (None: not known, e.g. a completions file without them)
    finish_reason: str | None = None  # "stop" | "length" | None (not known)
    #: a multi-turn rollout's conversation after the prompt (assistant and tool messages; ``text``
    #: is the assistant's turns); None: a single turn, or a completions file's text
    messages: list | None = dataclasses.field(default=None, hash=False, compare=False)


def exceeds(c: Completion, limit: int) -> float:
    """1.0 if the response is over ``limit`` tokens, or was cut by max_tokens at ``limit`` or
    more (it would have gone on); NaN when its length is not known."""
    if c.tokens is None:
        return 1.0 if c.finish_reason == "length" else math.nan
    return float(c.tokens > limit or (c.finish_reason == "length" and c.tokens >= limit))


class Suite(abc.ABC):
    """The base of every suite; subclasses set ``name``, ``metrics`` and implement
    ``all_items`` and ``score``."""

    name: str = ""
    metrics: tuple[str, ...] = ()
    #: what the model is asked to produce (sampling defaults of ``gdpo-ray eval``)
    max_tokens: int = 1024
    length_limit: int = LENGTH_LIMIT
    #: True: score() mostly waits on sandbox processes, so items are scored on several threads
    parallel_scoring: bool = False
    #: a tool environment, 'module:Class': each completion is a multi-turn rollout with its tools
    #: (``Completion.messages``); None: one turn
    environment: str | None = None
    #: the most model turns of one of its rollouts (with an ``environment``)
    max_turns: int = 10

    #: keys of the prompts left out (``hold_out``)
    _held_out: frozenset = frozenset()

    @abc.abstractmethod
    def all_items(self) -> list[EvalItem]:
        """Every item of the suite."""

    def items(self) -> list[EvalItem]:
        """The items to evaluate: every item but those ``hold_out`` left out."""
        return [it for it in self.all_items() if prompt_key(it.prompt) not in self._held_out]

    def hold_out(self, training_prompts: Sequence[Any]) -> int:
        """Leaves out the items whose prompt is one of ``training_prompts`` (held-out eval
        during training); returns how many were left out. When that would leave none, none is
        left out (returns 0): the suite is all training items."""
        keys = {prompt_key(p) for p in training_prompts}
        left_out = sum(prompt_key(it.prompt) in keys for it in self.all_items())
        if left_out == len(self.all_items()):
            return 0
        self._held_out = frozenset(keys)
        return left_out

    @abc.abstractmethod
    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        """One dict of metric -> value per completion of ``item``."""

    def overall(self, items: Mapping[str, Mapping[str, Any]], categories: Mapping[str, Mapping]) -> dict:
        """The ``overall`` section: each metric's mean over the items."""
        return mean_over_items(items, self.metrics)

    def correct_metric(self) -> str | None:
        """The metric by which pass@k counts a sample correct (it scores 1): ``pass@1``, else
        ``accuracy``; None: the suite reports neither, and has no pass@k."""
        return next((m for m in ("pass@1", "accuracy") if m in self.metrics), None)

    def overall_of(self, metric: str, items: Mapping[str, Mapping[str, Any]],
                   categories: Mapping[str, Mapping]) -> float:
        """The overall value of a per-item metric that ``overall`` does not report (pass@k),
        aggregated as the suite aggregates its ``correct_metric``: the mean over the items."""
        return mean_over_items(items, [metric])[metric]

    def report_settings(self) -> dict:
        """What the suite was made with beyond the sampling settings, recorded in its reports'
        ``settings`` (and compared by ``--compare``): e.g. the rewards suite's reward weights."""
        return {}

    def environment_row(self, item: EvalItem) -> dict:
        """What the ``environment``'s ``reset`` gets for ``item`` besides its prompt."""
        return {}

    def close(self) -> None:
        """Releases what the suite started (worker processes, environments)."""


def prompt_key(prompt: Any) -> str:
    """A prompt (a string or chat messages) as a comparable key."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
