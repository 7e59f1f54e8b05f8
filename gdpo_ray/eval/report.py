"""Eval reports: per-sample scores -> per-item avg@n -> per-category and overall metrics.

A suite scores each sample (one completion) as a dict of metric -> value in [0, 1], under the
metric's report name (``pass@1``, ``bug_ratio``, ``exceed_ratio``, ``accuracy``,
``format_ratio``); NaN marks a sample the scorer could not score (a sandbox failure, a length
with no token count): it is left out of that metric's means and counted under ``missing``.

- an item's value of a metric is the mean over its n samples (avg@n: ``pass@1`` averaged over
  16 samples, as the paper reports math and code);
- a category's is the mean over its items, and so is ``overall`` unless the suite groups
  categories its own way (BFCL: ``Suite.overall``);
- with ``pass_k``, ``pass@k`` (Chen et al.'s unbiased estimator, ``gdpo_ray.eval.pass_at_k``)
  per item from its n samples, then per category and overall as above (``Suite.overall_of``).

The report (``build_report``) is one JSON object: ``suite``, ``policy``, ``settings``,
``overall`` (metric -> value), ``categories`` (category -> metric -> value, plus ``items``),
``items`` (id -> category, metric values and its samples), ``counts`` (items, samples, and the
samples not generated because their prompt was over the actors' max_prompt_tokens),
``missing`` and ``errors`` (the samples whose scoring failed, each ``{"item", "sample",
"error"}``: they score 0, see ``gdpo_ray.run.eval_runner.score``).

``compare`` puts runs and their checkpoints side by side, one table per suite: one row per
metric (``metric_order``: each reward column's mean first, then the pass rates), one column per
report (run, and the policy's step where the report records one: ``"step"``, written by in-training
evals and by ``gdpo-ray eval`` of a checkpoint); then each report's settings, and a warning where
reports of one suite were made with different ``COMPARED_SETTINGS``. ``training_evals`` turns a
run's ``metrics.jsonl`` rows (in-training evals log ``eval/<suite>/<metric>`` on their steps; only the
last one is written as a report) into reports of their overall metrics alone.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from gdpo_ray.eval import pass_at_k
from gdpo_ray.eval.correct import ACCURACY, PASS_RATE, Condition, judge

#: a rewards suite's failure rate of a column (``gdpo_ray.eval.rewards_suite``, which imports this module)
FAILURE = "/failure_rate"


def nanmean(values: Iterable[float]) -> float:
    """The mean of the values that are not NaN (NaN when there are none)."""
    kept = [float(v) for v in values if not math.isnan(float(v))]
    return sum(kept) / len(kept) if kept else math.nan


def item_metrics(samples: Sequence[Mapping[str, float]], metrics: Sequence[str]) -> dict[str, float]:
    """avg@n: each metric's mean over the item's scored samples."""
    return {m: nanmean(s[m] for s in samples) for m in metrics}


def category_metrics(items: Mapping[str, Mapping[str, Any]], metrics: Sequence[str]) -> dict[str, dict]:
    """category -> each metric's mean over the category's items, and its number of items."""
    by_category: dict[str, list] = {}
    for item in items.values():
        by_category.setdefault(item["category"], []).append(item)
    return {cat: {**{m: nanmean(i[m] for i in rows) for m in metrics}, "items": len(rows)}
            for cat, rows in sorted(by_category.items())}


def mean_over_items(items: Mapping[str, Mapping[str, Any]], metrics: Sequence[str]) -> dict[str, float]:
    return {m: nanmean(i[m] for i in items.values()) for m in metrics}


def build_report(suite: Any, scored: Mapping[str, Sequence[Mapping[str, Any]]], categories: Mapping[str, str],
                 policy: str, settings: Mapping[str, Any], pass_k: Sequence[int] = ()) -> dict:
    """The report of ``suite`` from ``scored`` (item id -> its samples: the sample's
    ``completion`` and its metric values) and ``categories`` (item id -> category); with
    ``pass_k``, each item, category and ``overall`` also has ``pass@k`` for those k
    (``gdpo_ray.eval.pass_at_k``; ``pass@1`` stays the avg@n mean where the suite reports it)."""
    metrics = list(suite.metrics)
    ks = [k for k in pass_k if pass_at_k.key(k) not in metrics]
    correct = suite.correct_metric() if ks else None
    if ks and correct is None:
        raise ValueError(f"suite {suite.name} reports neither pass@1 nor accuracy: it has no pass@k")
    items = {}
    for item_id, samples in scored.items():
        items[item_id] = {"category": categories[item_id], **item_metrics(samples, metrics),
                          **(pass_at_k.item_pass_at_k(samples, correct, ks) if ks else {}),
                          "samples": [dict(s) for s in samples]}
    per_category = category_metrics(items, metrics + [pass_at_k.key(k) for k in ks])
    overall = suite.overall(items, per_category)
    overall |= {pass_at_k.key(k): suite.overall_of(pass_at_k.key(k), items, per_category) for k in ks}
    missing = {m: sum(math.isnan(float(s[m])) for ss in scored.values() for s in ss) for m in metrics}
    errors = [{"item": item_id, "sample": k, "error": s["error"]}
              for item_id, samples in scored.items() for k, s in enumerate(samples) if "error" in s]
    return {"suite": suite.name, "policy": policy, "settings": dict(settings), "overall": overall,
            "categories": per_category, "items": items, "missing": missing, "errors": errors,
            "counts": {"items": len(items), "samples": sum(len(s) for s in scored.values()),
                       "prompt_too_long": sum(s.get("finish_reason") == "prompt_too_long"
                                              for ss in scored.values() for s in ss)}}


def _json_safe(value: Any) -> Any:
    """NaN -> None (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def report_path(folder: str | Path, suite_name: str, step: int | None = None) -> Path:
    """Where a folder keeps the report of a suite: ``<folder>/eval/<suite>.json`` (":" and "/"
    of the name as "_"); with ``step`` (a checkpoint's policy version), ``<suite>@step_<step>.json``."""
    name = suite_name.replace(":", "_").replace("/", "_") + (f"@step_{step}" if step is not None else "")
    return Path(folder) / "eval" / (name + ".json")


def write_report(report: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(report), indent=1) + "\n")
    return path


