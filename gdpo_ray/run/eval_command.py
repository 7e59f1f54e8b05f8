"""``gdpo-ray eval``: the command line of ``gdpo_ray.run.eval_runner.evaluate`` and ``report.compare``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DESCRIPTION = """\
Evaluate POLICY (a model directory such as a run's policy/, a run directory, a LoRA adapter
directory, a training checkpoint, or 'demo') on a suite, as the paper evaluates: n samples per item at temperature 0.6 / top-p 0.95 by default,
avg@n of each metric (--pass-k 1,4,16: pass@k too). Or score a file of completions (--completions FILE.jsonl: one
{"id": ..., "completions": [...]} per line) without a model. --suite rewards:FILE scores held-out
prompts with a run's own reward functions (--rewards CONFIG, or POLICY's run directory). Writes a JSON report (--output;
default: eval/<suite>.json in the run directory, or in the current folder) and prints a table.
--correct 'NAME>=VALUE' (repeatable) defines a correct sample from the suite's metrics (e.g. a
reward column): accuracy, NAME/pass_rate and pass@k are then reported. With a tool environment in
the rewards' config, each held-out row runs through the same multi-turn loop as training, and
every column is scored as training scores it, the environment's own included.
With --compare, prints the reports already written side by side (report files, or run directories:
their eval/*.json and the in-training evals of their metrics.jsonl), one table per suite: a row per
metric (each reward column's mean first, then the pass rates), a column per run and checkpoint;
--correct 'NAME>=VALUE' there recomputes NAME/pass_rate from each report's samples. Then each
report's settings, and one line per setting that differs between them. Evaluating a training
checkpoint writes its report beside the run's others (eval/<suite>@step_<N>.json), so --compare
shows it as that step's column."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("eval", help="evaluate a policy on a suite (BFCL, HumanEval, math, tasks)",
                            description=DESCRIPTION,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("policy", nargs="?", help="model directory, run directory or 'demo'")
    p.add_argument("--suite", help="task:<name>, math:<path>, humaneval, bfcl, bfcl:<category>, rewards:<path>")
    p.add_argument("--rewards", metavar="CONFIG", help="with --suite rewards:FILE: the config whose "
                   "training.rewards score (a preset, a YAML file or a run directory; default: POLICY's run)")
    p.add_argument("--base", metavar="MODEL", help="a LoRA adapter's base model (default: the one "
                   "its adapter_config.json names; another model is refused)")
    p.add_argument("--completions", metavar="FILE", help="score these completions (no model)")
    p.add_argument("--tokenizer", help="with --completions: count response tokens with this "
                   "model's tokenizer (for exceed_ratio)")
    p.add_argument("--limit", type=int, help="the first N items of the suite")
    p.add_argument("--samples", type=int, default=1, help="completions per item (n of avg@n; default 1)")
    p.add_argument("--pass-k", metavar="K,K,...", help="also report pass@k for these k, e.g. 1,4,16 "
                   "(Chen et al.'s unbiased estimator from the n samples; each k <= --samples)")
    p.add_argument("--correct", action="append", metavar="NAME>=VALUE", help="a sample is correct when "
                   "this holds of its metric NAME (a reward column; repeatable: all must hold); adds "
                   "accuracy, NAME/pass_rate and makes --pass-k count it (ops: >=, >, <=, <, ==)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, help="new tokens per completion (default: the suite's)")
    p.add_argument("--length-limit", type=int, help="exceed_ratio's limit in tokens (default: the suite's)")
    p.add_argument("--engine", default="hf", help="hf, vllm or package.module:Class of a batch engine (default hf)")
    p.add_argument("--engine-kwargs", default="{}", help='JSON, e.g. \'{"dtype": "float32"}\'')
    p.add_argument("--num-actors", type=int, default=1, help="rollout actors generating (default 1)")
    p.add_argument("--max-prompt-tokens", type=int, default=8192,
                   help="longer prompts are not generated: empty completions, counted (default 8192)")
    p.add_argument("--no-chat-template", action="store_true", help="prompts as plain text (default: "
                   "the template, unless the rewards' config sets llm.chat_template false)")
    p.add_argument("--system-prompt", metavar="TEXT", help="a system message before every prompt without "
                   "one (default: data.system_prompt of the --rewards config, else of POLICY's run; '' for none)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--output", help="the report's path")
    p.add_argument("--compare", nargs="+", metavar="RUN", help="print the tables of these runs' reports "
                   "(report files, or run directories: every checkpoint evaluated; with --correct, its pass rates)")
    p.add_argument("--json", action="store_true", help="print the report's overall section as JSON")
    p.set_defaults(run=run)


#: the numeric options: attribute -> (option, the field whose bounds it takes from ``gdpo_ray.config``
#: or its own lower bound, what it is); an option not given (None) is not checked
OPTIONS = {"samples": ("--samples", "eval_samples", "completions per item"),
           "limit": ("--limit", "eval_limit", "the suite's first N items"),
           "temperature": ("--temperature", "temperature", "logits / temperature"),
           "top_p": ("--top-p", "top_p", "the nucleus' probability mass"),
           "max_tokens": ("--max-tokens", "max_tokens", "new tokens per completion"),
           "length_limit": ("--length-limit", "eval_length_limit", "exceed_ratio's limit in tokens"),
           "max_prompt_tokens": ("--max-prompt-tokens", "max_prompt_tokens", "the longest prompt generated"),
           "num_actors": ("--num-actors", 1, "rollout actors"),
           "num_cpus": ("--num-cpus", 1, "CPUs of the local Ray")}


def check_options(args: argparse.Namespace) -> dict:
    """Every option in its range, whether or not this evaluation uses it (``--max-tokens -5``
    beside ``--completions`` is a mistake all the same): a ValueError naming the option, the
    value and the range. Returns ``--engine-kwargs`` read (a JSON object)."""
    import math

    from gdpo_ray.config import FIELDS
    from gdpo_ray.eval.pass_at_k import check_ks, parse_ks

    for attribute, (option, rule, what) in OPTIONS.items():
        value = getattr(args, attribute, None)
        if value is None:
            continue
        field = FIELDS.get(rule) if isinstance(rule, str) else None
        low, above, high = (field.at_least, field.above, field.at_most) if field else (rule, None, None)
        kind = "an integer" if isinstance(value, int) else "a finite number"
        bounds = [f"{op} {limit:g}" for op, limit in ((">=", low), (">", above), ("<=", high)) if limit is not None]
        inside = (math.isfinite(value) and (low is None or value >= low) and (above is None or value > above)
                  and (high is None or value <= high))
        if not inside:
            raise ValueError(f"{option} must be {kind} {' and '.join(bounds)} ({what}); got {value!r}")
    if args.pass_k is not None:
        ks = parse_ks(args.pass_k, "--pass-k")
        if args.policy is not None:  # generated here: --samples per item (a file's are checked per item)
            check_ks(ks, args.samples, "--pass-k", "--samples")
    try:
        engine_kwargs = json.loads(args.engine_kwargs)
    except ValueError as err:
        raise ValueError(f"--engine-kwargs is not JSON: {err}") from None
    if not isinstance(engine_kwargs, dict):
        raise ValueError(f"--engine-kwargs must be a JSON object of the engine's arguments, e.g. "
                         f"'{{\"dtype\": \"float32\"}}'; got {args.engine_kwargs}")
    return engine_kwargs


def default_output(policy: str | None, suite_name: str, step: int | None = None) -> Path:
    """eval/<suite>.json in the policy's run directory (a run, or a run's policy/), else here; a
    training checkpoint's (``step``: its policy version) is eval/<suite>@step_<step>.json in its run
    (``runs/x/checkpoints/step_000010``), else here."""
    from gdpo_ray.eval.report import report_path

    if policy and policy != "demo":
        path = Path(policy)
        for run in (path, path.parent, *([path.parent.parent] if step is not None else [])):
            if (run / "metrics.jsonl").is_file():
                return report_path(run, suite_name, step)
    return report_path(".", suite_name, step)


def checkpoint_step(policy: str | None) -> int | None:
    """The policy version of POLICY where it is a training checkpoint, else None."""
    from gdpo_ray.run.checkpoints import checkpoint_version

    return checkpoint_version(policy) if policy and policy != "demo" else None


def eval_reports(path: str | Path) -> list[dict]:
    """The reports of a run: a report file, or every eval/*.json of a run directory (or of a
    directory of reports), then the in-training evals its metrics.jsonl logged at steps no report
    is of (``gdpo_ray.eval.report.training_evals``: their overall metrics alone); [] for none."""
    from gdpo_ray.eval.report import read_report, training_evals
    from gdpo_ray.run.outputs import latest_rows, read_metrics

    path = Path(path)
    if path.is_file():
        return [read_report(path)]
    reports = []
    for folder in (path / "eval", path):
        files = sorted(folder.glob("*.json")) if folder.is_dir() else []
        if files:
            reports = [read_report(f) for f in files]
            break
    if (path / "metrics.jsonl").is_file():
        written = {(r["suite"], r.get("step")) for r in reports}
        rows = latest_rows([r for r in read_metrics(path / "metrics.jsonl") if "step" in r])
        reports += [r for r in training_evals(rows) if (r["suite"], r["step"]) not in written]
    return reports


def reports_of(run: str) -> list[dict]:
    """``eval_reports`` of ``run``, a ValueError naming it where there are none."""
    reports = eval_reports(run)
    if not reports:
        raise ValueError(f"--compare {run}: no eval report there (a report .json, or a run directory with "
                         f"eval/*.json or in-training evals, training.eval_every; write one with gdpo-ray eval "
                         f"{run} --suite NAME)")
    return reports


def compared(runs: list[str], correct: list[str] | None) -> str:
    """``--compare``'s text: the runs' reports side by side (``gdpo_ray.eval.report.compare``);
    with ``correct`` ('NAME>=VALUE', each), every report's NAME/pass_rate recomputed from its
    samples, then a line that says so and which reports have no samples to recompute from."""
    from gdpo_ray.eval.correct import parse_correct
    from gdpo_ray.eval.report import compare, pass_rates, step_label

    reports = {run: reports_of(run) for run in runs}
    if not correct:
        return compare(reports)
    sampled = {id(r): r for rs in reports.values() for r in rs
               if any(item.get("samples") for item in (r.get("items") or {}).values())}
    if not sampled:
        raise ValueError(f"--correct recomputes pass rates from the reports' samples; {', '.join(runs)} "
                         f"hold in-training evals only (metrics.jsonl keeps no samples): evaluate a "
                         f"checkpoint with gdpo-ray eval CHECKPOINT --suite NAME --correct ...")
    metrics = list(dict.fromkeys(m for r in sampled.values() for m in r["overall"]))
    conditions = parse_correct(correct, metrics, of="the reports' samples")
    unsampled = []
    for label, run_reports in reports.items():
        for r in run_reports:
            if id(r) in sampled:
                r["overall"] = {**r["overall"], **pass_rates(r, conditions)}
            else:
                unsampled.append(f"{label} {step_label(r)}")
    said = (f"--correct {', '.join(map(str, conditions))}: each NAME/pass_rate above is recomputed from "
            f"the report's samples (a report's own, made with other conditions, replaced)")
    if unsampled:
        said += f"; no samples to recompute from (in-training evals keep none): {', '.join(unsampled)}"
    return compare(reports) + "\n\n" + said


def run(args: argparse.Namespace) -> int:
    from gdpo_ray.eval.report import format_report, write_report

    try:
        engine_kwargs = check_options(args)  # before anything is read or started
        if args.compare:
            if args.policy or args.suite:
                raise ValueError("--compare takes run directories or reports only (no POLICY or --suite)")
            print(compared(args.compare, args.correct))
            return 0
        if not args.suite:
            raise ValueError("--suite is required (task:<name>, math:<path>, humaneval, bfcl, bfcl:<category>, "
                             "rewards:<path>)")
        if args.rewards is not None and not args.suite.startswith("rewards:"):
            raise ValueError(f"--rewards goes with --suite rewards:FILE (the run's rewards on held-out prompts); "
                             f"suite {args.suite} scores with its own")
        if (args.policy is None) == (args.completions is None):
            raise ValueError("give POLICY (to generate) or --completions FILE (to score), one of them")
        from actors.engines import engine_class

        engine_class(args.engine, "batched")  # hf, vllm or package.module:Class, checked before any actor

        report = _evaluate(args, engine_kwargs)
    except ValueError as err:
        print(f"gdpo-ray eval: {err}", file=sys.stderr)
        return 2
    step = checkpoint_step(args.policy)
    if step is not None:  # --compare shows it as that step of its run
        report["step"] = step
    path = write_report(report, args.output or default_output(args.policy, report["suite"], step))
    print(format_report(report))
    if report["suite"].startswith("rewards:"):
        from gdpo_ray.eval.rewards_suite import failure_lines

        for line in failure_lines(report):
            print(f"gdpo-ray eval: note: {line}", file=sys.stderr)
    too_long = report["counts"]["prompt_too_long"]
    if too_long:
        print(f"gdpo-ray eval: note: {too_long} samples were not generated, their prompt being over "
              f"--max-prompt-tokens {args.max_prompt_tokens} ("
              + ("every column failed" if report["suite"].startswith("rewards:") else "scored as empty answers")
              + ")", file=sys.stderr)
    missing = report["settings"].get("items_missing")
    if missing:
        print(f"gdpo-ray eval: note: {missing} of the suite's {report['settings']['items']} items are not "
              f"in {args.completions}; only the {report['counts']['items']} in it were scored", file=sys.stderr)
    if args.json:
        print(json.dumps(report["overall"]))
    print(f"gdpo-ray eval: report {path}")
    return 0


def rewards_suite_options(rewards: str | None, policy: str | None) -> dict:
    """The ``rewards:`` suite's options from the config named by ``--rewards`` or POLICY's run
    (where it is looked for: ``gdpo_ray.run.eval_rewards``)."""
    from gdpo_ray.run.algorithm import GDPOConfig
    from gdpo_ray.run.eval_rewards import config_options, config_path
    from gdpo_ray.run.presets import apply_sections, load_preset

    source = config_path(rewards, policy)
    try:
        c = apply_sections(GDPOConfig(), load_preset(source))
    except ValueError as err:
        raise ValueError(f"--rewards {source}: {err}") from None
    options = config_options(c, source)
    if not options["rewards"]:
        raise ValueError(f"--rewards {source}: the config has no training.rewards to score with")
    return options


def system_prompt(given: str | None, policy: str | None, configured: str | None = None) -> str | None:
    """``--system-prompt`` ('' for none), else the suite's config's (``--rewards``), else the
    ``data.system_prompt`` the run POLICY trained with."""
    if given is not None:
        return given or None
    if configured is not None:
        return configured
    from gdpo_ray.run.eval_rewards import run_config

    found = run_config(policy) if policy else None
    if found is None:
        return None
    import yaml

    return ((yaml.safe_load(found.read_text()) or {}).get("data") or {}).get("system_prompt")


def _evaluate(args: argparse.Namespace, engine_kwargs: dict) -> dict:
    from gdpo_ray.run.eval_runner import check_pass_k, evaluate, resolve_policy
    from gdpo_ray.eval.suites import make_suite

    options = {}
    if args.suite.startswith("rewards:"):
        options = rewards_suite_options(args.rewards, args.policy)
    suite = make_suite(args.suite, length_limit=args.length_limit, **options)
    try:
        suite.set_correct(args.correct)
        if args.completions is not None:
            suite.check_scorable_here()  # a column only a rollout computes: before anything is read
        check_pass_k(suite, args.pass_k, args.samples if args.policy is not None else None)  # before Ray
        if args.policy is not None:
            policy = resolve_policy(args.policy, args.base)  # a bad path fails before Ray starts
            from gdpo_ray.run.cluster import start_ray

            start_ray(None, args.num_cpus or os.cpu_count() or 1, [])
        else:
            policy = None
        return evaluate(suite, policy=policy, completions_file=args.completions, samples=args.samples,
                        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                        limit=args.limit, engine=args.engine, engine_kwargs=engine_kwargs,
                        num_actors=args.num_actors,
                        chat_template=not args.no_chat_template and suite.chat_template is not False,
                        tokenizer=args.tokenizer, max_prompt_tokens=args.max_prompt_tokens,
                        label=args.policy, pass_k=args.pass_k,
                        system_prompt=system_prompt(args.system_prompt, args.policy, suite.system_prompt))
    finally:
        suite.close()
