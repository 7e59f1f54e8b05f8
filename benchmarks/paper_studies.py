"""GDPO's benefit where the paper finds it, in miniature (issue 31): GDPO against GRPO and GRPO
without std, the same seeds, settings and compute, judged as the paper judges.

1. ``tool_calling`` (the paper's §4.1, Fig. 4 and Table 1): the ``study_tool_calling`` preset,
   the tiny tool-calling model (``demo-tools``, warm-started so that both rewards start well
   below their maximum) with ToolRL's rewards, format in {0, 1} beside correctness in [-3, 3];
   trained on ``task:tool_calls``, evaluated on held-out requests with BFCL-style scoring
   (``accuracy``: the calls equal the gold calls; ``format_ratio``).
2. ``math_length`` (§4.2, Fig. 5 and Table 3): the ``study_math_length`` preset, ``demo-count``
   on ``task:count`` with correctness and a length reward whose limit (14 tokens) binds: the
   right answers to half the items are longer than the limit, so no format escapes it; under
   DAPO's settings (dynamic sampling, clip-higher, token-mean); per step the correctness, the
   length reward (over the trained batch, as the paper plots them, and over every sampled
   rollout, the groups dynamic sampling dropped too) and the batch's maximum response length;
   held out: ``pass@1`` and ``exceed_ratio``.

Per study: a PNG of each plotted metric per step (median over seeds, interquartile range
shaded) and one of the per-reward advantage shares (``adv/<name>/share``: how much of the
summed advantage's variance each reward drives; GRPO lets the wider reward drown the other);
a table of the held-out results with every seed's value; the exact sign test of GDPO against
each baseline over the paired seeds (``gdpo_ray.comparison``); and whether a reward saturated
(a study where a method reaches a reward's maximum cannot separate the methods on it).
Evaluation: the paper's sampling (temperature 0.6, top-p 0.95), ``eval_samples`` completions
per held-out item; for the tool-calling study also at the training temperature (1.0, no top-p:
the metrics named ``<metric> at T=1``), where the format ratio saturates at 0.6. (The CPU demo's
comparison, all three rewards in {0, 1}: ``benchmarks/gdpo_vs_grpo.py``.)

    python benchmarks/paper_studies.py [--json] [--study all|tool_calling|math_length]
        [--seeds 0 1 2 3 4] [--steps N] [--out runs/paper_studies] [--set KEY=VALUE ...]
        [--warm-start-steps N] [--smoke]

About 20 minutes per study on 2 cores (15 runs), plus, the first time on a machine, a few minutes
to build and cache each study's warm-started model. ``--smoke``: both studies, GDPO and GRPO,
seed 0, one step of 2 prompts x 2, one sample on each of 2 held-out items, each study's model a
stand-in warm-started for 2 + 2 steps of its recipe (``--warm-start-steps 2``); the models and
the PNGs in a new temporary folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
METHODS = ("gdpo", "grpo", "grpo_no_std")

from benchmarks._smoke import parse_args  # noqa: E402

SMOKE = {"seeds": [0], "methods": "gdpo,grpo", "steps": 1, "warm_start_steps": 2, "overrides": [
    "training.prompts_per_step=2", "training.group_size=2", "training.eval_samples=1", "training.eval_limit=2"]}


@dataclasses.dataclass(frozen=True)
class Study:
    preset: str
    title: str
    rewards: dict  # reward name -> its maximum (the saturation test)
    curves: tuple  # per-step metrics plotted
    held_out: tuple  # (metric, higher is better)
    final: str = "rewards/{}/mean"  # the final training reward of a reward name (saturation test)
    at_t1: bool = False  # the held-out metrics at temperature 1.0 too


STUDIES = {
    "tool_calling": Study(
        "study_tool_calling", "tool calling (format in {0,1}, correctness in [-3,3])",
        {"format": 1.0, "correctness": 3.0},
        ("rewards/format/mean", "rewards/correctness/mean"),
        (("accuracy", True), ("format_ratio", True)), at_t1=True),
    "math_length": Study(
        "study_math_length", "math with a length limit (DAPO settings)",
        {"correct": 1.0, "length": 1.0},
        ("rewards/correct/mean", "rewards/length/mean", "response_length/max",
         "rewards/correct/sampled_mean", "rewards/length/sampled_mean"),
        (("pass@1", True), ("exceed_ratio", False)), "rewards/{}/sampled_mean"),
}
#: the held-out evaluations: the paper's sampling, and the training temperature's
SAMPLINGS = {"": dict(temperature=0.6, top_p=0.95), " at T=1": dict(temperature=1.0, top_p=1.0)}
TITLES = {"rewards/format/mean": "format reward", "rewards/correctness/mean": "correctness reward",
          "rewards/correct/mean": "correctness reward", "rewards/length/mean": "length reward",
          "response_length/max": "max response length (tokens)",
          "rewards/correct/sampled_mean": "correctness, every sampled rollout",
          "rewards/length/sampled_mean": "length reward, every sampled rollout"}
LAST = 5  # the final training reward: the mean over the last steps


def held_out_metrics(study: Study) -> list[tuple[str, bool]]:
    """(metric, higher is better) of the study's held-out table: at each of its samplings."""
    return [(m + label, higher) for label in (SAMPLINGS if study.at_t1 else [""]) for m, higher in study.held_out]


