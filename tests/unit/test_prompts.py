"""PromptSource: seeded epochs, exactly one state per prompt, exact resume."""

import json

import pytest

from actors.prompts import PromptSource

ROWS = [{"prompt": f"q{i}", "ground_truth": str(i)} for i in range(10)]


def test_seeded_epochs_cover_every_row_once():
    src = PromptSource(ROWS, seed=3)
    first = [p.prompt_id for p in src.take(10)]
    assert sorted(first, key=int) == [str(i) for i in range(10)]
    second = [p.prompt_id for p in src.take(10)]
    assert sorted(second, key=int) == sorted(first, key=int) and second != first
    assert {p.epoch for p in PromptSource(ROWS, seed=3).take(11)} == {0, 1}
    assert [p.prompt_id for p in PromptSource(ROWS, seed=3).take(10)] == first  # seeded


def test_states_and_reissue():
    src = PromptSource(ROWS, seed=0)
    a, b, c = src.take(3)
    assert a.columns == {"ground_truth": a.prompt_id}
    src.mark_trained([a.group_id])
    src.mark_filtered(b.group_id, "no reward varies")
    src.reissue([c.group_id])
    again = src.take(1)[0]
    assert (again.prompt_id, again.attempt, again.group_id) == (c.prompt_id, 1, f"{c.prompt_id}/e0/a1")
    src.mark_trained([again.group_id])
    assert src.outcomes(0) == {a.prompt_id: "trained", b.prompt_id: "filtered: no reward varies",
                               c.prompt_id: "trained"}
    with pytest.raises(ValueError, match="is not in flight"):
        src.mark_trained([a.group_id])


def test_resume_neither_skips_nor_repeats():
    src = PromptSource(ROWS, seed=5)
    taken = src.take(6)
    src.mark_trained([p.group_id for p in taken[:3]])
    state = json.loads(json.dumps(src.state_dict()))  # checkpoints are plain data
    resumed = PromptSource(ROWS, seed=5)
    resumed.load_state_dict(state)
    # the 3 in flight come back first, then the rest of the epoch
    rest = resumed.take(7)
    assert [p.prompt_id for p in rest[:3]] == [p.prompt_id for p in taken[3:]]
    resumed.mark_trained([p.group_id for p in rest])
    outcomes = resumed.outcomes(0)
    assert sorted(outcomes, key=int) == [str(i) for i in range(10)]
    assert set(outcomes.values()) == {"trained"}


def test_bad_rows_are_named():
    with pytest.raises(ValueError, match="the dataset, row 2: column 'prompt' must be"):
        PromptSource([{"prompt": "ok"}, {"prompt": ""}])
    with pytest.raises(ValueError, match="prompt_column 'question' is not a column"):
        PromptSource(ROWS, prompt_column="question")
    with pytest.raises(ValueError, match="the dataset, row 1"):
        PromptSource([{"prompt": [{"role": "user"}]}])
    chat = PromptSource([{"prompt": [{"role": "user", "content": "hi"}]}])
    assert chat.take(1)[0].prompt == [{"role": "user", "content": "hi"}]


def test_parquet_and_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    for name in ("d.parquet", "d.jsonl"):
        assert len(PromptSource(str(tmp_path / name))) == 10
    with pytest.raises(ValueError, match="does not exist"):
        PromptSource(str(tmp_path / "missing.parquet"))


def test_hugging_face_dataset():
    import datasets

    src = PromptSource(datasets.Dataset.from_list(ROWS), seed=1)
    taken = src.take(10)
    assert len(src) == 10 and sorted(p.prompt_id for p in taken) == sorted(str(i) for i in range(10))
    assert all(p.prompt == f"q{p.prompt_id}" and p.columns == {"ground_truth": p.prompt_id} for p in taken)


def verl_rows():
    """Rows laid out as verl's parquet files are (DeepScaleR, Eurus-2-RL, ToolRL)."""
    return [{"data_source": "math", "prompt": [{"role": "user", "content": f"q{i}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i * i)},
             "extra_info": {"split": "train", "index": 100 + i}} for i in range(3)]


def test_verl_parquet_columns_from_nested_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(verl_rows()), tmp_path / "train.parquet")
    src = PromptSource(str(tmp_path / "train.parquet"), id_column="index",
                       columns={"ground_truth": "reward_model.ground_truth", "index": "extra_info.index"})
    taken = sorted(src.take(3), key=lambda p: p.row)
    assert [p.prompt_id for p in taken] == ["100", "101", "102"]
    assert [p.columns["ground_truth"] for p in taken] == ["0", "1", "4"]
    assert taken[1].prompt == [{"role": "user", "content": "q1"}]


def test_bad_nested_columns_are_named():
    rows = verl_rows()
    rows[2]["reward_model"]["ground_truth"] = None
    with pytest.raises(ValueError, match=r"the dataset, row 3: data column 'ground_truth' comes from "
                                         r"'reward_model.ground_truth', which is empty \(null\)"):
        PromptSource(rows, columns={"ground_truth": "reward_model.ground_truth"})
    with pytest.raises(ValueError, match=r"the dataset, row 1: .* 'reward_model' has no field 'answer' "
                                         r"\(it has: \['ground_truth', 'style'\]\)"):
        PromptSource(verl_rows(), columns={"ground_truth": "reward_model.answer"})
    with pytest.raises(ValueError, match="has no column 'reward'; columns: .*'reward_model'"):
        PromptSource(verl_rows(), columns={"ground_truth": "reward.ground_truth"})
    with pytest.raises(ValueError, match="'reward_model.style' has no field 'x' \\(it has: str\\)"):
        PromptSource(verl_rows(), columns={"ground_truth": "reward_model.style.x"})
