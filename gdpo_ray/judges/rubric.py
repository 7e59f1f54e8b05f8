"""A judge reward as configured: a rubric of criteria, each its own reward column.

A reward entry ``fn: judge`` names a judge (``judge:``: an OpenAI-compatible endpoint, or the
pool gdpo-ray serves) and a rubric (``criteria:``). It is not one column: each criterion is its
own column ``<reward>/<criterion>``, with its own weight and condition, so that GDPO normalizes
each criterion within its group apart from the others (DESIGN.md §1)::

    - name: quality
      fn: judge
      judge: {url: "http://127.0.0.1:8000/v1", model: my-judge, api_key_env: JUDGE_KEY}
      criteria:
        - {name: helpful, describe: "answers the question asked", scale: [0, 1]}
        - {name: concise, describe: "no needless words", scale: [0, 1], weight: 0.5}

gives the columns ``quality/helpful`` and ``quality/concise``. ``expand_judges`` turns such an
entry into one plain reward declaration per criterion (``fn: judge``, the rubric in ``params``),
which every other part of gdpo-ray reads as any column; it checks the entry and names what is
wrong. ``rubric_of`` reads a column's rubric back. The judge's prompt and the parsing of its
verdict are ``gdpo_ray.judges.verdict``'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from typing import Any, Mapping, Sequence

#: the ``fn`` of a judge's columns
JUDGE = "judge"
#: the keys of a ``fn: judge`` entry
ENTRY_KEYS = ("name", "fn", "judge", "criteria", "prompt", "weight", "condition")
#: the keys of one criterion
CRITERION_KEYS = ("name", "describe", "scale", "weight", "condition")
#: a criterion's name: a JSON key the judge writes back, and the second half of a column's name
CRITERION_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_\-]*$")
#: an environment variable's name
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class JudgeSetting:
    """Who judges: ``url`` (an OpenAI-compatible server's base URL, ending in /v1) or None for the
    pool gdpo-ray serves (``judges:`` section), ``model`` (the served model's name at the url; for
    the pool, what it loads: a model directory or a built-in name), ``api_key_env`` (the name of
    the environment variable holding the key, sent as a bearer token; the key itself is never in
    the config, logs or run files), and the call's settings."""

    model: str
    url: str | None = None
    api_key_env: str | None = None
    max_tokens: int = 256  # new tokens of a verdict
    temperature: float = 0.0  # 0: greedy
    timeout_s: float = 60.0  # one request (a pool's batch: one engine call)
    retries: int = 3  # of a request that failed in transport, timed out, or got a 5xx or 429
    max_in_flight: int = 16  # requests open at once per rollout actor (an endpoint's)

    _KEYS = ("model", "url", "api_key_env", "max_tokens", "temperature", "timeout_s", "retries", "max_in_flight")

    @property
    def served(self) -> bool:
        """The pool gdpo-ray serves (no url)."""
        return self.url is None


@dataclasses.dataclass(frozen=True)
class Criterion:
    name: str
    describe: str
    scale: tuple[float, float]


@dataclasses.dataclass(frozen=True)
class Rubric:
    """One judge reward: its ``name``, its judge, its criteria in order, its prompt template
    (None: ``verdict.DEFAULT_PROMPT``)."""

    name: str
    judge: JudgeSetting
    criteria: tuple[Criterion, ...]
    prompt: str | None = None

    def column(self, criterion: Criterion | str) -> str:
        return f"{self.name}/{criterion if isinstance(criterion, str) else criterion.name}"

    @property
    def columns(self) -> list[str]:
        return [self.column(c) for c in self.criteria]


def is_judge_entry(declaration: Any) -> bool:
    """A ``fn: judge`` entry as the user wrote it (not yet one column per criterion)."""
    return isinstance(declaration, Mapping) and declaration.get("fn") == JUDGE and "criteria" in declaration


def expand_judges(declarations: Sequence[Any]) -> list:
    """``declarations`` (training.rewards) with every ``fn: judge`` entry replaced, in place, by
    its criteria's columns (plain declarations); other entries, and columns already expanded,
    as they are. Raises ValueError naming the entry and the fix."""
    out: list = []
    for d in declarations:
        if isinstance(d, Mapping) and d.get("fn") == JUDGE and "criteria" not in d:
            params = d.get("params") if isinstance(d.get("params"), Mapping) else {}
            if "rubric" not in params:
                raise ValueError(f"reward {d.get('name', '?')!r} (fn: {JUDGE}) needs criteria: a list of "
                                 "{name, describe, scale}, each its own column <reward>/<criterion> "
                                 "(docs/judges.md)")
            out.append(d)  # a column expanded before (a validated config validated again)
        elif is_judge_entry(d):
            out.extend(_columns(d))
        else:
            out.append(d)
    return out


def _columns(entry: Mapping[str, Any]) -> list[dict]:
    rubric = _rubric(entry)
    plain = _plain_entry(entry)
    weight = entry.get("weight", 1.0)
    columns = []
    for c, raw in zip(rubric.criteria, plain["criteria"]):
        column: dict[str, Any] = {"name": rubric.column(c), "fn": JUDGE,
                                  "weight": raw.get("weight", weight),
                                  "params": {"rubric": plain, "criterion": c.name, "scale": list(c.scale)}}
        condition = raw.get("condition", entry.get("condition"))
        if condition is not None:
            column["condition"] = condition
        columns.append(column)
    return columns


def _plain_entry(entry: Mapping[str, Any]) -> dict:
    """The entry as plain data (JSON-able: Tune, the run's config file), for ``rubric_of``."""
    plain = {"name": str(entry["name"]), "judge": dict(entry["judge"]),
             "criteria": [{k: (list(v) if k == "scale" else v) for k, v in c.items()} for c in entry["criteria"]]}
    if entry.get("prompt") is not None:
        plain["prompt"] = entry["prompt"]
    return plain


def rubric_of(params: Mapping[str, Any]) -> Rubric:
    """The rubric a judge column's ``params`` carry (``expand_judges``' output)."""
    return _rubric(params["rubric"])


def _rubric(entry: Mapping[str, Any]) -> Rubric:
    name = entry.get("name")
    where = f"reward {name!r} (fn: {JUDGE})"
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"a judge reward needs a name without '/' (its columns are <name>/<criterion>); got {name!r}")
    _known(entry, ENTRY_KEYS, where)
    judge = _judge(entry.get("judge"), where)
    if "criteria" not in entry:
        _known(entry, [k for k in ENTRY_KEYS if k != "criteria"], where)  # `critera`: named with its fix
    criteria_in = entry.get("criteria")
    if not isinstance(criteria_in, Sequence) or isinstance(criteria_in, str) or not criteria_in:
        raise ValueError(f"{where}: criteria must be a non-empty list of {{name, describe, scale}}; "
                         f"got {criteria_in!r} (e.g. [{{name: helpful, describe: 'answers the question', "
                         f"scale: [0, 1]}}])")
    criteria = tuple(_criterion(c, where) for c in criteria_in)
    names = [c.name for c in criteria]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{where}: criterion names must be unique; repeated: {repeated}")
    prompt = entry.get("prompt")
    if prompt is not None:
        from gdpo_ray.judges.verdict import check_template

        check_template(prompt, where, [c.name for c in criteria])
    return Rubric(name, judge, criteria, prompt)


