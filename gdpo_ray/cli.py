"""The ``gdpo-ray`` command line (identical to ``python -m gdpo_ray``)."""

from __future__ import annotations

import argparse
import json
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


def _train(args: argparse.Namespace) -> int:
    from gdpo_ray.train import TrainingRun

    try:
        run = TrainingRun.from_args(args.config, args.overrides, resume=args.resume)
    except ValueError as err:  # a bad config fails here, before Ray or any actor starts
        print(f"gdpo-ray train: {err}", file=sys.stderr)
        return 2
    return run.run()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gdpo-ray", description="Multi-reward RL for LLMs with GDPO on Ray."
    )
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

    train = commands.add_parser(
        "train", help="train a policy with GDPO (no argument: the CPU demo)",
        description="Train with GDPO. CONFIG is a packaged preset (demo, smollm2_math) or a YAML "
        "file; overrides are OmegaConf dotlist items such as training.lr=1e-5 run.steps=10. "
        "Outputs go under one run directory, printed at start and end.")
    train.add_argument("config", nargs="?", default=None, help="preset name or YAML path (default: demo)")
    train.add_argument("overrides", nargs="*", help="section.key=value items")
    train.add_argument("--resume", metavar="CHECKPOINT", help="continue from a checkpoint directory")
    train.set_defaults(run=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
