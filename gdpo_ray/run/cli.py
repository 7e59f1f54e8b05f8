"""The ``gdpo-ray`` command line (identical to ``python -m gdpo_ray``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict


def parse_int_range(text: str) -> list[int]:
    """'4' -> [4]; '2-6' -> [2, 3, 4, 5, 6]; '2,4,8' -> [2, 4, 8]; parts may be mixed."""
    values: list[int] = []
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            values.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer, a range like 2-6 or a list like 2,4,8"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is an empty range")
    return sorted(set(values))


def _distinct_groups(args: argparse.Namespace) -> int:
    from gdpo_ray import analysis

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        counts = analysis.distinct_groups(args.rewards, args.rollouts, methods)
    except ValueError as err:
        print(f"gdpo-ray analyze distinct-groups: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"counts": [
            {k: v for k, v in asdict(c).items() if k != "groups"} for c in counts
        ]}))
    else:
        print(f"{'method':<12} {'K':>3} {'G':>3} {'groups':>10} {'distinct':>9}")
        for c in counts:
            print(f"{c.method:<12} {c.rewards:>3} {c.rollouts:>3} {c.groups:>10} {c.distinct:>9}")
    if args.plot:
        analysis.plot(counts, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _load_run(args: argparse.Namespace, command: str):
    from gdpo_ray.run.train import TrainingRun

    return TrainingRun.from_args(args.config, args.overrides, resume=getattr(args, "resume", None),
                                 ray_in_background=command == "train")


def _train(args: argparse.Namespace) -> int:
    from actors.attestation import WeightPushFailed
    from actors.rollout import PromptsExhausted
    from gdpo_ray.reward_watch import RewardFailure
    from gdpo_ray.run.checkpoints import WriteFailed

    try:  # a bad config, model, dataset or reward fails here, before any actor starts
        run = _load_run(args, "train")
        return run.run()  # SIGINT / SIGTERM: handled in the run (130 / 143)
    except ValueError as err:
        print(f"gdpo-ray train: {err}", file=sys.stderr)
        return 2
    except (RewardFailure, PromptsExhausted, WriteFailed, WeightPushFailed) as err:
        print(f"gdpo-ray train: stopped: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the run set its own handlers (loading the config)
        print("gdpo-ray train: interrupted before the run started", file=sys.stderr)
        return 130


def _check(args: argparse.Namespace) -> int:
    import logging

    import yaml

    class Counted(logging.StreamHandler):  # warnings logged during the checks: printed, and counted
        def __init__(self) -> None:
            super().__init__(sys.stderr)
            self.setLevel(logging.WARNING)
            self.count = 0

        def emit(self, record: logging.LogRecord) -> None:
            self.count += 1
            super().emit(record)

    counted = Counted()
    logging.getLogger().addHandler(counted)
    try:
        run = _load_run(args, "check")
        print(yaml.safe_dump(run.sections, sort_keys=False, default_flow_style=None), end="")
        report = run.check()
        if args.show_prompts:
            from gdpo_ray.run.show_prompts import shown_prompts

            for k, text in enumerate(shown_prompts(run.config, args.show_prompts)):
                print(f"\n--- prompt {k} as the model sees it ---\n{text}", end="" if text.endswith("\n") else "\n")
    except ValueError as err:
        print(f"gdpo-ray check: {err}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger().removeHandler(counted)
    print(f"\nrewards on {min(report.rows, 4)} dataset rows with placeholder completions "
          f"(mean per placeholder):")
    print(report.table())
    warnings = len(report.warnings) + counted.count
    print(f"gdpo-ray check: {args.config or 'demo'} is ready to train ({warnings} warning(s))")
    return 0


def _list(args: argparse.Namespace) -> int:
    if args.what == "fields":
        from gdpo_ray.config import FIELDS, RLLIB_FIELDS, field_lines
        from gdpo_ray.run.train import RUN_DEFAULTS

        sections = sorted({f.section for f in (*FIELDS.values(), *RLLIB_FIELDS.values())} | {"run"})
        if args.section is not None and args.section not in sections:
            raise SystemExit(f"gdpo-ray list fields: no section {args.section!r}; sections: {', '.join(sections)}")
        lines = field_lines(args.section)
        if args.section in (None, "run"):
            lines += [f"run.{k}  {json.dumps(v)}  (the command line's run section: docs/training.md)"
                      for k, v in RUN_DEFAULTS.items()]
        print("\n".join(lines))
        return 0
    if args.section is not None:
        raise SystemExit(f"gdpo-ray list {args.what} takes no section (only `gdpo-ray list fields SECTION` does)")
    if args.what == "presets":
        from gdpo_ray.run.presets import preset_names

        names = preset_names()
    elif args.what == "rewards":
        from gdpo_ray.rewards import REWARDS

        names = REWARDS.names()
    else:
        from gdpo_ray.advantages import ESTIMATORS

        names = ESTIMATORS.names()
    print("\n".join(names))
    return 0


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None,
                        help="preset name or YAML path (default: demo)")
    parser.add_argument("overrides", nargs="*", help="section.key=value items")


def build_parser() -> argparse.ArgumentParser:
    from gdpo_ray import __version__
    from gdpo_ray.run.presets import preset_names

    parser = argparse.ArgumentParser(
        prog="gdpo-ray", description="Multi-reward RL for LLMs with GDPO on Ray."
    )
    parser.add_argument("--version", action="version", version=f"gdpo-ray {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    analyze = commands.add_parser("analyze", help="analyses of the advantage math")
    analyses = analyze.add_subparsers(dest="analysis", required=True)
    distinct = analyses.add_parser(
        "distinct-groups",
        help="count distinct advantage groups per method (the paper's Fig. 3)",
        description="Enumerate every group of G rollouts with K binary rewards, normalize each "
        "with each method (eps = 0, no batch normalization) and count the distinct advantage "
        "groups. Ranges form a cross product.",
    )
    distinct.add_argument("--rewards", type=parse_int_range, default=[2],
                          help="K: a number, a range 2-6 or a list 2,3 (default 2)")
    distinct.add_argument("--rollouts", type=parse_int_range, default=list(range(2, 12)),
                          help="G: a number, a range or a list (default 2-11)")
    distinct.add_argument("--methods", default="gdpo,grpo,grpo_no_std",
                          help="comma-separated estimators (default gdpo,grpo,grpo_no_std)")
    distinct.add_argument("--plot", metavar="PNG", help="write the figure to this PNG file")
    distinct.add_argument("--json", action="store_true", help="print one JSON object")
    distinct.set_defaults(run=_distinct_groups)

    presets = ", ".join(preset_names())
    train = commands.add_parser(
        "train", help="train a policy with GDPO (no argument: the CPU demo)",
        description=f"Train with GDPO. CONFIG is a packaged preset ({presets}) or a YAML file; "
        "overrides are OmegaConf dotlist items such as training.lr=1e-5 run.steps=10, before or "
        "after the options. The start-up checks of `gdpo-ray check` run first. Outputs go under "
        "one run directory, printed at start and end. Ctrl-C (SIGINT) or SIGTERM stops the run "
        "after the step in progress, saves a checkpoint and prints the command that resumes it "
        "(exit 130 / 143); a second one stops at once.")
    _add_run_arguments(train)
    train.add_argument("--resume", metavar="RUN_DIR|CHECKPOINT",
                       help="continue a run: a run directory (its latest checkpoint; the run goes on "
                       "in it, appending its metrics) or a checkpoint (e.g. runs/x/checkpoints/"
                       "step_000040); with a new run.name, a new run from that state. The checkpoint's "
                       "files are checked against its manifest and its model against llm.model_path "
                       "first; one without a manifest needs training.resume_without_manifest=true")
    train.set_defaults(run=_train)

    check = commands.add_parser(
        "check", help="check a config without training",
        description=f"Print the resolved config of CONFIG (a preset: {presets}; or a YAML file) "
        "with its overrides, and run the start-up checks: the model path, the whole dataset, "
        "the rewards' imports and columns, and a few dataset rows scored with every reward on "
        "placeholder completions. Nothing is trained and no run directory is written.")
    _add_run_arguments(check)
    check.add_argument("--show-prompts", type=int, default=0, metavar="N",
                       help="print the first N prompts exactly as the model will see them (chat "
                       "template, system prompt, tools, first user turn)")
    check.set_defaults(run=_check)

    from gdpo_ray.run.eval_command import add_parser as add_eval

    add_eval(commands)

    from gdpo_ray.run.sft_command import add_parser as add_sft

    add_sft(commands)

    from gdpo_ray.run.plot_command import add_parser as add_plot

    add_plot(commands)

    lister = commands.add_parser("list", help="list presets, rewards, estimators or fields (every setting with its "
                                                  "default and doc)")
    lister.add_argument("what", choices=["presets", "rewards", "estimators", "fields"])
    lister.add_argument("section", nargs="?", default=None, help="with fields: one section (training, llm, ...)")
    lister.set_defaults(run=_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    # the user's own modules (rewards named "my_rewards:fn") import from the folder the command
    # runs in, for the console script as for `python -m gdpo_ray`
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides after an option (`train CFG --resume CKPT key=val`) are overrides too
        if getattr(args, "overrides", None) is None or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
