"""The curves that ``gdpo-ray plot`` draws, read from run directories (no drawing here: that is
``gdpo_ray.run.plot_command``).

``curves(runs, metrics)`` gives one ``Panel`` per reward (the union over the runs of the keys
``rewards/<name>/mean`` of their ``metrics.jsonl``, in the order they first appear) and one per
named metric (any key of ``metrics.jsonl``), each with one ``Line`` per run that logged the key:
its steps and values (the latest row of each step: ``outputs.latest_rows``), labelled by the
run's name and, where its ``config.yaml`` names one, its estimator ("demo-1 (GRPO)").

``pareto_points(sources, columns)`` gives the points of ``gdpo-ray plot --pareto A B``: one per
run and checkpoint, each column's mean there. From eval reports (a report file, or a run
directory's ``eval/*.json`` and the in-training evals of its ``metrics.jsonl``:
``gdpo_ray.run.eval_command.eval_reports``), one point per step (a report without one: its own
point); from a run without any (or with ``training=True``), the training rewards' batch means
``rewards/<name>/mean`` (or any metrics.jsonl key), one point per step. Which points are
non-dominated is ``gdpo_ray.comparison.pareto_front``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from pathlib import Path
from typing import Mapping, Sequence

from gdpo_ray.config import FIELDS
from gdpo_ray.eval.report import TRAINING_EVAL
from gdpo_ray.run.eval_command import eval_reports
from gdpo_ray.run.outputs import latest_rows, read_metrics

_REWARD_MEAN = re.compile(r"rewards/(.+)/mean")


@dataclasses.dataclass(frozen=True)
class Line:
    """One run's curve in a panel; ``run``: the run's position among those given (its colour)."""

    run: int
    label: str
    steps: tuple[int, ...]
    values: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Panel:
    """``key``: the metrics.jsonl key drawn; ``title``: the reward's name, or the key itself."""

    title: str
    key: str
    lines: tuple[Line, ...]


@dataclasses.dataclass(frozen=True)
class Run:
    path: Path
    name: str
    estimator: str | None
    rows: tuple[Mapping[str, float], ...]


def run_estimator(run_dir: str | Path) -> str | None:
    """The estimator that ``<run_dir>/config.yaml`` (the run's config, in preset format) names,
    or None: no such file, not YAML, or no estimator in it."""
    import yaml

    field = FIELDS["estimator"]
    try:
        config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    section = config.get(field.section) if isinstance(config, dict) else None
    value = section.get("estimator") if isinstance(section, dict) else None
    return str(value) if value else None


