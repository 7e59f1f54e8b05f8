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

``compare`` puts runs side by side, then each report's settings, and warns where reports of one
suite were made with different ``COMPARED_SETTINGS``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from gdpo_ray.eval import pass_at_k


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


def report_path(folder: str | Path, suite_name: str) -> Path:
    """Where a folder keeps the report of a suite: ``<folder>/eval/<suite>.json`` (":" and "/"
    of the name as "_")."""
    return Path(folder) / "eval" / (suite_name.replace(":", "_").replace("/", "_") + ".json")


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


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain-text table, columns aligned."""
    cells = [[str(h) for h in header]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
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


def compare(reports: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The paper-style table: one row per run (``reports``: run label -> its reports), each
    suite's overall metrics as columns (``suite/metric``); a run without a suite shows '-'.
    Then each report's settings, and a warning for each suite whose reports were made with
    different ``COMPARED_SETTINGS`` (an exceed ratio at a 64-token limit is no match for one at 4,000)."""
    columns: list[tuple[str, str]] = []
    for run_reports in reports.values():
        for r in run_reports:
            for m in r["overall"]:
                if (r["suite"], m) not in columns:
                    columns.append((r["suite"], m))
    rows = []
    for label, run_reports in reports.items():
        by_suite = {r["suite"]: r["overall"] for r in run_reports}
        rows.append([label, *[by_suite.get(s, {}).get(m) for s, m in columns]])
    text = table(rows, ["run", *[f"{s}/{m}" for s, m in columns]])
    return "\n\n".join([text, settings_table(reports), *settings_warnings(reports)])


def _setting_text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, Mapping):
        return ",".join(f"{k}={_setting_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ",".join(_setting_text(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def settings_table(reports: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """One row per report (run, suite): every setting it records, ``COMPARED_SETTINGS`` first."""
    recorded = [(label, r) for label, run_reports in reports.items() for r in run_reports]
    keys = list(dict.fromkeys(k for _, r in recorded for k in (r.get("settings") or {})))
    keys = [k for k in COMPARED_SETTINGS if k in keys] + [k for k in keys if k not in COMPARED_SETTINGS]
    rows = [[label, r["suite"], *[_setting_text((r.get("settings") or {}).get(k)) for k in keys]]
            for label, r in recorded]
    return "settings\n" + table(rows, ["run", "suite", *keys])


def settings_warnings(reports: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """One line per (suite, setting) where the suite's reports differ in a ``COMPARED_SETTINGS``
    value (each report's value, by run), then how to make them alike."""
    by_suite: dict[str, list[tuple[str, Mapping]]] = {}
    for label, run_reports in reports.items():
        for r in run_reports:
            by_suite.setdefault(r["suite"], []).append((label, r.get("settings") or {}))
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
