"""The start-up checks: what a run needs, verified in seconds, before any actor starts.

``preflight(config)`` (``gdpo-ray check`` runs it alone; ``gdpo-ray train`` and ``GDPO.setup``
run it first) checks, each failure a ``ValueError`` naming the setting, file or line and the fix:

1. the model: demo | tiny | smollm2, a local Hugging Face directory (with config.json), or a
   hub name already in the local Hugging Face cache; with ``llm.lora``, every name of its
   ``target_modules`` is a linear layer of the model (built from its config, no weights read);
2. the dataset, read in full (``gdpo_ray.data``): prompts, ids, nested columns;
3. the rewards: resolved (imports, params), and every column a reward's signature requires is
   in the dataset and not null in any row;
4. a few real rows scored with every reward, in the reward pool as in training, on placeholder
   completions (an empty one and the row's ground truth as the answer): a reward that raises
   on all of them (a signature that does not fit the call, a column it reads that is missing,
   a crash on any text) stops the run with its error; partial failures, timeouts and
   infrastructure failures (no code sandbox here) are warnings;
5. with a tool environment, the names its rewards give, read on the first row right after
   ``reset``, are the declared ``fn: environment`` columns (``check_environment_columns``).

A config that passed is remembered for the process, so the run's setup does not check it twice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Sequence

from gdpo_ray.model_files import BUILT_IN_MODELS
from gdpo_ray.run import judges
from gdpo_ray.run.placement import check_placement

#: dataset rows scored on placeholders at start-up
SAMPLE_ROWS = 4

_PASSED: set[str] = set()
logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Report:
    rows: int  # dataset rows
    columns: list[str]  # the columns rewards are given
    names: list[str]  # the rewards
    weights: list[float]
    placeholders: list[str]  # what the sample completions were
    scores: list[list[float]]  # [reward][placeholder] mean over the sample rows (NaN: none)
    failed: list[str]  # per reward: "f/n" failed sample calls
    warnings: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)  # what the run does that the config did not say

    def table(self) -> str:
        head = f"{'reward':<20} {'weight':>6} " + " ".join(f"{p:>14}" for p in self.placeholders)
        lines = [head + f" {'failed':>8}"]
        for name, w, row, failed in zip(self.names, self.weights, self.scores, self.failed):
            lines.append(f"{name:<20} {w:>6g} " + " ".join(f"{v:>14.3f}" for v in row) + f" {failed:>8}")
        return "\n".join(lines)


def fingerprint(config: Any) -> str:
    from gdpo_ray.config import FIELDS, RLLIB_FIELDS

    return json.dumps({k: getattr(config, k, None) for k in [*FIELDS, *RLLIB_FIELDS]},
                      sort_keys=True, default=repr)


def ensure(config: Any) -> Report | None:
    """Before a run's first actor starts: ``preflight`` unless an equal config passed it in this
    process, then whether the cluster can hold the actors (``placement.check_placement``)."""
    report = None if fingerprint(config) in _PASSED else preflight(config)
    warning = check_placement(config)
    if warning:
        logger.warning(warning)
    return report


def preflight(config: Any, sample_rows: int = SAMPLE_ROWS) -> Report:
    from actors.prompts import PromptSource
    from gdpo_ray.data import check_column_types, load_prompts
    from gdpo_ray.rewards import ROLLOUT_COLUMNS, check_specs, reward_specs, required_columns, takes_environments

    c = config
    check_model(c.model_path)
    check_lora(c)
    check_context(c)
    tools_said = check_tool_template(c)
    source = PromptSource(load_prompts(c.prompts, c.num_prompts, c.seed or 0),
                          prompt_column=c.prompt_column, id_column=c.id_column,
                          seed=c.seed or 0, columns=dict(c.columns))
    check_column_types(source.rows, source.columns, source.dataset.where)
    check_environment_rows(c, source)
    specs = reward_specs(c.rewards)
    fns = check_specs(specs)
    available = [*source.columns, *ROLLOUT_COLUMNS]
    judges.check_columns(c, available, source.dataset.source)
    for spec, fn in zip(specs, fns):
        for column in required_columns(fn) if fn is not None else ():  # None: an environment's column
            if column not in available:
                raise ValueError(
                    f"reward {spec.name!r} needs column {column!r} (a parameter of "
                    f"{getattr(fn, '__name__', 'its function')} without a default), which "
                    f"{source.dataset.source} does not have; its columns: {source.columns}. Add "
                    f"the column, take it from a nested field with data.columns={{{column}: "
                    f"<column>.<field>}}, or give the parameter a default")
            if column in ROLLOUT_COLUMNS:
                continue
            empty = next((i for i, r in enumerate(source.rows) if r[column] is None), None)
            if empty is not None:
                raise ValueError(f"reward {spec.name!r} needs column {column!r}, which is empty "
                                 f"(null or missing) at {source.dataset.where(empty)}; give every "
                                 f"row a value")
    rollout_only = {s.name for s, fn in zip(specs, fns) if fn is None or takes_environments(fn)}
    report = _score_samples(specs, source, available, sample_rows, rollout_only)
    report.weights = [s.weight for s in specs]
    columns_said = check_environment_columns(c, source, specs)
    report.warnings[:0] = tools_said["warnings"] + judges.probe_endpoints(c)
    report.notes = tools_said["notes"] + columns_said + learner_notes(c)
    _PASSED.add(fingerprint(c))
    return report


def check_model(spec: Any) -> None:
    from gdpo_ray.model_files import HUB_NAMES, check_available, hub_model

    if spec in BUILT_IN_MODELS:
        check_available(spec)
        return
    built_in = next((name for name, hub in HUB_NAMES.items() if hub == spec), None)
    if built_in is not None:  # a built-in's hub name: the hub's copy where it is cached, else ours
        try:
            hub_model(spec)
        except ValueError:
            check_available(built_in)
        return
    path = Path(str(spec)).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"llm.model_path {spec!r} has no config.json: not a Hugging Face model "
                             f"directory (write one with model.save_pretrained(dir) and "
                             f"tokenizer.save_pretrained(dir))")
        return
    if path.exists():
        raise ValueError(f"llm.model_path {spec!r} is a file; give the model's directory")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(spec)):
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(str(spec), "config.json"), str):
            return
        raise ValueError(f"llm.model_path {spec!r} is not a local directory nor a model in the "
                         f"Hugging Face cache; download it first (huggingface-cli download {spec} "
                         f"--local-dir models/{str(spec).split('/')[-1]}) and give that directory, "
                         f"or use one of {', '.join(BUILT_IN_MODELS)}")
    raise ValueError(f"llm.model_path {spec!r} does not exist; give a Hugging Face model directory "
                     f"(with config.json), a hub name in the local cache, or one of "
                     f"{', '.join(BUILT_IN_MODELS)}")


def check_lora(c: Any) -> None:
    """``llm.lora`` (checked and normalized by ``validation.check``) targets modules the model has."""
    from gdpo_ray.lora import check_target_modules
    from gdpo_ray.model_files import resolve_model_path

    if c.lora is not None:
        check_target_modules(c.lora, resolve_model_path(c.model_path))


def learner_notes(c: Any) -> list[str]:
    """What the learners do that the config does not say: under ``learners.backend=fsdp2``,
    ``training.zero_stage`` (a DeepSpeed setting, 2 in the presets) does not apply."""
    if c.backend != "fsdp2":
        return []
    return [f"learners.backend=fsdp2: training.zero_stage ({c.zero_stage}) does not apply; FSDP2 shards "
            f"parameters, gradients and optimizer state over the {max(1, c.num_learners)} learner(s) "
            f"(ZeRO-3's layout), gathering each layer's weights for its forward and backward"]


def check_environment_rows(c: Any, source: Any) -> None:
    """In TRL's dict form of ``data.tool_environment``, every row names one of its classes in its
    ``environment`` column (the first that does not is named)."""
    from gdpo_ray.environments.spec import ROW_COLUMN

    if not isinstance(c.tool_environment, dict):
        return
    names = sorted(c.tool_environment)
    if ROW_COLUMN not in source.columns:
        raise ValueError(f"data.tool_environment is a mapping ({', '.join(names)}): each row names its "
                         f"class in an {ROW_COLUMN!r} column, which {source.dataset.source} does not have "
                         f"(its columns: {source.columns})")
    bad = next((i for i, r in enumerate(source.rows) if r.get(ROW_COLUMN) not in c.tool_environment), None)
    if bad is not None:
        raise ValueError(f"{source.dataset.where(bad)}: {ROW_COLUMN} is {source.rows[bad].get(ROW_COLUMN)!r}, "
                         f"not one of data.tool_environment's {names}")


def check_environment_columns(c: Any, source: Any, specs: Sequence[Any]) -> list[str]:
    """With ``data.tool_environment``: the names each class's rewards give for its first row, read
    right after ``reset`` (before any tool call) in a process of its own, are the declared ``fn:
    environment`` columns (in TRL's dict form: within them), else a ``SchemaError`` naming both
    (``gdpo_ray.environments.columns``). Where they cannot be read so (a reward that needs a
    tool call, a row that does not reset), a note: the first rollout checks them."""
    if c.tool_environment is None:
        return []
    from actors.tool_loop import preloaded_modules
    from gdpo_ray.environments.columns import Schema
    from gdpo_ray.environments.process import probe
    from gdpo_ray.environments.spec import ROW_COLUMN, environment_paths, load_environment
    from gdpo_ray.forks import fork_context

    declared = [s.name for s in specs if s.from_environment]
    paths = environment_paths(c.tool_environment)
    schema, notes, ctx = Schema(declared, partial=None not in paths), [], None
    for name, path in paths.items():
        spec = load_environment(path, c.tool_timeout)
        first = next((i for i, r in enumerate(source.rows) if name is None or r.get(ROW_COLUMN) == name), None)
        if spec.reward_getter is None or not declared or first is None:
            continue
        prompt = source.first(first + 1)[first]
        row = {k: v for k, v in {"prompt": prompt.prompt, **prompt.columns}.items() if name is None or k != ROW_COLUMN}
        ctx = ctx or fork_context(preloaded_modules(c.tool_environment))
        keys, why = probe(spec, row, declared, c.tool_timeout, ctx, partial=name)
        if keys is None:
            notes.append(f"environment {spec.cls.__name__}: the columns its rewards give could not be read "
                         f"before any tool call ({why}); the first rollout checks them")
            continue
        schema.check(spec.cls.__name__, keys, f"{source.dataset.where(first)}, reset and scored before any "
                                              "tool call by the start-up check")
    return notes


def check_tool_template(c: Any) -> dict[str, list[str]]:
    """With ``data.tool_environment``, the model's chat template writes a tool turn after an
    assistant turn and keeps the conversation's prefix (``gdpo_ray.environments.tool_turns.ToolTurns``), as
    every multi-turn rollout needs; and where the model is shown the tools
    (``data.tools_in_system_prompt``): {"notes": [...], "warnings": [...]} to say once."""
    said: dict[str, list[str]] = {"notes": [], "warnings": []}
    if c.tool_environment is None:
        return said
    from transformers import AutoTokenizer

    from gdpo_ray.environments.tool_prompt import template_lists_tools
    from gdpo_ray.environments.tool_turns import ToolTurns
    from gdpo_ray.model_files import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(c.model_path))
    try:
        ToolTurns(tokenizer).ids([("probe", "an answer")])
    except Exception as err:  # noqa: BLE001 - the template's own error, with the setting that needs it
        raise ValueError(f"data.tool_environment: the chat template of {c.model_path!r} cannot write "
                         f"a tool turn ({type(err).__name__}: {err}); multi-turn rollouts need a template "
                         "with a tool role that keeps the conversation's prefix") from err
    if template_lists_tools(tokenizer):
        if c.tools_in_system_prompt == "always":
            said["notes"].append("the tools are written into the system message "
                                 "(data.tools_in_system_prompt: always), not by the chat template")
            _check_tools_fit(c, tokenizer)
        return said
    where = f"the chat template of {c.model_path!r} does not list the tools it is given (tools=)"
    if c.tools_in_system_prompt == "never":
        _render_with_tools(c, tokenizer)
        said["warnings"].append(f"data.tool_environment: {where}, and data.tools_in_system_prompt is never: "
                                "the model sees no tool names or schemas, only what the prompts say; set "
                                "data.tools_in_system_prompt=auto to write them into the system message")
    else:
        said["notes"].append(f"{where}: the tools and the <tool_call> format are written into the "
                             f"system message (data.tools_in_system_prompt: {c.tools_in_system_prompt}; "
                             "gdpo-ray check --show-prompts 1 shows a prompt as the model sees it)")
        _check_tools_fit(c, tokenizer)
    return said


def _check_tools_fit(c: Any, tokenizer: Any) -> None:
    """The tools written into the system message leave room for a prompt within
    ``llm.max_prompt_tokens`` (else every prompt would be filtered as too long)."""
    from gdpo_ray.environments.spec import environment_paths, load_environment
    from gdpo_ray.environments.tool_prompt import render_prompt

    for path in environment_paths(c.tool_environment).values():
        schemas = load_environment(path).schemas  # none where the tools are per row
        if not schemas:
            continue
        text = render_prompt(tokenizer, "", c.system_prompt, schemas, tools_in_system=True)
        overhead = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if overhead >= c.max_prompt_tokens:
            raise ValueError(
                f"data.tool_environment: the tools of {path} written into the system message (the chat "
                f"template of {c.model_path!r} ignores tools=) take {overhead} tokens, and "
                f"llm.max_prompt_tokens is {c.max_prompt_tokens}: every prompt would be filtered as too "
                f"long. Raise llm.max_prompt_tokens above {overhead} plus your prompts' length, give the "
                f"model a chat template that lists tools, or set data.tools_in_system_prompt=never")


def _render_with_tools(c: Any, tokenizer: Any) -> None:
    from gdpo_ray.environments.tool_prompt import render_probe

    try:
        render_probe(tokenizer)
    except Exception as err:  # noqa: BLE001 - every rollout's prompt is rendered with tools= like this
        raise ValueError(f"data.tool_environment: the chat template of {c.model_path!r} cannot render a "
                         f"prompt with tools ({type(err).__name__}: {err}), and data.tools_in_system_prompt "
                         "is never: set it to auto (the tools then go into the system message)") from err


def context_length(spec: Any) -> int | None:
    """The model's context length (positions), where its config says it (None: unknown)."""
    if spec in BUILT_IN_MODELS and spec != "smollm2":
        from gdpo_ray.models.tiny import MAX_POSITIONS

        return MAX_POSITIONS
    config = Path(str(spec)).expanduser() / "config.json"
    if not config.is_file():
        return None
    values = json.loads(config.read_text())
    values |= values.get("text_config") or {}
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(values.get(key), int):
            return values[key]
    return None


def check_context(c: Any) -> None:
    """A prompt of max_prompt_tokens and a response of max_tokens fit in the model (a simulated
    engine's model is the timing model's, which has no positions to run out of)."""
    from actors.engines import engine_class, generation_mode, traits_of

    if traits_of(engine_class(c.engine, generation_mode(c.engine, c.mode))).simulated:
        return
    positions = context_length(c.model_path)
    if positions is not None and c.max_prompt_tokens + c.max_tokens > positions:
        raise ValueError(
            f"llm.max_prompt_tokens ({c.max_prompt_tokens}) + generation.max_tokens "
            f"({c.max_tokens}) = {c.max_prompt_tokens + c.max_tokens} tokens exceed the model's "
            f"context length ({positions} positions, llm.model_path {c.model_path!r}); lower "
            f"them so that they sum to at most {positions} (longer prompts are filtered, not "
            f"truncated)")


def _placeholders(prompt) -> list[tuple[str, str]]:
    truth = prompt.columns.get("ground_truth")
    gold = str(truth) if isinstance(truth, (str, int, float)) else "The answer is 42."
    return [("empty", ""), ("ground_truth" if truth is not None else "text", gold)]


def _hint(error: str, columns: Sequence[str]) -> str:
    if "TypeError" in error and "argument" in error:
        return (f"Its signature does not fit the call: rewards are called with keywords, "
                f"prompts=, completions=, completion_ids= and the columns {list(columns)}; write "
                f"it as def f(completions, **kwargs) (TRL's form) or name only what it needs")
    if error.startswith("error: KeyError"):
        return f"It reads a key that is missing; the columns it is given: {list(columns)}"
    return ("A reward must return a number (or None where it cannot score) for any completion, "
            "the empty one included")


def _score_samples(specs, source, columns: Sequence[str], n: int, rollout_only: set = frozenset()) -> Report:
    """Scores placeholder completions of the first rows with every reward but ``rollout_only``
    (an environment's columns and the rewards that read its instances: only real rollouts
    have them)."""
    import numpy as np

    from gdpo_ray.rewards import failure_kind

    prompts = source.first(n)
    kinds = [k for k, _ in _placeholders(prompts[0])]
    inputs, rows_columns = [], {c: [] for c in source.columns}
    for p in prompts:
        for _, text in _placeholders(p):
            chat = not isinstance(p.prompt, str)
            inputs.append((p.prompt, [{"role": "assistant", "content": text}] if chat else text,
                           list(text.encode())))
            for c in source.columns:
                rows_columns[c].append(p.columns[c])
    rows_columns["response_length"] = [len(ids) for _, _, ids in inputs]
    scored = _score_apart(specs, [i[0] for i in inputs], [i[1] for i in inputs], rows_columns,
                          [i[2] for i in inputs])
    m, warnings, failed = len(inputs), [], []
    for k, spec in enumerate(specs):
        errors = [row[k] for row in scored.errors]
        bad = [e for e in errors if e]
        failed.append("rollouts" if spec.name in rollout_only else f"{len(bad)}/{m}")
        if not bad or spec.name in rollout_only:
            continue
        if len(bad) == m and all(failure_kind(e) == "error" for e in bad):
            raise ValueError(
                f"reward {spec.name!r} failed on every sample: {m} placeholder completions "
                f"({', '.join(map(repr, kinds))}) of the first {len(prompts)} rows of "
                f"{source.dataset.source}; its error: {bad[0]}. {_hint(bad[0], columns)}")
        warnings.append(f"reward {spec.name!r} failed on {len(bad)} of {m} sample completions "
                        f"(placeholders {', '.join(kinds)}): {bad[0]}")
    values = scored.values.reshape(len(prompts), len(kinds), len(specs))
    with np.errstate(invalid="ignore"):
        means = [[_nanmean(values[:, j, k]) for j in range(len(kinds))] for k in range(len(specs))]
    return Report(rows=len(source), columns=list(columns), names=[s.name for s in specs],
                  weights=[], placeholders=kinds, scores=means, failed=failed, warnings=warnings)


def _score_apart(specs, prompts, completions, columns, completion_ids):
    """Scores in a RewardPool started by a fresh interpreter: the pool's workers re-import the
    ``__main__`` of the process that starts them, and here that may be a user's script without
    an ``if __name__ == "__main__"`` guard (it would run again in every worker)."""
    import subprocess
    import sys

    import cloudpickle

    payload = cloudpickle.dumps((list(sys.path), specs, prompts, completions, columns, completion_ids))
    done = subprocess.run([sys.executable, "-c", "from gdpo_ray.run.preflight import _score_child; "
                           "_score_child()"], input=payload, capture_output=True)
    if done.returncode != 0:
        raise ValueError("the start-up check could not score the rewards: "
                         + done.stderr.decode(errors="replace").strip()[-1500:])
    return cloudpickle.loads(done.stdout)


def _score_child() -> None:
    import sys

    import cloudpickle

    path, specs, prompts, completions, columns, completion_ids = cloudpickle.loads(sys.stdin.buffer.read())
    sys.path[:] = path
    from actors.reward import RewardPool

    with RewardPool(specs, num_workers=1) as pool:
        scored = pool.score(prompts, completions, columns, completion_ids=completion_ids)
    sys.stdout.buffer.write(cloudpickle.dumps(scored))


def _nanmean(x) -> float:
    valid = [float(v) for v in x if not math.isnan(v)]
    return sum(valid) / len(valid) if valid else math.nan