def read_run(run_dir: str | Path) -> Run:
    """A run directory's metrics (one row per step) and estimator; ValueError naming ``run_dir``
    when it is not a run directory or has logged no step yet."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        what = "does not exist" if not path.exists() else "is not a run directory (no metrics.jsonl in it)"
        raise ValueError(f"{run_dir} {what}; give the directory that gdpo-ray train printed, e.g. runs/demo-<time>")
    rows = tuple(latest_rows([r for r in read_metrics(metrics) if "step" in r]))
    if not rows:
        raise ValueError(f"{run_dir} has no step in its metrics.jsonl yet")
    return Run(path, path.resolve().name, run_estimator(path), rows)


def reward_names(rows: Sequence[Mapping[str, float]]) -> list[str]:
    """The rewards a run logged (``rewards/<name>/mean``), in the order they first appear."""
    found = (_REWARD_MEAN.fullmatch(k) for r in rows for k in r)
    return list(dict.fromkeys(m.group(1) for m in found if m))


def labels(runs: Sequence[Run]) -> list[str]:
    """"name (ESTIMATOR)" per run; runs of one name are told apart by their paths as given."""
    names = [r.name for r in runs]
    return [(r.name if names.count(r.name) == 1 else str(r.path))
            + (f" ({r.estimator.upper()})" if r.estimator else "") for r in runs]


def missing_metric(metric: str, keys: Sequence[str]) -> str:
    """The message for a --metric that no run logged: near names, else the key families."""
    near = difflib.get_close_matches(metric, keys, n=4, cutoff=0.6)
    near += [k for k in keys if metric in k and k not in near][:4]
    if near:
        return f"--metric {metric!r}: no run logged it; did you mean {' or '.join(repr(k) for k in near)}?"
    families = sorted({k.split("/")[0] + ("/" if "/" in k else "") for k in keys})
    return (f"--metric {metric!r}: no run logged it (their keys: {', '.join(families)}; one line of a run's "
            f"metrics.jsonl shows them all)")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def curves(run_dirs: Sequence[str | Path], metrics: Sequence[str] = ()) -> list[Panel]:
    """The panels of ``gdpo-ray plot`` (see the module docstring); ValueError for a run that is
    not a run directory, or a metric that no run logged."""
    runs = [read_run(d) for d in run_dirs]
    if not runs:
        raise ValueError("no run to plot: give one or more run directories")
    keys = list(dict.fromkeys(k for r in runs for row in r.rows for k in row if k not in ("step", "time")))
    for metric in metrics:
        if metric not in keys:
            raise ValueError(missing_metric(metric, keys))
    rewards = list(dict.fromkeys(n for r in runs for n in reward_names(r.rows)))
    wanted = {f"rewards/{n}/mean": n for n in rewards} | {m: m for m in metrics}
    names = labels(runs)
    panels = []
    for key, title in wanted.items():
        lines = []
        for i, run in enumerate(runs):
            at = [(int(r["step"]), float(r[key])) for r in run.rows if _number(r.get(key))]
            if at:
                lines.append(Line(i, names[i], tuple(s for s, _ in at), tuple(v for _, v in at)))
        panels.append(Panel(title, key, tuple(lines)))
    return panels


#: where a point's values come from
EVAL_REPORT, IN_TRAINING, TRAINING_REWARDS = "eval report", "in-training eval", "training rewards"


@dataclasses.dataclass(frozen=True)
class Point:
    """A run's checkpoint in ``gdpo-ray plot --pareto``: ``run``, the source's position among those
    given (its colour), ``name`` its name; ``step``, None for a report that records none; ``values``,
    one per column (NaN: not reported there); ``source``: EVAL_REPORT, IN_TRAINING or TRAINING_REWARDS."""

    run: int
    name: str
    step: int | None
    values: tuple[float, ...]
    source: str

    @property
    def label(self) -> str:
        return self.name if self.step is None else f"{self.name} step {self.step}"


def source_names(sources: Sequence[str | Path]) -> list[str]:
    """A run directory's name, a report file's without .json; sources of one name by their paths."""
    names = [Path(s).resolve().stem if Path(s).is_file() else Path(s).resolve().name for s in sources]
    return [n if names.count(n) == 1 else str(s) for n, s in zip(names, sources)]


def _checkpoint_columns(reports: Sequence[Mapping]) -> dict[str, object]:
    """Column -> value at one checkpoint, over its suites' reports: each metric as ``NAME`` where
    one suite reports it (else the suites that do, a tuple: ambiguous), and as ``SUITE/NAME``."""
    qualified: dict[str, object] = {}
    suites: dict[str, list[str]] = {}
    for r in reports:
        for metric, value in r["overall"].items():
            qualified[f"{r['suite']}/{metric}"] = math.nan if value is None else value
            suites.setdefault(metric, []).append(r["suite"])
    plain = {m: qualified[f"{by[0]}/{m}"] if len(by) == 1 else tuple(by) for m, by in suites.items()}
    return plain | qualified


def _eval_checkpoints(path: Path) -> list[tuple[int | None, dict, str, list[str]]]:
    """(step, columns, source, the columns to name in a message) per checkpoint evaluated."""
    by_step: dict[int | None, list] = {}
    for r in eval_reports(path):
        by_step.setdefault(r.get("step"), []).append(r)
    return [(step, _checkpoint_columns(rs),
             IN_TRAINING if all(r.get("source") == TRAINING_EVAL for r in rs) else EVAL_REPORT,
             [m for r in rs for m in r["overall"]])
            for step, rs in sorted(by_step.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]


def _training_checkpoints(path: Path) -> list[tuple[int | None, dict, str, list[str]]]:
    """(step, columns, source, its rewards) per step of a run's metrics.jsonl."""
    out = []
    for row in read_run(path).rows:
        columns = {k: v for k, v in row.items() if k not in ("step", "time") and _number(v)}
        rewards = reward_names([row])
        columns |= {name: columns.get(f"rewards/{name}/mean", math.nan) for name in rewards}
        out.append((int(row["step"]), columns, TRAINING_REWARDS, rewards))
    return out


def pareto_points(sources: Sequence[str | Path], columns: Sequence[str], training: bool = False) -> list[Point]:
    """The points of ``gdpo-ray plot --pareto`` (see the module docstring), in the order of the
    sources, then of their steps. ValueError for a source that is neither a report nor a run
    directory, a column no source reports (naming those they do), or a column that two suites of
    one checkpoint report (name it ``SUITE/NAME``)."""
    if not sources:
        raise ValueError("no run or report to plot: give run directories or eval report files")
    names, points, found = source_names(sources), [], {}
    for i, source in enumerate(sources):
        path = Path(source)
        if not path.exists():
            raise ValueError(f"{source} does not exist; give a run directory (as gdpo-ray train printed it) "
                             f"or an eval report (.json)")
        checkpoints = [] if training else _eval_checkpoints(path)
        if not checkpoints:  # no eval of it at all: its training rewards, said as such
            checkpoints = _training_checkpoints(path)
        for step, values, kind, shown in checkpoints:
            for column in columns:
                if isinstance(values.get(column), tuple):
                    raise ValueError(f"--pareto {column!r}: suites {', '.join(values[column])} of {source} "
                                     f"both report it; name one, e.g. {values[column][0]}/{column}")
            found.setdefault(kind, {}).update(dict.fromkeys(shown))
            points.append(Point(i, names[i], step, tuple(float(values.get(c, math.nan)) for c in columns), kind))
    for k, column in enumerate(columns):
        if all(math.isnan(p.values[k]) for p in points):
            raise ValueError(missing_column(column, found))
    return points


def missing_column(column: str, found: Mapping[str, Mapping[str, None]]) -> str:
    """The message for a --pareto column that no point has: the columns there are, by source."""
    plural = {EVAL_REPORT: "eval reports", IN_TRAINING: "in-training evals", TRAINING_REWARDS: "training rewards"}
    said = [f"{plural[kind]}: {', '.join(names) or 'none'}" for kind, names in found.items()]
    more = " (or any key of metrics.jsonl)" if TRAINING_REWARDS in found else ""
    return f"--pareto {column!r}: no run or report has it; the columns of the {'; of the '.join(said)}{more}"