def stand_in_model(study: Study, steps: int, folder: Path) -> str:
    """The study's warm-started model built in ``folder`` with ``steps`` clean and ``steps``
    teacher steps of its recipe: the same builder, minutes shorter than the recipe's own."""
    import importlib

    from gdpo_ray.model_files import WARM_STARTED
    from gdpo_ray.run.presets import load_preset

    module, builder = WARM_STARTED[load_preset(study.preset)["llm"]["model_path"]]
    return str(getattr(importlib.import_module(module), builder)(folder, clean_steps=steps, steps=steps))


def run(study: Study, method: str, seed: int, steps: int | None, overrides: list[str]) -> dict:
    """One training run and the held-out eval of its final policy."""
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    sections = load_preset(study.preset, [f"training.estimator={method}", f"debugging.seed={seed}", *overrides])
    steps = steps or sections["run"]["steps"]
    config = apply_sections(GDPOConfig(), sections)
    start = time.perf_counter()
    algo = config.build_algo()
    try:
        rows = [algo.train() for _ in range(steps)]
        reports = {label: algo.evaluate_policy(**SAMPLINGS[label]) for label in (SAMPLINGS if study.at_t1 else [""])}
    finally:
        algo.stop()
    shares = [f"adv/{name}/share" for name in study.rewards]
    return {"curves": {m: [float(r.get(m, np.nan)) for r in rows] for m in (*study.curves, *shares)},
            "final": {name: float(np.nanmean([r.get(study.final.format(name), np.nan) for r in rows[-LAST:]]))
                      for name in study.rewards},
            "held_out": {m + label: float(report["overall"][m]) if report else np.nan
                         for label, report in reports.items() for m, _ in study.held_out},
            "seconds": time.perf_counter() - start}


