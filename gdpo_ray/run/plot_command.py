"""``gdpo-ray plot``: runs' curves side by side in one PNG (the curves: ``gdpo_ray.run.run_curves``)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

from gdpo_ray.run.run_curves import Panel, curves

DESCRIPTION = """\
Draw the curves of one or more training runs side by side in one PNG: one panel per reward
(rewards/<name>/mean of each run's metrics.jsonl; every reward of any run) and one per --metric
(any key of metrics.jsonl, e.g. adv/format/share or learner/loss), each run one line labelled
by its name and its estimator (from the run's config.yaml, where it has one)."""

#: panels per row of the figure
COLUMNS = 3


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("plot", help="plot runs' reward curves (and any metric) side by side in one PNG",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (as gdpo-ray train prints them)")
    p.add_argument("--metric", action="append", default=[], metavar="NAME",
                   help="also a panel of this metrics.jsonl key (repeatable)")
    p.add_argument("--out", default="plot.png", metavar="FILE.png", help="the PNG to write (default: plot.png here)")
    p.set_defaults(run=run)


def draw(panels: Sequence[Panel], png: str | Path) -> Path:
    """The panels in one figure, COLUMNS per row; a run has the same colour in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(COLUMNS, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.4 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels):
        for line in panel.lines:
            ax.plot(line.steps, line.values, marker="." if len(line.steps) < 50 else None,
                    color=colours[line.run % len(colours)], label=line.label)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        if panel.title != panel.key:  # a reward's panel
            ax.set_ylabel("batch mean")
        ax.grid(alpha=0.3)
        if panel.lines:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def plot_runs(runs: Sequence[str | Path], metrics: Sequence[str] = (), out: str | Path = "plot.png") -> list[Panel]:
    """Writes the PNG of ``runs`` to ``out``; returns what it drew."""
    panels = curves(runs, list(dict.fromkeys(metrics)))
    if not panels:
        raise ValueError(f"nothing to plot: {', '.join(map(str, runs))} logged no reward "
                         f"(rewards/<name>/mean); name a metric with --metric")
    draw(panels, out)
    return panels


def run(args: argparse.Namespace) -> int:
    try:
        plot_runs(args.runs, args.metric, args.out)
    except ValueError as err:
        print(f"gdpo-ray plot: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"gdpo-ray plot: cannot write {args.out}: {err}", file=sys.stderr)
        return 1
    print(f"plot written to {args.out}")
    return 0
