"""Reading datasets: every malformed file fails naming the file, the 1-based line and the fix."""

import json

import pytest

from actors.prompts import PromptSource
from gdpo_ray.data import read_dataset


def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_bytes(b"\n".join(l if isinstance(l, bytes) else l.encode() for l in lines) + b"\n")
    return str(path)


GOOD = json.dumps({"prompt": "1+1?", "ground_truth": "2"})


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "x", "ground_truth": NaN}', r"line 3: NaN is not valid JSON; write null"),
    ('{"prompt": "x", "score": -Infinity}', r"line 3: -Infinity is not valid JSON"),
    ('{"prompt": "x", ', r"line 3: not valid JSON \(Expecting property name"),
    ('["a list"]', r"line 3: a row must be a JSON object"),
    (b'{"prompt": "caf\xe9"}', r"line 3: not UTF-8 text \(byte b'\\xe9' at column 16\); save the file as UTF-8"),
])
def test_a_bad_line_is_named_with_the_file_and_its_line(tmp_path, bad, message):
    path = write(tmp_path, "data.jsonl", [GOOD, "", bad, GOOD])  # line 2 is blank
    with pytest.raises(ValueError, match=f"data.jsonl, {message}"):
        read_dataset(path)


def test_any_row_size_reads(tmp_path):
    # one row far larger than pyarrow's JSON block (which failed with "straddling object")
    big = json.dumps({"prompt": "x" * (8 << 20), "ground_truth": "1"})
    rows = read_dataset(write(tmp_path, "big.jsonl", [GOOD, big, GOOD]))
    assert len(rows) == 3 and len(rows.rows[1]["prompt"]) == 8 << 20


def test_rows_get_every_key_and_their_line_numbers(tmp_path):
    path = write(tmp_path, "d.jsonl", [GOOD, "", json.dumps({"prompt": "q", "extra": 1})])
    rows = read_dataset(path)
    assert rows.rows[1] == {"prompt": "q", "ground_truth": None, "extra": 1}
    assert rows.rows[0]["extra"] is None
    assert rows.where(1).endswith("d.jsonl, line 3")


def test_json_arrays_parquet_and_missing_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))
    assert [r["prompt"] for r in read_dataset(str(tmp_path / "a.json")).rows] == ["a", "b"]
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: cannot be read as parquet"):
        read_dataset(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match=r"'nope.jsonl' does not exist; data.prompts takes"):
        read_dataset("nope.jsonl")
    with pytest.raises(ValueError, match="is a directory"):
        read_dataset(str(tmp_path))


def nested(levels, inner='"x"'):
    """JSON text of ``levels`` arrays inside one another around ``inner``."""
    return "[" * levels + inner + "]" * levels


def test_rows_of_any_nesting_are_named_never_a_recursion_error(tmp_path):
    from gdpo_ray.data import MAX_NESTING

    assert MAX_NESTING == 100
    # the row is level 1: a column of 99 arrays inside one another nests 100 levels, 100 arrays 101
    at_most = '{"prompt": "q", "meta": %s}' % nested(99)
    assert read_dataset(write(tmp_path, "ok.jsonl", [GOOD, at_most])).rows[1]["meta"] is not None
    for levels in (100, 5000, 200_000):  # past ~1,000 Python's json module raised RecursionError
        path = write(tmp_path, "deep.jsonl", [GOOD, "", '{"prompt": "q", "meta": {"a": %s}}' % nested(levels)])
        with pytest.raises(ValueError, match=r"deep\.jsonl, line 3: column 'meta' nests more than 100 levels "
                                             r"\(objects and arrays inside one another\); a row may nest at "
                                             r"most 100: flatten it"):
            read_dataset(path)
    # brackets inside strings are text, not nesting; a line whose brackets do not pair is bad JSON
    text = '{"prompt": "%s", "meta": "%s"}' % ("[" * 500, "{" * 500 + "\\\"" + "]" * 500)
    assert read_dataset(write(tmp_path, "text.jsonl", [text])).rows[0]["prompt"] == "[" * 500
    with pytest.raises(ValueError, match=r"line 1: not valid JSON"):
        read_dataset(write(tmp_path, "odd.jsonl", ['{"prompt": "q", "meta": [%s[2}}' % ("[1], " * 150)]))
    # a JSON array file names the row (the array is the level above its rows); an Arrow table the column
    rows = [{"prompt": "a"}, {"prompt": "b", "deep": json.loads(nested(150))}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=r"a\.json, row 2: column 'deep' nests more than 100 levels"):
        read_dataset(str(tmp_path / "a.json"))
    import pyarrow as pa

    with pytest.raises(ValueError, match=r"the dataset: column 'deep' nests more than 100 levels \(lists, "
                                         r"structs and maps inside one another\)"):
        read_dataset(pa.table({"prompt": ["a"], "deep": [json.loads(nested(150))]}))
    assert read_dataset(pa.table({"prompt": ["a"], "deep": [json.loads(nested(98))]})).rows[0]["deep"]


def test_prompt_source_names_the_line_of_a_bad_prompt(tmp_path):
    path = write(tmp_path, "d.jsonl", [GOOD, GOOD, json.dumps({"prompt": ""})])
    with pytest.raises(ValueError, match=r"d.jsonl, line 3: column 'prompt' must be a non-empty"):
        PromptSource(path)
    path = write(tmp_path, "ids.jsonl", [json.dumps({"prompt": "a", "id": 1}),
                                         json.dumps({"prompt": "b", "id": 1})])
    with pytest.raises(ValueError, match=r"ids.jsonl, line 2: id '1' of data.id_column 'id' is "
                                         r"repeated \(first at .*ids.jsonl, line 1\)"):
        PromptSource(path, id_column="id")
