"""Reading a prompt dataset into rows, with errors that name the file and the 1-based line.

``load_prompts(prompts, num_prompts, seed)`` turns the ``data.prompts`` setting into what
``read_dataset`` takes: a built-in task (``task:<name>``) becomes its rows, anything else is passed on.

``read_dataset(data)`` takes a parquet or jsonl path (``.jsonl``, or ``.json`` holding JSON lines or
one JSON array), a Hugging Face ``datasets.Dataset``, an Arrow table or a list of dicts, and
returns ``Rows``: plain dicts, every row with the same keys (a key missing from a row is None
there), and where each row came from, for messages. JSON lines are read one line at a time with
Python's ``json`` (any row size works; there is no block size), strictly: NaN and Infinity are
not JSON, text must be UTF-8. A row may nest ``MAX_NESTING`` levels (objects and arrays inside
one another, the row itself the first): a deeper one is refused when read, naming its line (or
row) and column, whatever its depth; an Arrow column, by its type. A file read once is not read
again by the same process while it is unchanged (the start-up check and the run share it).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa


@dataclasses.dataclass
class Rows:
    rows: list[dict]
    source: str  # the file, or "the dataset"
    numbers: list[int]  # 1-based line (jsonl) or row number of each row, for messages
    unit: str = "row"  # "line" for JSON lines

    def where(self, i: int) -> str:
        """Where row ``i`` (0-based) came from: "data.jsonl, line 12"."""
        return f"{self.source}, {self.unit} {self.numbers[i]}"

    def __len__(self) -> int:
        return len(self.rows)


_CACHE: dict[tuple, Rows] = {}

#: how deep a row may nest (objects and arrays inside one another; the row itself is level 1).
#: Python's json reader, pickle (which carries rows to the actors) and every walk of a value
#: recurse once a level, and fail past ~1,000 levels with a RecursionError naming nothing
MAX_NESTING = 100


def read_dataset(data: Any) -> Rows:
    if isinstance(data, Rows):
        return data
    if isinstance(data, (str, Path)):
        path = Path(data).expanduser()
        if not path.is_file():
            hint = " (it is a directory: name a .parquet or .jsonl file)" if path.is_dir() else ""
            raise ValueError(f"dataset {str(data)!r} does not exist{hint}; data.prompts takes a "
                             f".parquet or .jsonl file, or task:<name> for a built-in task")
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        if key not in _CACHE:
            _CACHE.clear()  # one dataset at a time
            _CACHE[key] = _read_file(path)
        return _CACHE[key]
    if hasattr(data, "data") and hasattr(data.data, "table"):  # datasets.Dataset
        data = data.data.table
    if isinstance(data, pa.Table):
        _check_nesting(data.schema, "the dataset")
        return _complete(data.to_pylist(), "the dataset", list(range(1, data.num_rows + 1)))
    if isinstance(data, list):
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise ValueError(f"dataset row {i + 1}: a row is a mapping of columns; got "
                                 f"{type(row).__name__}")
        return _complete([dict(r) for r in data], "the dataset", list(range(1, len(data) + 1)))
    raise ValueError(f"dataset must be a .parquet/.jsonl path, an Arrow table, a "
                     f"datasets.Dataset or a list of rows; got {type(data).__name__}")


def _read_file(path: Path) -> Rows:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # noqa: BLE001 - pyarrow's error types vary
            raise ValueError(f"{path}: cannot be read as parquet ({type(err).__name__}: {err})") from None
        _check_nesting(table.schema, str(path))
        return _complete(table.to_pylist(), str(path), list(range(1, table.num_rows + 1)))
    if path.suffix in (".jsonl", ".json"):
        with path.open("rb") as f:
            head = f.read(4096).lstrip()
        if path.suffix == ".json" and head.startswith(b"["):
            return _read_json_array(path)
        return _read_json_lines(path)
    raise ValueError(f"dataset {str(path)!r}: use a .parquet or .jsonl file")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON; write null for a missing value")


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg}, column {err.colno}); each line "
                         f"of a .jsonl file holds one JSON object") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    except RecursionError:  # nested within MAX_NESTING, but read deep in a call stack
        raise ValueError(f"{where}: nested too deep to be read here; flatten it") from None


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_SQUARE = str.maketrans("{}", "[]")
_TOKEN = re.compile(r'("[^"\\]*(?:\\.[^"\\]*)*")(\s*:)?|[\[{]|[\]}]')


def _may_nest_deeper(text: str, levels: int) -> bool:
    """False where JSON ``text`` surely nests at most ``levels`` levels, found at the speed of C:
    it has that few brackets, or its brackets outside strings lose their innermost pairs (one
    level) ``levels`` times and are gone; brackets that do not pair are left for the parser."""
    if text.count("[") + text.count("{") <= levels:
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).translate(_SQUARE)
    for _ in range(levels):
        shorter = brackets.replace("[]", "")
        if not shorter or len(shorter) == len(brackets):
            return False
        brackets = shorter
    return True


def _too_deep(text: str, levels: int, key_level: int) -> tuple[int, str | None] | None:
    """Where JSON ``text`` first nests deeper than ``levels``: (the objects or arrays opened at
    level 2 so far, i.e. the 1-based row of a JSON array; the last key seen at ``key_level``,
    i.e. the row's column), or None. A scan of every token: for a text ``_may_nest_deeper``."""
    depth, opened, key = 0, 0, None
    for m in _TOKEN.finditer(text):
        if m.group(1) is not None:
            if m.group(2) and depth == key_level:
                key = json.loads(m.group(1))
        elif m.group() in "[{":
            depth += 1
            opened += depth == 2
            if depth > levels:
                return opened, key
        else:
            depth -= 1
    return None


def _check_nesting(schema: pa.Schema, source: str) -> None:
    """Every column of an Arrow table nests at most ``MAX_NESTING`` levels with its row (a list,
    a struct or a map is a level): its type says so for every row."""
    for field in schema:
        levels, todo = 1, [(field.type, 2)]
        while todo:
            kind, level = todo.pop()
            if kind.num_fields:
                levels = max(levels, level)
                todo += [(kind.field(i).type, level + 1) for i in range(kind.num_fields)]
            if levels > MAX_NESTING:
                raise ValueError(f"{source}: column {field.name!r} nests more than {MAX_NESTING} levels "
                                 f"(lists, structs and maps inside one another); a row may nest at most "
                                 f"{MAX_NESTING}: flatten it (e.g. store the deep value as a JSON string)")


def _deep_row(where: str, column: str | None) -> ValueError:
    inside = f"column {column!r} " if column is not None else ""
    return ValueError(f"{where}: {inside}nests more than {MAX_NESTING} levels (objects and arrays inside one "
                      f"another); a row may nest at most {MAX_NESTING}: flatten it (e.g. store the deep value "
                      f"as a JSON string)")


def _read_json_lines(path: Path) -> Rows:
    rows, numbers = [], []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}, line {number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text (byte {raw[err.start:err.start + 1]!r} "
                                 f"at column {err.start + 1}); save the file as UTF-8") from None
            if _may_nest_deeper(text, MAX_NESTING) and (deep := _too_deep(text, MAX_NESTING, 1)):
                raise _deep_row(where, deep[1])
            row = _parse(text, where)
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a row must be a JSON object {{\"prompt\": ...}}; got "
                                 f"{type(row).__name__}")
            rows.append(row)
            numbers.append(number)
    if not rows:
        raise ValueError(f"{path}: the dataset has no rows")
    return _complete(rows, str(path), numbers, unit="line")


def _read_json_array(path: Path) -> Rows:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (at byte {err.start}); save the file as UTF-8") from None
    if _may_nest_deeper(text, MAX_NESTING + 1) and (deep := _too_deep(text, MAX_NESTING + 1, 2)):
        raise _deep_row(f"{path}, row {deep[0]}", deep[1])  # the array is a level above its rows
    rows = _parse(text, str(path))
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: a .json dataset is JSON lines or one array of objects")
    return _complete(rows, str(path), list(range(1, len(rows) + 1)))


def _complete(rows: list[dict], source: str, numbers: list[int], unit: str = "row") -> Rows:
    """Every row with every key (None where a row lacks one)."""
    if not rows:
        raise ValueError(f"{source}: the dataset has no rows")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    if any(len(r) != len(keys) for r in rows):
        rows = [{k: r.get(k) for k in keys} for r in rows]
    return Rows(rows, source, numbers, unit)


def load_prompts(prompts: Any, num_prompts: int | None = None, seed: int = 0) -> Any:
    """``data.prompts``: ``task:<name>`` -> the task's rows (``num_prompts`` of them, drawn with
    ``seed``); a path, a dataset, a table or rows -> itself."""
    if isinstance(prompts, str) and prompts.startswith("task:"):
        from gdpo_ray.tasks import task_rows

        return task_rows(prompts, num_prompts, seed)
    return prompts


#: what an Arrow conversion of a column's values raises when they do not fit one typed column
_UNFIT = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, UnicodeEncodeError)


def _fits(values: list) -> bool:
    try:
        pa.array(values)
    except _UNFIT:
        return False
    return True


def check_column_types(rows: list[dict], columns: list[str], where: Any) -> None:
    """Every column in ``columns`` can be stored as one typed Arrow column over all ``rows`` (the
    record batch carries each task column so, DESIGN.md §3); else a ValueError naming the column,
    the first row that does not fit (``where(i)``: where row i came from), its value and the fix.
    Mixed kinds (a string among numbers), integers outside int64 and text that is not UTF-8
    (lone surrogates) are what fails. The first failing prefix is found by bisection, so a column
    that fits costs one conversion."""
    for name in columns:
        values = [r.get(name) for r in rows]
        if _fits(values):
            continue
        lo, hi = 1, len(values)  # the shortest prefix that does not fit
        while lo < hi:
            mid = (lo + hi) // 2
            if _fits(values[:mid]):
                lo = mid + 1
            else:
                hi = mid
        bad, value = lo - 1, values[lo - 1]
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        alone = _fits([value])
        before = pa.array(values[:bad]).type if bad and alone else None
        why = (f"does not fit the type {before} of the rows before it" if before is not None and
               not pa.types.is_null(before) else
               "does not fit the values before it" if alone else
               "cannot be stored in a column (an integer outside int64, or text that is not UTF-8)")
        raise ValueError(f"column {name!r}, {where(bad)}: {shown} ({type(value).__name__}) {why}; "
                         f"every row of a column needs values of one kind (e.g. all strings: "
                         f"\"{name}\": \"12\", or all numbers), integers within int64 and valid "
                         f"UTF-8 text")
