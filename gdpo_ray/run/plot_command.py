"""``gdpo-ray plot``: runs' curves side by side in one PNG (the curves: ``gdpo_ray.run.run_curves``),
or with ``--pareto A B`` the trade-off of two columns across runs and checkpoints (the points:
``run_curves.pareto_points``; the non-dominated ones: ``gdpo_ray.comparison.pareto_front``)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

from gdpo_ray.comparison import save_figure
from gdpo_ray.run.run_curves import TRAINING_REWARDS, Panel, Point, curves, pareto_points

DESCRIPTION = """\
Draw the curves of one or more training runs side by side in one PNG: one panel per reward
(rewards/<name>/mean of each run's metrics.jsonl; every reward of any run) and one per --metric
(any key of metrics.jsonl, e.g. adv/format/share or learner/loss), each run one line labelled
by its name and its estimator (from the run's config.yaml, where it has one).

With --pareto A B: one point per run and checkpoint, (mean of column A, mean of column B), from
eval reports (report files, or a run directory's eval/*.json and in-training evals), else from a
run's training rewards (rewards/<name>/mean per step, said as such; --training forces them). Higher
is better on both unless --minimize names a column (e.g. a length). The non-dominated points are
marked and joined as the front; each point is labelled by its run and step, and the table of
points, with a pareto yes/no column, is printed."""

#: panels per row of the figure
COLUMNS = 3


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("plot", help="plot runs' reward curves (and any metric) side by side in one PNG",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (as gdpo-ray train prints them); "
                   "with --pareto, eval report files too")
    p.add_argument("--metric", action="append", default=[], metavar="NAME",
                   help="also a panel of this metrics.jsonl key (repeatable)")
    p.add_argument("--pareto", nargs=2, metavar=("A", "B"), help="the trade-off of columns A (x) and B (y) "
                   "across the runs' checkpoints, e.g. correct quality/helpful; SUITE/NAME where two suites have one")
    p.add_argument("--minimize", action="append", default=[], metavar="NAME",
                   help="with --pareto: lower is better on this column (A or B; e.g. a length)")
    p.add_argument("--training", action="store_true",
                   help="with --pareto: the runs' training rewards (batch means per step) even where eval reports exist")
    p.add_argument("--out", "--output", dest="out", metavar="FILE.png",
                   help="the PNG to write (default: plot.png here; with --pareto, pareto.png)")
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
    return save_figure(fig, png)


def plot_runs(runs: Sequence[str | Path], metrics: Sequence[str] = (), out: str | Path = "plot.png") -> list[Panel]:
    """Writes the PNG of ``runs`` to ``out``; returns what it drew."""
    panels = curves(runs, list(dict.fromkeys(metrics)))
    if not panels:
        raise ValueError(f"nothing to plot: {', '.join(map(str, runs))} logged no reward "
                         f"(rewards/<name>/mean); name a metric with --metric")
    draw(panels, out)
    return panels


def pareto(sources: Sequence[str | Path], columns: Sequence[str], minimize: Sequence[str] = (),
           training: bool = False, out: str | Path = "pareto.png") -> tuple[list[Point], list[int], str]:
    """Writes the PNG of the trade-off of ``columns`` (A, B) to ``out``; returns the points, the
    indices of the non-dominated ones and the text to print (the table, what was left out)."""
    if len(set(columns)) != len(columns):
        raise ValueError(f"--pareto takes two different columns; got {' and '.join(columns)}")
    unknown = [m for m in minimize if m not in columns]
    if unknown:
        raise ValueError(f"--minimize {unknown[0]!r} is not a --pareto column ({' or '.join(columns)})")
    from gdpo_ray.comparison import pareto_front

    maximize = tuple(c not in minimize for c in columns)
    points = pareto_points(sources, columns, training)
    front = pareto_front([p.values for p in points], maximize)
    draw_pareto(points, front, columns, maximize, out)
    return points, front, pareto_text(points, front, columns, maximize)


def _direction(maximize: bool) -> str:
    return "higher is better" if maximize else "lower is better"


def pareto_text(points: Sequence[Point], front: Sequence[int], columns: Sequence[str],
                maximize: Sequence[bool]) -> str:
    """The table of points (a ``pareto`` yes/no column; '-' for a point left out), then the points
    left out (a column not reported there) and, where sources differ, that they do."""
    from gdpo_ray.comparison import incomplete
    from gdpo_ray.eval.report import table

    on = set(front)
    left_out = set(incomplete([p.values for p in points]))
    rows = [[p.label, p.source, *p.values, "-" if i in left_out else "yes" if i in on else "no"]
            for i, p in enumerate(points)]
    head = (f"pareto: {columns[0]} ({_direction(maximize[0])}) against {columns[1]} "
            f"({_direction(maximize[1])}); {len(front)} of {len(points) - len(left_out)} points non-dominated")
    lines = [head, table(rows, ["point", "source", *columns, "pareto"], left=2)]
    if left_out:
        lines.append(f"left out (no value of {' or '.join(columns)} there): "
                     + ", ".join(points[i].label for i in sorted(left_out)))
    kinds = list(dict.fromkeys(p.source for p in points))
    if TRAINING_REWARDS in kinds and len(kinds) > 1:
        lines.append("note: training rewards (batch means of training prompts) sit beside eval means "
                     "(held-out prompts): they do not compare like for like")
    return "\n".join(lines)


#: with more points, only the non-dominated ones and each run's last are labelled on the figure
LABEL_ALL = 30


def draw_pareto(points: Sequence[Point], front: Sequence[int], columns: Sequence[str],
                maximize: Sequence[bool], png: str | Path) -> Path:
    """The points, a colour per run (its checkpoints joined in step order; triangles: training
    rewards), the non-dominated ones ringed and joined as the front; axes named with their
    direction and source, a minimized one reversed (better is up and to the right on both)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gdpo_ray.comparison import incomplete

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    left_out, on = set(incomplete([p.values for p in points])), set(front)
    kept = [i for i in range(len(points)) if i not in left_out]
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    last = {points[i].run: i for i in kept}
    for run in dict.fromkeys(points[i].run for i in kept):
        mine = [i for i in kept if points[i].run == run]
        xs, ys = [points[i].values[0] for i in mine], [points[i].values[1] for i in mine]
        colour = colours[run % len(colours)]
        if len(mine) > 1:
            ax.plot(xs, ys, color=colour, alpha=0.35, linewidth=1)
        trained = points[mine[0]].source == TRAINING_REWARDS  # a run's points are all of one kind
        ax.scatter(xs, ys, color=colour, s=32, zorder=3, marker="^" if trained else "o",
                   label=points[mine[0]].name + (" (training rewards)" if trained else ""))
    if front:
        ordered = sorted(front, key=lambda i: points[i].values)
        ax.plot([points[i].values[0] for i in ordered], [points[i].values[1] for i in ordered], color="black",
                linewidth=1.2, linestyle="--", zorder=2, label="Pareto front")
        ax.scatter([points[i].values[0] for i in front], [points[i].values[1] for i in front], s=110,
                   facecolors="none", edgecolors="black", linewidths=1.5, zorder=4, label="non-dominated")
    sources = {points[i].source for i in kept}
    kind = ("training batch mean" if sources == {TRAINING_REWARDS} else
            "mean: eval and training" if TRAINING_REWARDS in sources else "eval mean")
    ax.set_xlabel(f"{columns[0]} ({kind}; {_direction(maximize[0])})")
    ax.set_ylabel(f"{columns[1]} ({kind}; {_direction(maximize[1])})")
    ax.margins(x=0.08, y=0.1)
    if not maximize[0]:  # a minimized axis is reversed: better is up and to the right on both
        ax.invert_xaxis()
    if not maximize[1]:
        ax.invert_yaxis()
    ax.set_title(f"{columns[0]} against {columns[1]}: non-dominated ringed, better up and right", fontsize=11)
    labelled = [i for i in kept if len(kept) <= LABEL_ALL or i in on or last[points[i].run] == i]
    _label(ax, points, labelled, on)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, png)


def _label(ax, points: Sequence[Point], labelled: Sequence[int], on: set) -> None:
    """Each point's run and step beside it: to its right, or to its left in the right third of
    the axes (so that it stays inside); the non-dominated ones in bold."""
    left, right = ax.get_xlim()
    for i in labelled:
        at = (points[i].values[0] - left) / ((right - left) or 1.0)  # 0 at the left edge, 1 at the right
        ax.annotate(points[i].label, points[i].values, textcoords="offset points",
                    xytext=(-6, 5) if at > 0.67 else (6, 5), ha="right" if at > 0.67 else "left",
                    fontsize=8, fontweight="bold" if i in on else "normal")


def run(args: argparse.Namespace) -> int:
    out = args.out or ("pareto.png" if args.pareto else "plot.png")
    try:
        if args.pareto:
            if args.metric:
                raise ValueError("--metric draws curves; --pareto draws the trade-off of two columns: one of them")
            print(pareto(args.runs, args.pareto, args.minimize, args.training, out)[2])
        else:
            if args.minimize or args.training:
                raise ValueError(f"{'--minimize' if args.minimize else '--training'} goes with --pareto A B")
            plot_runs(args.runs, args.metric, out)
    except ValueError as err:
        print(f"gdpo-ray plot: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"gdpo-ray plot: cannot write {out}: {err}", file=sys.stderr)
        return 1
    print(f"plot written to {out}")
    return 0
