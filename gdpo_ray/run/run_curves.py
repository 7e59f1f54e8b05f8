"""The curves that ``gdpo-ray plot`` draws, read from run directories (no drawing here: that is
``gdpo_ray.run.plot_command``).

``curves(runs, metrics)`` gives one ``Panel`` per reward (the union over the runs of the keys
``rewards/<name>/mean`` of their ``metrics.jsonl``, in the order they first appear) and one per
named metric (any key of ``metrics.jsonl``), each with one ``Line`` per run that logged the key:
its steps and values (the latest row of each step: ``outputs.latest_rows``), labelled by the
run's name and, where its ``config.yaml`` names one, its estimator ("demo-1 (GRPO)").
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Mapping, Sequence

from gdpo_ray.config import FIELDS
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
