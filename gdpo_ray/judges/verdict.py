"""What a judge is asked, and what is read from its answer.

The judge gets one user message: the prompt template (``DEFAULT_PROMPT``, or the reward's
``prompt:``) with its placeholders filled in:

- ``{criteria}``: one line per criterion, ``- <name> (<low> to <high>): <describe>``;
- ``{prompt}``: the policy's prompt (chat messages as a transcript, ``[role]`` before each);
- ``{completion}``: what the policy answered (a multi-turn rollout's assistant and tool
  messages, as a transcript); required;
- ``{format}``: the answer's form, ``{"<name>": <score>, ...}``;
- ``{<column>}``: any other name is the dataset row's column (e.g. ``{ground_truth}``: a
  reference answer); a row without it is an error for that row, naming the column.

Any other brace (a JSON example in your own template) is left as it is.

The verdict (``parse_verdict``) is read as a JSON object mapping each criterion's name to its
score (a number, a numeric string, true/false, or ``{"score": n, ...}``): the first object in
the answer that names a criterion. Failing that, one tagged score per criterion
(``<helpful>1</helpful>``). Each criterion is then a float within its scale, or NaN with the
reason: no verdict at all, no score for it, not a number, outside its scale. Never a 0.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping, Sequence

DEFAULT_PROMPT = """You are a strict, fair judge. Score the response below on each criterion.

Criteria (name, scale, what it means):
{criteria}

The conversation the response answers:
{prompt}

The response:
{completion}

Reply with one JSON object and nothing else, mapping each criterion's name to its score: {format}"""

#: a placeholder of a template
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: the placeholders filled from the rollout itself
OWN = ("criteria", "prompt", "completion", "format")
#: the characters of an answer quoted in an error
QUOTED_CHARS = 200


def check_template(template: Any, where: str, criteria: Sequence[str] = ()) -> None:
    """A prompt template holds ``{completion}``, and tells the judge every criterion: through
    ``{criteria}`` or ``{format}``, or by its name (else the judge can never score it)."""
    if not isinstance(template, str) or "{completion}" not in template:
        raise ValueError(f"{where}: prompt must be a template string holding {{completion}} (and usually "
                         f"{{prompt}} and {{criteria}}; docs/judges.md); got {template!r:.200}")
    if "{criteria}" not in template and "{format}" not in template:
        unnamed = [c for c in criteria if c not in template]
        if unnamed:
            raise ValueError(f"{where}: the prompt never names the criteria {unnamed}, so the judge cannot score "
                             "them: put {criteria} (each criterion with its scale and description) and {format} "
                             "(the answer's JSON form) in it, or write their names")


def columns_asked(template: str) -> list[str]:
    """The dataset columns a template names (placeholders beyond its own)."""
    return [name for name in dict.fromkeys(PLACEHOLDER.findall(template)) if name not in OWN]


def transcript(content: Any) -> str:
    """A prompt or completion as text: a string as it is; chat messages one after another, each
    ``[role]`` then its text, an assistant's tool calls as ``call: name {arguments}``."""
    if isinstance(content, str):
        return content
    parts = []
    for m in content:
        text = m.get("content") or ""
        if not isinstance(text, str):  # content parts: their text
            text = "".join(p.get("text", "") for p in text if isinstance(p, Mapping))
        lines = [f"[{m.get('role', 'assistant')}]", text] if text else [f"[{m.get('role', 'assistant')}]"]
        for call in m.get("tool_calls") or ():
            fn = call.get("function", call)
            arguments = fn.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False, sort_keys=True)
            lines.append(f"call: {fn.get('name', '?')} {arguments}")
        parts.append("\n".join(lines))
    return "\n".join(parts)


def render(template: str | None, criteria: Sequence[Any], prompt: Any, completion: Any,
           row: Mapping[str, Any]) -> str:
    """The judge's message for one rollout; raises KeyError naming a column the row lacks."""
    own = {"criteria": "\n".join(f"- {c.name} ({_num(c.scale[0])} to {_num(c.scale[1])}): {c.describe}".rstrip(": ")
                                 for c in criteria),
           "prompt": transcript(prompt), "completion": transcript(completion),
           "format": "{" + ", ".join(f'"{c.name}": <{_num(c.scale[0])} to {_num(c.scale[1])}>' for c in criteria) + "}"}

    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name in own:
            return own[name]
        if name not in row:
            raise KeyError(f"the judge's prompt names {{{name}}}, which is not a column of this row "
                           f"(columns: {sorted(row)})")
        return transcript(row[name]) if isinstance(row[name], (list, str)) else str(row[name])

    return PLACEHOLDER.sub(fill, template if template is not None else DEFAULT_PROMPT)


def _num(v: float) -> str:
    return f"{v:g}"


def parse_verdict(text: str, criteria: Sequence[Any]) -> list[tuple[float, str]]:
    """Per criterion (in order): (score, "") or (NaN, why) — see the module docstring."""
    names = [c.name for c in criteria]
    found = _json_scores(text, names)
    how = "JSON"
    if found is None:
        found = _tagged_scores(text, names)
        how = "tags"
    if not found:
        quoted = " ".join(text.split())[:QUOTED_CHARS]
        why = (f"judge verdict unparsable: no JSON object naming a criterion and no <{names[0]}>...</{names[0]}> "
               f"tags in its answer: {quoted!r}")
        return [(math.nan, why)] * len(criteria)
    out = []
    for c in criteria:
        if c.name not in found:
            out.append((math.nan, f"judge verdict has no score for {c.name!r} (its {how} named "
                                  f"{sorted(found)})"))
            continue
        value = _number(found[c.name])
        if value is None:
            out.append((math.nan, f"judge scored {c.name!r} {found[c.name]!r:.80}: not a number"))
        elif not c.scale[0] <= value <= c.scale[1]:
            out.append((math.nan, f"judge scored {c.name!r} {_num(value)}, outside its scale "
                                  f"[{_num(c.scale[0])}, {_num(c.scale[1])}]"))
        else:
            out.append((value, ""))
    return out


def _json_scores(text: str, names: Sequence[str]) -> dict[str, Any] | None:
    """The first JSON object of ``text`` (a fenced block too) with a key naming a criterion
    (matched without case or surrounding blanks), as {criterion: raw value}."""
    decoder = json.JSONDecoder()
    wanted = {n.lower(): n for n in names}
    for start in (m.start() for m in re.finditer(r"\{", text)):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        hits = {wanted[k.strip().lower()]: v for k, v in obj.items()
                if isinstance(k, str) and k.strip().lower() in wanted}
        if hits:
            return hits
    return None


def _tagged_scores(text: str, names: Sequence[str]) -> dict[str, str]:
    out = {}
    for name in names:
        m = re.search(rf"<\s*{re.escape(name)}\s*>(.*?)<\s*/\s*{re.escape(name)}\s*>", text, re.IGNORECASE | re.DOTALL)
        if m:
            out[name] = m.group(1).strip()
    return out


def _number(raw: Any) -> float | None:
    if isinstance(raw, Mapping) and "score" in raw:
        raw = raw["score"]
    if isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            return None
    else:
        return None
    return value if math.isfinite(value) else None