def read_report(path: str | Path) -> dict:
    """A report written by ``write_report``; a run directory reads its ``eval/`` reports."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not an eval report ({err})") from None
    if not isinstance(report, dict) or "overall" not in report or "suite" not in report:
        raise ValueError(f"{path}: not an eval report (no 'suite' and 'overall'); write one with "
                         f"gdpo-ray eval POLICY --suite NAME --output {path.name}")
    return report


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table(rows: Sequence[Sequence[Any]], header: Sequence[str], left: int = 1) -> str:
    """A plain-text table, columns aligned: the first ``left`` to the left (names), the rest to the right."""
    cells = [[str(h) for h in header]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def format_report(report: Mapping[str, Any]) -> str:
    """The overall metrics, then one row per category; then how many samples could not be
    scored (their scoring failed: they score 0), with the first reason."""
    metrics = list(report["overall"])
    rows = [["overall", *[report["overall"][m] for m in metrics], report["counts"]["items"]]]
    rows += [[cat, *[c.get(m) for m in metrics], c["items"]] for cat, c in report["categories"].items()]
    text = table(rows, [report["suite"], *metrics, "items"])
    errors = report.get("errors") or []
    if errors:
        first = errors[0]
        text += (f"\n{len(errors)} sample(s) scored 0 because scoring them failed (the report's "
                 f"errors), e.g. {first['item']} sample {first['sample']}: {first['error']}")
    return text


#: the settings that change a report's numbers: ``compare`` warns when reports of one suite differ
#: in one (a value not recorded, None, is not compared)
COMPARED_SETTINGS = ("samples", "temperature", "top_p", "max_tokens", "length_limit", "items",
                     "chat_template", "max_prompt_tokens", "system_prompt", "reward_weights", "correct",
                     "tool_environment", "max_turns", "tool_timeout", "tools_in_system_prompt")


#: the ``source`` of a report read from a run's ``metrics.jsonl`` (``training_evals``)
TRAINING_EVAL = "metrics.jsonl"
_PASS_AT_K = re.compile(r"pass@\d+")


def training_evals(rows: Iterable[Mapping[str, Any]]) -> list[dict]:
    """The in-training evals in a run's ``metrics.jsonl`` (``rows``: one per step, the latest
    logged: ``gdpo_ray.run.outputs.latest_rows``), one report per suite and step: ``{"suite",
    "step", "overall", "source": TRAINING_EVAL}``, nothing else (the log keeps the overall metrics
    only: no settings, items or samples). A key is ``eval/<suite>/<metric>``: a suite's name has no
    "/" (``report_path``), a metric may have several (``quality/helpful/pass_rate``). A NaN metric
    is not logged, so it is absent here."""
    found: dict[tuple[str, int], dict] = {}
    for row in rows:
        for key, value in row.items():
            suite, _, metric = key.removeprefix("eval/").partition("/")
            if not key.startswith("eval/") or not metric or "step" not in row or not _number(value):
                continue
            step = int(row["step"])
            found.setdefault((suite, step), {"suite": suite, "step": step, "overall": {},
                                             "source": TRAINING_EVAL})["overall"][metric] = float(value)
    return sorted(found.values(), key=lambda r: r["step"])


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_order(metrics: Sequence[str]) -> list[str]:
    """A suite's rows in ``compare``: each reward column's mean (a metric with a
    ``<name>/failure_rate`` beside it: the rewards suite's columns, ``quality/helpful`` as any),
    then what counts correct samples (``accuracy``, each ``<name>/pass_rate``, ``pass@k`` by k),
    then the rest as listed (``weighted_sum``, ``exceed_ratio``, a suite's own), then the failure rates."""
    columns = [m for m in metrics if m + FAILURE in metrics]
    failures = [m + FAILURE for m in columns]
    rest = [m for m in metrics if m not in columns]
    correct = ([ACCURACY] if ACCURACY in rest else []) + [m for m in rest if m.endswith(PASS_RATE)] \
        + sorted((m for m in rest if _PASS_AT_K.fullmatch(m)), key=lambda m: int(m[len("pass@"):]))
    first = set(columns) | set(failures) | set(correct)
    return [*columns, *correct, *(m for m in metrics if m not in first), *failures]


def step_label(report: Mapping[str, Any]) -> str:
    """The checkpoint a report is of: ``step N`` (the policy version it records), else ``-``."""
    return "-" if report.get("step") is None else f"step {report['step']}"


def _by_step(report: Mapping[str, Any]) -> tuple:
    return (report.get("step") is None, report.get("step") or 0)


def compare(reports: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The runs side by side (``reports``: run label -> its reports), one table per suite: a row
    per metric (``metric_order``), a column per report, grouped by run and ordered by step (a
    report without one last: ``-``); a run without the suite has no column, a metric a report
    lacks shows '-'. Then the in-training evals' source (``training_evals``), each report's
    settings, and a warning for each suite whose reports were made with different
    ``COMPARED_SETTINGS`` (an exceed ratio at a 64-token limit is no match for one at 4,000)."""
    suites = list(dict.fromkeys(r["suite"] for run_reports in reports.values() for r in run_reports))
    parts = [suite_table(suite, reports) for suite in suites]
    logged = [f"{label} {step_label(r)}" for label, run_reports in reports.items() for r in run_reports
              if r.get("source") == TRAINING_EVAL]
    if logged:
        parts.append(f"from metrics.jsonl (in-training evals, the run's training.eval_* settings; no report "
                     f"was written of them): {', '.join(logged)}")
    full = {label: [r for r in run_reports if r.get("source") != TRAINING_EVAL]
            for label, run_reports in reports.items()}
    if any(full.values()):
        parts += [settings_table(full), *settings_warnings(full)]
    return "\n\n".join(parts)


def suite_table(suite: str, reports: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """``compare``'s table of one suite."""
    groups, columns = [], []
    for label, run_reports in reports.items():
        mine = sorted((r for r in run_reports if r["suite"] == suite), key=_by_step)
        if mine:
            groups.append((label, [step_label(r) for r in mine]))
            columns += [r["overall"] for r in mine]
    if not any(r.get("step") is not None for rs in reports.values() for r in rs if r["suite"] == suite):
        groups = [(label, [""] * len(subs)) for label, subs in groups]  # no step to tell apart
    listed = sorted((r for rs in reports.values() for r in rs if r["suite"] == suite),
                    key=lambda r: r.get("source") == TRAINING_EVAL)  # a written report's order first
    metrics = metric_order(list(dict.fromkeys(m for r in listed for m in r["overall"])))
    return grouped_table(suite, groups, [[m, *(overall.get(m) for overall in columns)] for m in metrics])


def grouped_table(corner: str, groups: Sequence[tuple[str, Sequence[str]]], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table whose value columns come in groups (a run's checkpoints): each group's
    label over its columns, then each column's own label where any has one (``""``: none), then
    ``rows`` (``[label, *one value per column]``); values right-aligned, a group's label too."""
    subs = [s for _, cols in groups for s in cols]
    cells = [[_cell(v) for v in row[1:]] for row in rows]
    widths = [max([len(s), *(len(r[j]) for r in cells)]) for j, s in enumerate(subs)]
    spans, j = [], 0
    for label, cols in groups:
        last = j + len(cols) - 1
        span = sum(widths[j:last + 1]) + 2 * (len(cols) - 1)
        widths[last] += max(0, len(label) - span)  # a label wider than its columns widens the last
        spans.append(max(span, len(label)))
        j = last + 1
    first = max([len(corner), *(len(str(r[0])) for r in rows)])
    lines = ["  ".join([corner.ljust(first), *(label.rjust(w) for (label, _), w in zip(groups, spans))])]
    if any(subs):
        lines.append("  ".join(["".ljust(first), *(s.rjust(w) for s, w in zip(subs, widths))]))
    lines.append("  ".join(["-" * first, *("-" * w for w in widths)]))
    lines += ["  ".join([str(row[0]).ljust(first), *(c.rjust(w) for c, w in zip(cs, widths))])
              for row, cs in zip(rows, cells)]
    return "\n".join(line.rstrip() for line in lines)


def pass_rates(report: Mapping[str, Any], conditions: Sequence[Condition]) -> dict[str, float]:
    """``<NAME>/pass_rate`` of a written report from its samples, as an eval with ``conditions``
    (``gdpo_ray.eval.correct``) reports it: each sample judged, the mean over an item's samples
    (avg@n), then over the items (NaN where none counts). Only the conditions on the report's
    metrics; {} for a report without samples (an in-training eval read from ``metrics.jsonl``). A
    value written as null (NaN: the reward failed) fails its conditions."""
    mine = [c for c in conditions if c.name in report["overall"]]
    items = [item.get("samples") or [] for item in (report.get("items") or {}).values()]
    if not mine or not any(items):
        return {}
    names = {c.name for c in mine}
    per_item = []
    for samples in items:
        judged = [judge(mine, {k: math.nan if s.get(k) is None else s[k] for k in names}
                        | {"not_applicable": s.get("not_applicable") or ()}) for s in samples]
        per_item.append({k: nanmean(j[k] for j in judged) for k in judged[0] if k != ACCURACY} if judged else {})
    keys = list(dict.fromkeys(c.name + PASS_RATE for c in mine))
    return {k: nanmean(i.get(k, math.nan) for i in per_item) for k in keys}


def _setting_text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, Mapping):
        return ",".join(f"{k}={_setting_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ",".join(_setting_text(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def settings_table(reports: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """One row per report (run, suite, and its step where any report has one): every setting it
    records, ``COMPARED_SETTINGS`` first."""
    recorded = [(label, r) for label, run_reports in reports.items() for r in run_reports]
    keys = list(dict.fromkeys(k for _, r in recorded for k in (r.get("settings") or {})))
    keys = [k for k in COMPARED_SETTINGS if k in keys] + [k for k in keys if k not in COMPARED_SETTINGS]
    stepped = any(r.get("step") is not None for _, r in recorded)
    rows = [[label, r["suite"], *([_setting_text(r.get("step"))] if stepped else []),
             *[_setting_text((r.get("settings") or {}).get(k)) for k in keys]] for label, r in recorded]
    return "settings\n" + table(rows, ["run", "suite", *(["step"] if stepped else []), *keys])


def settings_warnings(reports: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """One line per (suite, setting) where the suite's reports differ in a ``COMPARED_SETTINGS``
    value (each report's value, by run), then how to make them alike."""
    by_suite: dict[str, list[tuple[str, Mapping]]] = {}
    for label, run_reports in reports.items():
        for r in run_reports:
            where = label if r.get("step") is None else f"{label} {step_label(r)}"
            by_suite.setdefault(r["suite"], []).append((where, r.get("settings") or {}))
    lines = []
    for suite, recorded in by_suite.items():
        differ = []
        for key in COMPARED_SETTINGS:
            values = [(label, s[key]) for label, s in recorded if s.get(key) is not None]
            if len({json.dumps(v, sort_keys=True) for _, v in values}) > 1:
                differ.append(f"warning: {suite} {key} differs: "
                              + ", ".join(f"{_setting_text(v)} ({label})" for label, v in values))
        if differ:
            lines.append("\n".join(differ) + f"\nThe {suite} reports do not compare like for like: evaluate "
                         f"again with the same settings (gdpo-ray eval RUN --suite {suite} with --samples, "
                         f"--max-tokens, --rewards RUN, ...)")
    return lines
