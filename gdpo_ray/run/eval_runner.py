"""``evaluate``: a policy (or a file of completions) through a suite into a report.

Generation runs on rollout actors (``actors.rollout.RolloutActor.complete``, no rewards
attached) on Ray, scheduled by the same ``actors.rollout_group.RolloutGroup`` as training, so it
spreads over a cluster as training does: ``num_actors`` actors (or a run's own, during
training), each with ``calls_per_actor`` calls of ``prompts_per_call`` prompts in flight. Scoring
runs on this machine (``score``): in worker processes killed at an item's time limit, or, for
suites whose scorer waits on sandbox processes (``Suite.parallel_scoring``), on threads of this
process, code in the sandbox.

``POLICY`` may be a Hugging Face model directory (a run's ``policy/``), a run directory (its
``policy/``, or under LoRA its ``policy-merged/``), a PEFT LoRA adapter directory (merged into its
base model, ``merge_adapter``), a training checkpoint (its learners' weights exported into the run's base model,
``gdpo_ray.run.checkpoints.export_checkpoint_policy``), or a built-in model's name, as
``llm.model_path`` takes it (``demo``, ``demo-tools``, ``demo-count``, ``demo-agent``, ``tiny``, ``smollm2``: a
run's starting point, for a baseline). The model's files are shipped to actors on nodes
that cannot read its path (``gdpo_ray.model_files``).
A completions file (``read_completions``) replaces generation: one JSON object per line,
``{"id": <item id>, "completions": [str, ...]}``, optionally ``"tokens": [int, ...]`` and
``"finish_reasons": [...]`` (null, or a null entry: not known; unknown lengths come from
``tokenizer``, when one is given, and ``exceed_ratio`` is left out without one).
A sample whose scoring raises or hangs scores 0 with the reason in the report (``score``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from actors.engines import SamplingParams
from actors.rollout_group import RolloutGroup
from gdpo_ray import model_files
from gdpo_ray.config import default
from gdpo_ray.eval.pass_at_k import check_ks, parse_ks
from gdpo_ray.eval.report import build_report
from gdpo_ray.eval.suite import Completion, EvalItem, Suite, exceeds
from gdpo_ray.eval.time_limit import ScoringPool, ScoringTimeout, time_limit, timeout_reason
from gdpo_ray.run.judges import pool_for

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def resolve_policy(policy: str, base: str | None = None) -> str:
    """The model directory ``policy`` stands for (see the module docstring); ``base``: the base
    model of a LoRA adapter (default: the one its ``adapter_config.json`` names)."""
    if policy in model_files.BUILT_IN_MODELS:
        return str(model_files.resolve_model_path(policy))
    path = Path(policy).expanduser()
    for policy_dir in (path / "policy-merged", path / "policy"):  # a run directory (LoRA: merged)
        if (policy_dir / "config.json").is_file():
            return str(policy_dir)
    if (path / "policy" / "adapter_config.json").is_file():
        path = path / "policy"
    if (path / "adapter_config.json").is_file():
        return merge_adapter(path, base)
    if (path / "config.json").is_file():
        return str(path)
    if (path / "class_and_ctor_args.pkl").is_file():  # a training checkpoint: its policy exported
        import tempfile

        from gdpo_ray.run.checkpoints import export_checkpoint_policy

        return export_checkpoint_policy(str(path), tempfile.mkdtemp(prefix="gdpo-eval-policy-"))
    hub = model_files.hub_model(policy)
    if hub is not None:
        return str(hub)
    raise ValueError(f"policy {policy!r} is not a model directory (no config.json), a LoRA adapter "
                     f"directory (no adapter_config.json), a run directory (no policy/ in it), a "
                     f"training checkpoint, or one of {' | '.join(model_files.BUILT_IN_MODELS)}")


def merge_adapter(adapter: Path, base: str | None = None) -> str:
    """A PEFT adapter directory merged into its base model: a temporary Hugging Face model
    directory. ``base`` (a path or a model name such as ``smollm2``) must be the model the
    adapter was trained on: another one is refused, naming both."""
    import tempfile

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gdpo_ray.model_files import resolve_model_path, same_model

    trained_on = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if base is not None and trained_on and not same_model(resolve_model_path(base), trained_on):
        raise ValueError(f"the adapter {adapter} was trained on the base model {trained_on}, not on "
                         f"{base} (--base): evaluate it on its own base model (leave --base out), or "
                         f"evaluate an adapter trained on {base}")
    if base is None and not trained_on:
        raise ValueError(f"the adapter {adapter} does not name its base model (adapter_config.json's "
                         f"base_model_name_or_path): give it with --base MODEL")
    model_dir = resolve_model_path(base or trained_on)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"the adapter {adapter}'s base model {base or trained_on} is not a model "
                         f"directory here (no config.json): give its path with --base MODEL")
    out = tempfile.mkdtemp(prefix="gdpo-eval-merged-")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def read_completions(path: str, items: Sequence[EvalItem], tokenizer: Any = None,
                     suite_ids: Sequence[str] | None = None) -> dict[str, list[Completion]]:
    """Completions of ``items`` from a file (the module docstring's format), in their order;
    every line is checked and a bad one named (an id must be one of ``suite_ids``, by default
    the items'; lines of other suite items, e.g. past --limit, are left out). ``tokens`` and
    ``finish_reasons`` may be null, or hold nulls: those lengths and reasons are not known."""
    known = set(suite_ids) if suite_ids is not None else {it.id for it in items}
    by_id: dict[str, list[Completion]] = {}
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as err:
                raise ValueError(f"{where}: not JSON ({err})") from None
            texts = row.get("completions") if isinstance(row, dict) else None
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError(f'{where}: want {{"id": ..., "completions": [str, ...]}} with at least one string')
            item_id = str(row.get("id"))
            if item_id not in known:
                raise ValueError(f"{where}: id {item_id!r} is not an item of this suite "
                                 f"(ids look like {sorted(known)[:3]})")
            if item_id in by_id:
                raise ValueError(f"{where}: id {item_id!r} appears twice")
            unknown = [None] * len(texts)
            tokens = unknown if row.get("tokens") is None else row["tokens"]
            reasons = unknown if row.get("finish_reasons") is None else row["finish_reasons"]
            for name, values, valid, want in (
                    ("tokens", tokens, lambda v: type(v) is int and v >= 0, "an integer >= 0 or null"),
                    ("finish_reasons", reasons, lambda v: isinstance(v, str), 'a string ("stop", "length") or null')):
                if not isinstance(values, list) or len(values) != len(texts):
                    raise ValueError(f"{where}: {name} must be a list with one entry per completion")
                bad = next((i for i, v in enumerate(values) if v is not None and not valid(v)), None)
                if bad is not None:
                    raise ValueError(f"{where}: {name}[{bad}] must be {want}; got {values[bad]!r}")
            if tokenizer is not None:
                tokens = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) if n is None else n
                          for t, n in zip(texts, tokens)]
            by_id[item_id] = [Completion(*sample) for sample in zip(texts, tokens, reasons)]
    return {it.id: by_id[it.id] for it in items if it.id in by_id}


def generate(model_path: str | None, suite: Suite, items: Sequence[EvalItem], n: int, sampling: Mapping[str, Any],
             engine: str = "hf", engine_kwargs: Mapping[str, Any] | None = None, num_actors: int = 1,
             chat_template: bool = True, prompts_per_call: int = 8, calls_per_actor: int = 2,
             num_gpus_per_actor: float = 0, progress: bool = True, rollouts: RolloutGroup | None = None,
             max_prompt_tokens: int = 8192, system_prompt: str | None = None) -> dict[str, list[Completion]]:
    """n completions of every item, on ``rollouts`` (a run's rollout group, with its own
    template, prompt limit, tool environment and rewards) or on a group of ``num_actors`` new
    rollout actors set up as the ``suite`` says: multi-turn with the tools of its
    ``environment`` (each rollout's instance reset with the prompt and ``environment_row(item)``),
    scored by the actors with its ``rollout_rewards`` (as training scores a rollout);
    ``system_prompt`` before every prompt without one, as ``data.system_prompt`` in training. A
    prompt over ``max_prompt_tokens`` is not generated (its completions are empty, finish reason
    "prompt_too_long")."""
    from tqdm import tqdm

    own, environment, rewards = rollouts is None, suite.environment, suite.rollout_rewards
    judges = getattr(suite, "judges", {})
    pool = pool_for(rewards, judges) if own and rewards else None  # judges without url: served here
    try:
        if own:
            rollouts = RolloutGroup(
                dict(model_path=model_path, model_files=model_files.pack(model_path), rewards=rewards,
                     group_size=max(n, 2), engine=engine, engine_kwargs=dict(engine_kwargs or {}),
                     chat_template=chat_template, max_prompt_tokens=max_prompt_tokens, seed=0,
                     environment=environment, max_turns=suite.max_turns, system_prompt=system_prompt,
                     judges=pool.handles if pool is not None else None,
                     judge_batch_size=judges.get("judge_batch_size", default("judge_batch_size")),
                     **(suite.tool_settings if environment else {})),
                num_actors=num_actors, prompts=None, buffer=None, prompts_per_call=prompts_per_call,
                calls_per_actor=calls_per_actor, num_cpus=1, num_gpus=num_gpus_per_actor)
        bar = tqdm(total=len(items), desc="eval", unit="item", disable=not progress)
        try:
            rows = [suite.environment_row(it) for it in items] if environment or rewards else None
            samples = rollouts.complete([it.prompt for it in items], n, sampling, progress=bar.update, rows=rows,
                                        score=rewards is not None)
        finally:
            bar.close()
            if own:
                rollouts.shutdown()
    finally:
        if pool is not None:
            pool.shutdown()
    return {it.id: list(done) for it, done in zip(items, samples)}


#: the longest one sample's scoring may take: far above the scorers' own limits (math-verify's
#: 5 s per parse, a sandbox call's ``Limits.total_s``), so past it the scorer hangs
SAMPLE_TIMEOUT_S = 300.0
#: a task of scoring: (key, item, its samples); a key is (item id, None) for the whole item or
#: (item id, sample index) for one sample
_Task = tuple[tuple[str, int | None], EvalItem, Sequence[Completion]]
#: how a task ended: (its values, None) or (None, why it has none)
_Outcome = tuple[list[dict] | None, str | None]


def score(suite: Suite, items: Sequence[EvalItem], completions: Mapping[str, Sequence[Completion]],
          score_threads: int | None = None, progress: bool = True) -> dict[str, list[dict]]:
    """Item id -> its samples, each the completion (text, tokens, finish reason) and its metrics.

    Where: a suite whose scorer waits on sandbox processes (``Suite.parallel_scoring``: the
    model's programs run there, under the sandbox's limits) is scored in this process, on
    ``score_threads`` threads (default: up to 4); any other in ``score_threads`` worker processes
    (``gdpo_ray.eval.time_limit.ScoringPool``), since what its scorer runs follows from the
    completion (BFCL's tool calls, sympy) and C code that holds the GIL stops only with its
    process: a worker whose item runs past its limit is killed and replaced.

    No completion stops the eval: when scoring an item raises, dies or runs past
    ``SAMPLE_TIMEOUT_S`` per sample, its samples are scored one by one (an item of one sample is
    not scored again), and a sample whose scoring still fails scores 0 on every metric
    (``exceed_ratio`` still from its length) with the reason under ``error``
    (``timeout: scoring took over 300 s`` for a timeout); its siblings keep their scores."""
    from tqdm import tqdm

    todo = [it for it in items if it.id in completions]
    outcomes: dict[tuple[str, int | None], _Outcome] = {}
    with tqdm(total=len(todo), desc="score", unit="item", disable=not progress) as bar, \
            _scorer(suite, score_threads or min(4, os.cpu_count() or 1)) as run:
        for key, outcome in run([((it.id, None), it, completions[it.id]) for it in todo]):
            outcomes[key] = outcome
            if outcome[0] is not None or len(completions[key[0]]) == 1:
                bar.update()
        again = [((it.id, k), it, [c]) for it in todo if outcomes[(it.id, None)][0] is None
                 and len(completions[it.id]) > 1 for k, c in enumerate(completions[it.id])]
        left = collections.Counter(item_id for (item_id, _), _, _ in again)
        for key, outcome in run(again):
            outcomes[key] = outcome
            left[key[0]] -= 1
            if not left[key[0]]:
                bar.update()
    return {it.id: _samples(suite, it, completions[it.id], outcomes) for it in todo}


def _samples(suite: Suite, it: EvalItem, samples: Sequence[Completion],
             outcomes: Mapping[tuple[str, int | None], _Outcome]) -> list[dict]:
    """The report's samples of an item: each completion with its metrics, or its failure's."""
    values, failure = outcomes[(it.id, None)]
    if values is None and len(samples) == 1:
        values = [_failed(suite, samples[0], failure)]
    elif values is None:
        values = [one[0] if one is not None else _failed(suite, c, why)
                  for c, (one, why) in ((c, outcomes[(it.id, k)]) for k, c in enumerate(samples))]
    return [{"completion": c.text, "tokens": c.tokens, "finish_reason": c.finish_reason,
             **({"messages": c.messages} if c.messages is not None else {}), **v}
            for c, v in zip(samples, values)]


def _failed(suite: Suite, c: Completion, reason: str) -> dict:
    zero = {m: 0.0 for m in suite.metrics}
    if "exceed_ratio" in zero:
        zero["exceed_ratio"] = exceeds(c, suite.length_limit)
    return {**zero, "error": reason}


@contextlib.contextmanager
def _scorer(suite: Suite, workers: int) -> Iterator[Callable[[Sequence[_Task]], Iterator]]:
    """``run(tasks)``: yields ``(key, outcome)`` of each task as it ends, in worker processes or
    on threads here, as ``score`` says. A suite that cannot be pickled to a worker is scored
    here, one item at a time (a warning says why)."""
    if suite.parallel_scoring:
        yield functools.partial(_run_here, suite, workers)
        return
    try:
        pool = ScoringPool(Suite.scored, suite, workers, modules=[type(suite).__module__])
    except Exception as err:  # noqa: BLE001 - pickling a suite can fail in many ways
        logger.warning("suite %s cannot be sent to a scoring process (%s: %s): it is scored in this "
                       "process, where a scorer stuck in C code cannot be stopped", suite.name,
                       type(err).__name__, err)
        yield functools.partial(_run_here, suite, 1)
        return
    with pool:
        yield functools.partial(_run_in, pool)


def _run_in(pool: ScoringPool, tasks: Sequence[_Task]) -> Iterator[tuple[Any, _Outcome]]:
    for key, it, samples in tasks:
        pool.submit(key, (it, samples), SAMPLE_TIMEOUT_S * len(samples))
    for key, values, failure in pool.results():
        yield key, (values, failure)


def _run_here(suite: Suite, threads: int, tasks: Sequence[_Task]) -> Iterator[tuple[Any, _Outcome]]:
    if threads == 1:
        yield from ((task[0], _attempt(suite, task)) for task in tasks)
        return
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        yield from zip((task[0] for task in tasks), pool.map(functools.partial(_attempt, suite), tasks))


def _attempt(suite: Suite, task: _Task) -> _Outcome:
    """A task scored in this process, under ``time_limit`` (which bounds only the main thread)."""
    _, it, samples = task
    limit = SAMPLE_TIMEOUT_S * len(samples)
    try:
        with time_limit(limit):
            return suite.scored(it, samples), None
    except ScoringTimeout:
        return None, timeout_reason(limit)
    except Exception as err:  # noqa: BLE001 - any failure of the scorer is the sample's 0
        return None, f"{type(err).__name__}: {err}"


def evaluate(suite: Suite, policy: str | None = None, completions_file: str | None = None,
             samples: int = 1, temperature: float = 0.6, top_p: float = 0.95, max_tokens: int | None = None,
             limit: int | None = None, engine: str = "hf", engine_kwargs: Mapping[str, Any] | None = None,
             num_actors: int = 1, chat_template: bool = True, tokenizer: str | None = None,
             progress: bool = True, rollouts: RolloutGroup | None = None, label: str | None = None,
             max_prompt_tokens: int = 8192, pass_k: Sequence[int] | None = None,
             system_prompt: str | None = None) -> dict:
    """The report of ``suite`` for ``policy`` (generated on new rollout actors), for the policy
    of ``rollouts`` (a run's rollout group, during training) or for ``completions_file``; with
    ``pass_k`` (ks, each at most ``samples``, or at most each item's completions in the file)
    its pass@k too (``gdpo_ray.eval.pass_at_k``)."""
    if (policy is None) == (completions_file is None) and rollouts is None:
        raise ValueError("evaluate needs a policy to generate with or a completions file (--completions), not both")
    if samples < 1:
        raise ValueError(f"--samples must be >= 1; got {samples}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1; got {limit}")
    pass_k = check_pass_k(suite, pass_k or (), None if completions_file is not None else samples)
    items = suite.items()[:limit]
    max_tokens = max_tokens or suite.max_tokens
    settings = {"samples": samples, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens,
                "length_limit": suite.length_limit, "limit": limit, "items": len(items)}
    if pass_k:
        settings["pass_k"] = list(pass_k)
    if suite.correct:
        settings["correct"] = [str(c) for c in suite.correct]
    if suite.training_prompts_left_out:
        settings["training_prompts_left_out"] = suite.training_prompts_left_out
    settings |= suite.report_settings()
    if completions_file is not None:
        tok = None
        if tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(resolve_policy(tokenizer))
        found = read_completions(completions_file, items, tok, [it.id for it in suite.all_items()])
        missing = len(items) - len(found)
        if not found:
            raise ValueError(f"{completions_file}: no completions of this suite's items")
        if pass_k:
            item_id, fewest = min(((i, len(c)) for i, c in found.items()), key=lambda pair: pair[1])
            check_ks(pass_k, fewest, "--pass-k", f"the number of completions of item {item_id} in {completions_file}")
        per_item = sorted({len(c) for c in found.values()})  # the file's, not --samples
        settings |= {"samples": per_item[0] if len(per_item) == 1 else f"{per_item[0]}-{per_item[-1]}",
                     "temperature": None, "top_p": None, "max_tokens": None,  # not known: the file's
                     "completions": str(completions_file), "items_missing": missing}
        completions, source = found, str(completions_file)
    else:
        sampling = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        SamplingParams(**sampling)  # bad sampling fails before any actor starts
        model = resolve_policy(policy) if policy is not None else None
        own = rollouts is None  # else the run's rollout actors: their engine, template and prompt limit
        settings |= {"engine": engine if own else None, "chat_template": chat_template if own else None,
                     "max_prompt_tokens": max_prompt_tokens if own else None,
                     "system_prompt": (system_prompt or "") if own else None}
        completions = generate(model, suite, items, samples, sampling, engine=engine, engine_kwargs=engine_kwargs,
                               num_actors=num_actors, chat_template=chat_template, progress=progress,
                               rollouts=rollouts, max_prompt_tokens=max_prompt_tokens, system_prompt=system_prompt)
        source = str(policy) if policy is not None else "rollout actors"
    scored = score(suite, items, completions, progress=progress)
    return build_report(suite, scored, {it.id: it.category for it in items}, label or source, settings, pass_k)


def check_pass_k(suite: Suite, pass_k: Any, samples: int | None) -> tuple[int, ...]:
    """The ks of ``--pass-k`` (a list, or "1,4,16"), checked before any actor starts: integers
    >= 1, at most ``samples`` (None: a completions file's, checked per item once read), of a
    suite that has a correct metric."""
    if not pass_k:
        return ()
    ks = parse_ks(pass_k, "--pass-k")
    if samples is not None:
        check_ks(ks, samples, "--pass-k", "--samples")
    if suite.correct_metric() is None:
        raise ValueError(f"--pass-k: suite {suite.name} reports neither pass@1 nor accuracy (its metrics: "
                         f"{', '.join(suite.metrics)}), so no sample counts as correct; say which do with "
                         f"--correct 'NAME>=VALUE' (e.g. --correct '{suite.metrics[0]}>=1'), or leave --pass-k out")
    return ks


def evaluate_during_training(suite: Suite, rollouts: RolloutGroup, version: int, **settings: Any) -> dict | None:
    """``evaluate`` of the policy ``version`` of a run's rollout group (``GDPO.evaluate_policy``),
    its report's ``step`` that version; None when it failed (logged: training goes on)."""
    try:
        report = evaluate(suite, rollouts=rollouts, progress=False, label=f"policy version {version}", **settings)
    except Exception as err:  # noqa: BLE001 - an actor died mid-eval, a suite's scorer failed
        logger.warning("eval of %s at policy version %d failed (%s: %s); training goes on",
                       suite.name, version, type(err).__name__, err)
        return None
    report["step"] = version
    return report