def _known(d: Mapping[str, Any], keys: Sequence[str], where: str) -> None:
    unknown = sorted((str(k) for k in d if k not in keys))
    if unknown:
        near = difflib.get_close_matches(unknown[0], keys, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"{where}: unknown key(s) {unknown}{hint}; allowed: {list(keys)}")


def _judge(d: Any, where: str) -> JudgeSetting:
    if isinstance(d, Mapping) and "api_key" not in d:
        _known(d, JudgeSetting._KEYS, f"{where}: judge")  # a misspelt key first: `modle`
    if not isinstance(d, Mapping) or not isinstance(d.get("model"), str) or not d.get("model"):
        raise ValueError(f"{where}: judge must be a mapping with a model: {{url: 'http://host:8000/v1', "
                         f"model: NAME, api_key_env: VAR}} for an OpenAI-compatible server, or {{model: "
                         f"smollm2}} for the pool gdpo-ray serves (judges: section); got {d!r}")
    if "api_key" in d:
        raise ValueError(f"{where}: never write a key in the config (it would be saved with the run): put "
                         "it in an environment variable and name the variable, e.g. api_key_env: JUDGE_KEY")
    url = d.get("url")
    if url is not None and not (isinstance(url, str) and re.match(r"^https?://[^/\s]+", url)):
        raise ValueError(f"{where}: judge.url must be an http(s) URL of an OpenAI-compatible server, e.g. "
                         f"http://127.0.0.1:8000/v1; got {url!r}")
    key_env = d.get("api_key_env")
    if key_env is not None:
        if not (isinstance(key_env, str) and ENV_NAME.match(key_env)):
            raise ValueError(f"{where}: judge.api_key_env names an environment variable (e.g. JUDGE_KEY); "
                             f"got {key_env!r}")
        if url is None:
            raise ValueError(f"{where}: judge.api_key_env is for an endpoint (judge.url); the pool "
                             "gdpo-ray serves needs no key")
    setting = JudgeSetting(model=d["model"], url=url.rstrip("/") if url else None, api_key_env=key_env,
                           **{k: d[k] for k in JudgeSetting._KEYS[3:] if k in d})
    _number(setting.max_tokens, "max_tokens", where, integer=True, low=1, high=100_000)
    _number(setting.temperature, "temperature", where, low=0, high=10)
    _number(setting.timeout_s, "timeout_s", where, low=1e-3, high=3600)
    _number(setting.retries, "retries", where, integer=True, low=0, high=100)
    _number(setting.max_in_flight, "max_in_flight", where, integer=True, low=1, high=10_000)
    return setting


def _number(value: Any, key: str, where: str, low: float, high: float, integer: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (integer and value != int(value)) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{where}: judge.{key} must be {kind} in [{low:g}, {high:g}]; got {value!r}")


def _criterion(c: Any, where: str) -> Criterion:
    if not isinstance(c, Mapping) or "name" not in c:
        raise ValueError(f"{where}: each criterion is a mapping {{name, describe, scale, weight, condition}}; "
                         f"got {c!r}")
    name = c["name"]
    if not isinstance(name, str) or not CRITERION_NAME.match(name):
        raise ValueError(f"{where}: criterion name {name!r} must be letters, digits, '_' or '-' (it is a JSON "
                         "key the judge writes and the second half of the column's name)")
    _known(c, CRITERION_KEYS, f"{where}: criterion {name!r}")
    describe = c.get("describe", "")
    if not isinstance(describe, str):
        raise ValueError(f"{where}: criterion {name!r}: describe is the text the judge reads; got {describe!r}")
    scale = c.get("scale", [0, 1])
    if not (isinstance(scale, Sequence) and not isinstance(scale, str) and len(scale) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in scale)
            and scale[0] < scale[1]):
        raise ValueError(f"{where}: criterion {name!r}: scale must be [low, high] with low < high, e.g. [0, 1] "
                         f"or [1, 10]; got {scale!r}")
    weight = c.get("weight", 1.0)
    if not (isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)):
        raise ValueError(f"{where}: criterion {name!r}: weight must be a finite number; got {weight!r}")
    return Criterion(name, describe, (float(scale[0]), float(scale[1])))
