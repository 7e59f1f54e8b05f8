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


def test_prompt_source_names_the_line_of_a_bad_prompt(tmp_path):
    path = write(tmp_path, "d.jsonl", [GOOD, GOOD, json.dumps({"prompt": ""})])
    with pytest.raises(ValueError, match=r"d.jsonl, line 3: column 'prompt' must be a non-empty"):
        PromptSource(path)
    path = write(tmp_path, "ids.jsonl", [json.dumps({"prompt": "a", "id": 1}),
                                         json.dumps({"prompt": "b", "id": 1})])
    with pytest.raises(ValueError, match=r"ids.jsonl, line 2: id '1' of data.id_column 'id' is "
                                         r"repeated \(first at .*ids.jsonl, line 1\)"):
        PromptSource(path, id_column="id")
