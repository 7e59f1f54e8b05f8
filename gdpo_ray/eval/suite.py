"""The eval suite contract: the items to complete and how one completion of an item is scored.

A suite (``Suite``) has a ``name``, the ``metrics`` it reports, its ``items()`` (``EvalItem``:
an id, the prompt as the rollout actors take it, a category and the reference the scorer
needs) and ``score(item, completions)``, which scores every sample of one item at once (code
suites run all n programs of an item in one sandbox call). The families of suites and the
registry that builds one from its name are ``gdpo_ray.eval.suites``.

``correct_metric()`` names the metric that pass@k counts correct samples by (``set_correct``
defines one from any suite's metrics: ``gdpo_ray.eval.correct``), and
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
    #: the reward columns as the rollout actor scored them (``Suite.rollout_rewards``): name ->
    #: stored value (NaN: not computed), and name -> why not; None: not scored by the actor
    rewards: dict | None = dataclasses.field(default=None, hash=False, compare=False)
    reward_errors: dict | None = dataclasses.field(default=None, hash=False, compare=False)
    #: a multi-turn rollout's model turns, tool calls and failed calls (None: one turn)
    turns: int | None = None
    tool_calls: int | None = None
    tool_errors: int | None = None


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
    #: True: score() mostly waits on sandbox processes (the model's programs run there, under
    #: the sandbox's limits), so items are scored on several threads of the eval's process;
    #: False: in worker processes, each item's killed at its time limit, as what score() runs
    #: follows from the completion (BFCL's tool calls, sympy: ``gdpo_ray.run.eval_runner.score``)
    parallel_scoring: bool = False
    #: a tool environment, 'module:Class': each completion is a multi-turn rollout with its tools
    #: (``Completion.messages``); None: one turn
    environment: str | None = None
    #: the most model turns of one of its rollouts (with an ``environment``)
    max_turns: int = 10
    #: the rollout actors' other tool settings (``tool_timeout``, ``tools_in_system_prompt``)
    tool_settings: dict = {}
    #: reward declarations the rollout actors score each completion with, as training scores a
    #: rollout (environment columns included: ``Completion.rewards``); None: the suite scores
    rollout_rewards: list | None = None
    #: a run's ``data.system_prompt`` and ``llm.chat_template`` (None: the command's own)
    system_prompt: str | None = None
    chat_template: bool | None = None

    #: keys of the prompts left out (``hold_out``), and how many items that left out
    _held_out: frozenset = frozenset()
    training_prompts_left_out: int = 0

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
        self._held_out, self.training_prompts_left_out = frozenset(keys), left_out
        return left_out

    @abc.abstractmethod
    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        """One dict of metric -> value per completion of ``item``."""

    def overall(self, items: Mapping[str, Mapping[str, Any]], categories: Mapping[str, Mapping]) -> dict:
        """The ``overall`` section: each metric's mean over the items."""
        return mean_over_items(items, self.metrics)

    def correct_metric(self) -> str | None:
        """The metric by which pass@k counts a sample correct (it scores 1): ``pass@1``, else
        ``accuracy`` (the one of ``set_correct`` where it was called); None: the suite reports
        neither, and has no pass@k."""
        return next((m for m in ("pass@1", "accuracy") if m in self.metrics), None)

    #: the conditions of a correct sample (``set_correct``); empty: the suite's own
    correct: tuple = ()

    def set_correct(self, texts: Sequence[str] | str | None, where: str = "--correct") -> None:
        """Defines a correct sample from the suite's metrics (``gdpo_ray.eval.correct``: 'NAME>=VALUE',
        each must hold): every sample then also scores ``accuracy`` and ``<NAME>/pass_rate``,
        and pass@k counts ``accuracy``. Refused for a suite that counts correct samples itself."""
        if not texts:
            return
        from gdpo_ray.eval.correct import correct_metrics, parse_correct

        own = self.correct_metric()
        if own is not None:
            raise ValueError(f"{where}: suite {self.name} counts a correct sample by its own {own}; "
                             f"{where} defines one for suites that have none (e.g. rewards:FILE)")
        correct = parse_correct(texts, self.metrics, where)
        taken = [m for m in correct_metrics(correct) if m in self.metrics]
        if taken:
            raise ValueError(f"{where}: suite {self.name} already reports a metric named {taken[0]!r}, which "
                             f"{where} adds; rename that reward in the config (its name is only a label)")
        self.correct = correct
        self.metrics = (*self.metrics, *correct_metrics(correct))

    def scored(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict]:
        """``score``'s results, checked to be one per completion, ``judged``: what the eval
        runner records (it calls this in a scoring process, ``gdpo_ray.run.eval_runner.score``)."""
        values = self.score(item, completions)
        if len(values) != len(completions):
            raise ValueError(f"{type(self).__name__}.score returned {len(values)} results for "
                             f"{len(completions)} completions")
        return self.judged(values)

    def judged(self, scores: Sequence[dict]) -> list[dict]:
        """``score``'s results with the ``set_correct`` metrics added (unchanged without)."""
        if not self.correct:
            return [dict(v) for v in scores]
        from gdpo_ray.eval.correct import judge

        return [dict(v) | judge(self.correct, v) for v in scores]

    def overall_of(self, metric: str, items: Mapping[str, Mapping[str, Any]],
                   categories: Mapping[str, Mapping]) -> float:
        """The overall value of a per-item metric that ``overall`` does not report (pass@k),
        aggregated as the suite aggregates its ``correct_metric``: the mean over the items."""
        return mean_over_items(items, [metric])[metric]

    def report_settings(self) -> dict:
        """What the suite was made with beyond the sampling settings, recorded in its reports'
        ``settings`` (and compared by ``--compare``): e.g. the rewards suite's reward weights."""
        return {}

    def check_scorable_here(self, what: str = "--completions") -> None:
        """Raises ValueError where a column of the suite can be computed only inside a rollout, so
        that ``what`` (a file of completions) cannot score it; every suite's own metrics can."""

    def environment_row(self, item: EvalItem) -> dict:
        """What the ``environment``'s ``reset`` gets for ``item`` besides its prompt."""
        return {}

    def close(self) -> None:
        """Releases what the suite started (worker processes, environments)."""


def prompt_key(prompt: Any) -> str:
    """A prompt (a string or chat messages) as a comparable key."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