def summarize(name: str, study: Study, runs: dict, seeds: list[int], out: Path) -> dict:
    """Plots, the held-out table with every seed, the sign tests, the saturation check, and per
    method and metric the per-step median and quartiles over seeds (``curves``)."""
    from gdpo_ray.comparison import band, plot_bands, sign_test

    curves = {m: {k: [r["curves"][k] for r in runs[m]] for k in runs[m][0]["curves"]} for m in runs}
    plots = [str(plot_bands(curves, study.curves, TITLES, out / f"{name}.png", study.title))]
    shares = [f"adv/{r}/share" for r in study.rewards]
    plots.append(str(plot_bands(curves, shares, {s: f"advantage share: {s.split('/')[1]}" for s in shares},
                                out / f"{name}_shares.png", f"{study.title}: per-reward advantage shares")))
    held = {m: {metric: [r["held_out"][metric] for r in runs[m]] for metric, _ in held_out_metrics(study)} for m in runs}
    final = {m: {reward: [r["final"][reward] for r in runs[m]] for reward in study.rewards} for m in runs}
    tests = {f"gdpo_vs_{b}": {metric: sign_test(held["gdpo"][metric], held[b][metric], higher)
                              for metric, higher in held_out_metrics(study)}
             for b in runs if b != "gdpo"} if "gdpo" in runs else {}
    saturated = {m: [reward for reward, top in study.rewards.items()
                     if np.nanmedian(final[m][reward]) >= top - 0.02 * top] for m in runs}
    bands = {m: {k: dict(zip(("median", "q1", "q3"), (v.tolist() for v in band(c)))) for k, c in by.items()}
             for m, by in curves.items()}
    return {"seeds": seeds, "held_out": held, "final_train_reward": final, "sign_tests": tests, "curves": bands,
            "saturated": saturated, "plots": plots,
            "minutes": sum(r["seconds"] for rs in runs.values() for r in rs) / 60}


def print_summary(name: str, study: Study, summary: dict) -> None:
    print(f"\n== {name}: {study.title}; seeds {summary['seeds']}, {summary['minutes']:.1f} min")
    for metric, higher in held_out_metrics(study):
        print(f"held-out {metric} ({'higher' if higher else 'lower'} is better): mean, then every seed")
        for method, by_metric in summary["held_out"].items():
            values = by_metric[metric]
            print(f"  {method:12} {np.nanmean(values):.3f}   " + " ".join(f"{v:.3f}" for v in values))
        for pair, by_metric in summary["sign_tests"].items():
            t = by_metric[metric]
            print(f"  {pair}: {t['wins']} wins, {t['losses']} losses, {t['ties']} ties; sign test p = {t['p']:.3f}")
    print("final training reward (mean of the last steps; median over seeds): " + "; ".join(
        f"{m} " + ", ".join(f"{r} {np.nanmedian(v):.3f}" for r, v in by_reward.items())
        for m, by_reward in summary["final_train_reward"].items()))
    flat = {m: s for m, s in summary["saturated"].items() if s}
    print(f"saturated: {flat if flat else 'none'}; plots: {', '.join(summary['plots'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object with every result")
    parser.add_argument("--study", choices=["all", *STUDIES], default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated estimators")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the preset's)")
    parser.add_argument("--out", help="folder of the PNGs (default runs/paper_studies; under --smoke a new "
                                      "temporary folder)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a preset override for every run (repeatable), e.g. generation.max_tokens=32")
    parser.add_argument("--warm-start-steps", type=int,
                        help="each study's model a stand-in warm-started for N clean + N teacher steps, built in "
                             "OUT/models (for checking the path; default: the preset's model, its recipe's own)")
    args = parse_args(parser, SMOKE)
    args.out = args.out or (tempfile.mkdtemp(prefix="paper-studies-smoke-") if args.smoke else "runs/paper_studies")

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    results = {}
    for name in STUDIES if args.study == "all" else [args.study]:
        study = STUDIES[name]
        overrides = list(args.overrides)
        if args.warm_start_steps:
            model = stand_in_model(study, args.warm_start_steps, Path(args.out) / "models")
            overrides.append(f"llm.model_path={model}")
        runs: dict[str, list] = {}
        for method in args.methods.split(","):
            for seed in args.seeds:
                r = run(study, method, seed, args.steps, overrides)
                runs.setdefault(method, []).append(r)
                print(f"[{name}] {method} seed {seed}: {r['seconds']:.0f} s, held out "
                      + ", ".join(f"{k} {v:.3f}" for k, v in r["held_out"].items()), file=sys.stderr, flush=True)
        results[name] = summarize(name, study, runs, args.seeds, Path(args.out))
        if not args.json:
            print_summary(name, study, results[name])
    ray.shutdown()
    if args.json:
        print(json.dumps(results | {"smoke": args.smoke}, default=float))


if __name__ == "__main__":
    main()
