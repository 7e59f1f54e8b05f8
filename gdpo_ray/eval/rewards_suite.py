"""``rewards:<path>``: held-out prompts scored with a run's own reward functions.

The file is a dataset as training reads it (``gdpo_ray.data.read_dataset``: jsonl, json,
parquet): the prompt column (``data.prompt_column``) and whatever columns the rewards take,
nested ones taken as ``data.columns`` says; ids from ``data.id_column``, else the row's index
from 0.
The rewards are the run's ``training.rewards`` (``gdpo-ray eval --rewards CONFIG``, or the
``config.yaml`` of the run directory evaluated). A policy's completions are generated and scored
by rollout actors exactly as training generates and scores a rollout (``rollout_rewards``):
with the config's tool environment(s), ``max_turns``, tool settings, system prompt and
template, every column scored, the environments' own (``fn: environment``) and the rewards that
read their instances (``environments=``) included, conditions applied. A completions file
(``--completions``) is scored here, each reward called as training calls it (TRL's keywords,
``gdpo_ray.rewards.call_reward``; chat prompts get their completion as one assistant message)
within its ``timeout_s``; a column only a rollout can compute cannot score a file
(``check_scorable_here`` names it before anything runs).

Metrics, each avg@n (the mean over an item's n samples, then over the items):

- ``<reward>``: the reward's value (a float32, as training stores it), over the samples it scored;
- ``<reward>/failure_rate``: 1 for a sample it failed on (it raised, timed out, returned None or
  NaN, or its condition's gate failed), 0 where it scored; the reason is in the sample's
  ``reward_errors``, classed as training classes it (``gdpo_ray.rewards.failure_kind``);
- ``weighted_sum``: sum_k w_k r_k with the config's weights, over the samples every reward
  scored (a failed reward leaves the sample without a total, as GRPO leaves it unscored);
- ``exceed_ratio``: over ``length_limit`` tokens (default: the run's ``generation.max_tokens``);
- with a tool environment, ``rollout/turns``, ``rollout/tool_calls`` and ``rollout/tool_errors``
  per rollout; each sample's conversation is in the report (``messages``).

A prompt over the actors' ``max_prompt_tokens`` is not generated: its samples fail every column
("not generated"). In TRL's dict form of environments a column another class gives does not apply
to a row (training's ``n/a``): NaN, no failure, left out of ``weighted_sum``; the sample lists it
under ``not_applicable``, and a ``--correct`` condition on it holds. Eval knows a file's
completion's token count (``response_length``) but not its token ids: ``completion_ids`` are
None, ``trainer_state.global_step`` is 0.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from gdpo_ray.eval.suite import Completion, EvalItem, Suite, exceeds
from gdpo_ray.rewards import NOT_APPLICABLE, failure_kind

#: the metrics of a multi-turn rollout (a suite with a tool environment)
TURN_METRICS = ("rollout/turns", "rollout/tool_calls", "rollout/tool_errors")
#: the metrics besides each reward's own: no reward may take their names
RESERVED = ("weighted_sum", "exceed_ratio", *TURN_METRICS)
FAILURE = "/failure_rate"
#: the reason of every column of a sample whose prompt was over the actors' max_prompt_tokens
NOT_GENERATED = "error: not generated: its prompt is over the actors' max_prompt_tokens"


class RewardsSuite(Suite):
    def __init__(self, path: str, rewards: Sequence[Mapping[str, Any]], prompt_column: str = "prompt",
                 id_column: str | None = None, columns: Mapping[str, str] | None = None,
                 max_tokens: int | None = None, length_limit: int | None = None,
                 environment: Any = None, max_turns: int | None = None, source: str | None = None,
                 tool_settings: Mapping[str, Any] | None = None, system_prompt: str | None = None,
                 chat_template: bool | None = None, judges: Mapping[str, Any] | None = None) -> None:
        from gdpo_ray.data import read_dataset
        from gdpo_ray.rewards import check_specs, reward_specs, takes_environments

        self.name, self.source = f"rewards:{Path(path).stem}", source
        if not Path(path).expanduser().is_file():
            raise ValueError(f"--suite rewards:{path}: no such file; name the held-out jsonl/json/parquet "
                             f"file (the training data's columns: {prompt_column} and those the rewards take)")
        if max_tokens is not None:
            self.max_tokens = max_tokens
        self.length_limit = length_limit if length_limit is not None else self.max_tokens
        self.environment, self.max_turns = environment, max_turns or self.max_turns
        self.tool_settings, self.system_prompt = dict(tool_settings or {}), system_prompt
        self.chat_template = chat_template
        self.judges = dict(judges or {})  # the judge pool's settings (the judges: section) for judges without url
        self.specs = reward_specs(rewards)
        self.fns = check_specs(self.specs)
        self.rollout_rewards = [dict(r) for r in rewards]
        rollout_only = {s.name for s, fn in zip(self.specs, self.fns) if fn is None or takes_environments(fn)}
        while gated := {s.name for s in self.specs if s.condition and s.condition.on in rollout_only} - rollout_only:
            rollout_only |= gated
        self.rollout_only = [s.name for s in self.specs if s.name in rollout_only]
        taken = [s.name for s in self.specs if s.name in RESERVED]
        if taken:
            raise ValueError(f"reward {taken[0]!r}: the rewards suite reports a metric of that name; "
                             f"rename the reward in the config (its name is only a label)")
        self.metrics = (*[m for s in self.specs for m in (s.name, s.name + FAILURE)], "weighted_sum",
                        "exceed_ratio", *(TURN_METRICS if environment else ()))
        data = read_dataset(path)
        self._items = _read_items(data, prompt_column, id_column, dict(columns or {}),
                                  [(s, fn) for s, fn in zip(self.specs, self.fns) if fn is not None],
                                  Path(path).stem)
        if environment is not None:
            _check_resets(environment, self._items, data, float(self.tool_settings.get("tool_timeout", 30.0)))

    def check_scorable_here(self, what: str = "--completions") -> None:
        """Raises when a column can be computed only inside a rollout (an environment's own, one
        that reads its instances, or one conditioned on those): ``what`` cannot score it."""
        if self.rollout_only:
            raise ValueError(f"{what}: rewards {self.rollout_only} are computed by the rollout actors (an "
                             f"environment's columns, rewards reading its instances, a judge's criteria, or "
                             f"conditioned on them), which a file of completions does not have; evaluate the policy "
                             f"instead (gdpo-ray eval POLICY --suite rewards:FILE --rewards CONFIG), which "
                             f"runs each row through the environment")

    def all_items(self) -> list[EvalItem]:
        return list(self._items)

    def environment_row(self, item: EvalItem) -> dict:
        return dict(item.reference)

    def report_settings(self) -> dict:
        out = {"rewards_config": self.source, "reward_weights": {s.name: s.weight for s in self.specs}}
        if self.environment:
            out |= {"tool_environment": self.environment, "max_turns": self.max_turns, **self.tool_settings}
        return out

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        from gdpo_ray.rewards import apply_conditions

        n = len(completions)
        values = np.full((n, len(self.specs)), np.nan)
        errors = [[""] * len(self.specs) for _ in range(n)]
        here = [i for i, c in enumerate(completions) if c.rewards is None and c.finish_reason != "prompt_too_long"]
        for i, c in enumerate(completions):
            if c.rewards is not None:  # as the rollout actor scored it (conditions applied)
                values[i] = [c.rewards.get(s.name, math.nan) for s in self.specs]
                errors[i] = [(c.reward_errors or {}).get(s.name, "") for s in self.specs]
            elif c.finish_reason == "prompt_too_long":  # never generated: no column is scored
                errors[i] = [NOT_GENERATED] * len(self.specs)
        stored = values.copy()
        if here:
            self._score_here(item, [completions[i] for i in here], values, errors, here)
            stored[here] = apply_conditions(values[here], self.specs)
        stored = stored.astype(np.float32).astype(np.float64)
        _explain(values, stored, errors, self.specs)
        weights = np.array([s.weight for s in self.specs])
        out = []
        for i, c in enumerate(completions):
            row = {}
            absent = [failure_kind(e) == NOT_APPLICABLE for e in errors[i]]  # TRL's dict form: another class's
            for k, spec in enumerate(self.specs):
                row[spec.name] = float(stored[i, k])
                row[spec.name + FAILURE] = float(math.isnan(stored[i, k]) and not absent[k])
            # NaN where a reward failed; a column that does not apply is left out, as in training
            total = float(sum(w * v for w, v, a in zip(weights, stored[i], absent) if not a))
            row |= {"weighted_sum": total, "exceed_ratio": exceeds(c, self.length_limit)}
            if self.environment:
                row |= {m: math.nan if v is None else float(v) for m, v in zip(
                    TURN_METRICS, (c.turns, c.tool_calls, c.tool_errors))}
            failed = {s.name: errors[i][k] for k, s in enumerate(self.specs) if errors[i][k] and not absent[k]}
            out.append(row | ({"reward_errors": failed} if failed else {})
                       | ({"not_applicable": [s.name for s, a in zip(self.specs, absent) if a]} if any(absent) else {}))
        return out

    def correct_metric(self) -> str | None:
        """``accuracy`` once ``set_correct`` defined it; a reward column is never one by its name."""
        return "accuracy" if self.correct else None

    def _score_here(self, item: EvalItem, completions: Sequence[Completion], values: np.ndarray,
                    errors: list[list[str]], at: Sequence[int]) -> None:
        """Scores ``completions`` (rows ``at`` of ``values``/``errors``) in this process; the
        columns only a rollout computes fail with the reason (a completion that was not generated,
        or one from a file)."""
        from gdpo_ray.rewards import TrainerState

        n, chat = len(completions), not isinstance(item.prompt, str)
        texts = [c.messages if c.messages is not None else
                 [{"role": "assistant", "content": c.text}] if chat else c.text for c in completions]
        kwargs = {**{k: [v] * n for k, v in item.reference.items()},
                  "response_length": [c.tokens for c in completions], "prompts": [item.prompt] * n,
                  "completions": texts, "completion_ids": [None] * n, "trainer_state": TrainerState()}
        for k, (spec, fn) in enumerate(zip(self.specs, self.fns)):
            if spec.name in self.rollout_only:
                for j in at:
                    errors[j][k] = "error: computed only inside a rollout (not scored by one)"
                continue
            rows = list(range(n))
            if "response_length" in _required(fn):
                unknown = [i for i in rows if completions[i].tokens is None]
                for i in unknown:
                    errors[at[i]][k] = ("error: response_length is not known (give the completions file "
                                        "\"tokens\", or --tokenizer MODEL)")
                rows = [i for i in rows if i not in unknown]
            for i, (value, error) in zip(rows, _call(spec, fn, kwargs, rows)):
                values[at[i], k], errors[at[i]][k] = value, error


def _check_resets(setting: Any, items: Sequence[EvalItem], data: Any, timeout_s: float) -> None:
    """Before any model loads: in TRL's dict form every row names one of the classes, and each
    class resets on its first row (as a rollout resets it, the whole row): a file whose rows the
    environment cannot start would otherwise be generated without tools, its columns all NaN."""
    from gdpo_ray.environments.process import EnvironmentProcess, Raised, Stopped, payload_of
    from gdpo_ray.environments.spec import ROW_COLUMN, environment_paths, load_environment
    from gdpo_ray.forks import fork_context

    paths = environment_paths(setting)
    firsts: dict[Any, int] = {}
    for i, it in enumerate(items):
        name = None if None in paths else it.reference.get(ROW_COLUMN)
        if name not in paths:
            raise ValueError(f"{data.where(i)}: {ROW_COLUMN} is {name!r}, not one of data.tool_environment's "
                             f"{sorted(paths)}")
        firsts.setdefault(name, i)
    for name, i in firsts.items():
        spec = load_environment(paths[name], timeout_s)
        row = {k: v for k, v in items[i].reference.items() if not (name is not None and k == ROW_COLUMN)}
        try:  # in a process, as a rollout's: one whose reset hangs is killed at the limit
            process = EnvironmentProcess(fork_context([spec.cls.__module__]), payload_of(spec, []), timeout_s)
            try:
                process.ask(("reset", {**row, "prompt": items[i].prompt}), timeout_s)
            finally:
                process.kill()
        except (Raised, Stopped) as err:  # the environment's own error, with the row
            raise ValueError(f"{data.where(i)}: environment {paths[name]} cannot start on this row "
                             f"({err}); give the held-out rows the columns its reset "
                             f"reads, as the training rows have them") from None


def _explain(values: np.ndarray, stored: np.ndarray, errors: list[list[str]], specs: Sequence[Any]) -> None:
    """Every stored value that is NaN gets its reason, every other none (a reward that failed
    where its gate is below the threshold stores 0: no failure): its gate's (``condition:``, as
    training names it), else its own error, or that it returned None or NaN."""
    for i, row in enumerate(errors):
        for k in range(len(specs)):
            if math.isnan(values[i, k]) and not row[k]:
                row[k] = "error: returned None or NaN"
    index = {s.name: k for k, s in enumerate(specs)}
    for k, spec in enumerate(specs):
        gate = index[spec.condition.on] if spec.condition else None
        for i, row in enumerate(errors):
            if not math.isnan(stored[i, k]):
                row[k] = ""
            elif gate is not None and math.isnan(stored[i, gate]):
                row[k] = (f"{NOT_APPLICABLE}: on {spec.condition.on!r}, which does not apply"
                          if failure_kind(row[gate]) == NOT_APPLICABLE else
                          f"condition: on {spec.condition.on!r}, " + (row[gate] or "which could not be computed"))


def _required(fn: Any) -> list[str]:
    from gdpo_ray.rewards import required_columns

    return required_columns(fn)


def _call(spec: Any, fn: Any, kwargs: Mapping[str, list], rows: Sequence[int]) -> list[tuple[float, str]]:
    """(value, error text) of reward ``fn`` on ``rows``: one call of all of them (as training
    batches), re-done row by row when it raises, so only the rows that fail are lost; a call past
    the reward's timeout fails its rows with ``timeout:``. Anything the reward raises but
    ``KeyboardInterrupt`` is its failure on the row (``SystemExit``, ``GeneratorExit`` and
    math-verify's ``TimeoutException`` are BaseExceptions): the eval goes on. Called on this
    thread (math-verify's own timeouts need the main thread), under a nested ``time_limit``."""
    from gdpo_ray.eval.time_limit import ScoringTimeout, time_limit
    from gdpo_ray.rewards import RewardInfraError, call_reward, failure_text, to_floats

    if not rows:
        return []
    timeout = spec.call_timeout_s(fn)
    call = {key: [values[i] for i in rows] if isinstance(values, list) else values for key, values in kwargs.items()}
    try:
        with time_limit(timeout) as mine:
            values = to_floats(call_reward(fn, **call), len(rows), spec.name)
        return [(v, "") for v in values]
    except ScoringTimeout as err:
        if err.limit is not mine:  # the item's limit, not the reward's
            raise
        return [(math.nan, f"timeout: no answer after {timeout:g} s")] * len(rows)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - any failure of the reward is its rows'
        if len(rows) > 1:
            return [one for i in rows for one in _call(spec, fn, kwargs, [i])]
        kind = "infra" if isinstance(err, RewardInfraError) else "error"
        return [(math.nan, f"{kind}: {failure_text(err)}"[:500])]


def _read_items(data: Any, prompt_column: str, id_column: str | None, columns: dict[str, str],
                rewards: Sequence[tuple[Any, Any]], stem: str) -> list[EvalItem]:
    """The file's rows as items (reference: the row's columns but the prompt), every column a
    reward needs checked on every row, the first row without it named."""
    from gdpo_ray.rewards import ROLLOUT_COLUMNS

    rows = [dict(r) for r in data.rows]
    names = list(rows[0])
    for name, path in columns.items():
        for i, row in enumerate(rows):
            row[name] = _nested(row, path, f"{data.where(i)}: data column {name!r} comes from {path!r}")
    for column, setting in ((prompt_column, "prompt_column"), (id_column, "id_column")):
        if column is not None and column not in rows[0]:
            raise ValueError(f"{data.source} has no column {column!r} (the config's data.{setting}); "
                             f"its columns: {names}")
    for spec, fn in rewards:
        for column in _required(fn):
            if column in ROLLOUT_COLUMNS:
                continue
            if column not in rows[0]:
                raise ValueError(f"reward {spec.name!r} needs column {column!r}, which {data.source} does not "
                                 f"have (its columns: {names}); add it to every row, as the training data has it")
            empty = next((i for i, r in enumerate(rows) if r[column] is None), None)
            if empty is not None:
                raise ValueError(f"{data.where(empty)} has no {column!r} (null or missing), which reward "
                                 f"{spec.name!r} needs; give every row a value")
    items, seen = [], {}
    for i, row in enumerate(rows):
        prompt = row[prompt_column]
        if not (isinstance(prompt, str) and prompt or isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt)):
            raise ValueError(f"{data.where(i)}: column {prompt_column!r} must be a non-empty string or a "
                             f"list of chat messages {{role, content}}; got {str(prompt)[:100]!r}")
        item_id = str(row[id_column]) if id_column else str(i)
        if item_id in seen:
            raise ValueError(f"{data.where(i)}: id {item_id!r} (data.id_column {id_column!r}) repeats "
                             f"{data.where(seen[item_id])}")
        seen[item_id] = i
        items.append(EvalItem(item_id, prompt, stem, {k: v for k, v in row.items() if k != prompt_column}))
    return items


def _nested(row: dict, path: str, what: str) -> Any:
    value, where = row, "the row"
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{what}, but {where} has no field {part!r}")
        value, where = value[part], part if where == "the row" else f"{where}.{part}"
    return value


def failure_lines(report: Mapping[str, Any]) -> list[str]:
    """Per reward that failed on some samples: how many, and the first reason."""
    counts: dict[str, list] = {}
    for item_id, item in report["items"].items():
        for k, sample in enumerate(item["samples"]):
            for name, error in (sample.get("reward_errors") or {}).items():
                counts.setdefault(name, [0, f"item {item_id} sample {k}: {error}"])[0] += 1
    total = report["counts"]["samples"]
    return [f"reward {name!r} failed on {count} of {total} samples, e.g. {first}"
            for name, (count, first) in counts.items()]
