"""``math:<path>``: any file of math questions and answers, graded as the training reward grades.

The file is read by ``gdpo_ray.data.read_dataset`` (jsonl, json, parquet). Columns, the first
present of each list (or set them with ``question_column`` / ``answer_column``):

- question: ``problem``, ``question``, ``prompt`` (verl's layout: ``prompt`` is a list of chat
  messages, used as it is);
- answer: ``answer``, ``ground_truth``, ``solution`` (its last ``\\boxed{}``), or verl's
  ``reward_model.ground_truth``;
- id: ``id``, ``unique_id``, ``idx``, else the row number; category: ``data_source``,
  ``source``, ``subject``, ``type``, else the file's stem.

A plain question gets ``INSTRUCTION`` after it (the answer in ``\\boxed{}``, as DeepScaleR's
prompts ask). Metrics: ``pass@1`` (math-verify's equivalence of the final ``\\boxed{}`` answer
with the reference, ``gdpo_ray.rewards.math_answer``), averaged over the n samples of each
question (avg@n), and ``exceed_ratio`` (``gdpo_ray.eval.suites.exceeds``, 4,000 tokens by
default). ``after_tag`` (R1-distill models: ``"</think>"``) grades only the text after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from gdpo_ray.eval.suite import Completion, EvalItem, Suite, exceeds

INSTRUCTION = " Let's think step by step and output the final answer within \\boxed{}."
QUESTION_COLUMNS = ("problem", "question", "prompt")
ANSWER_COLUMNS = ("answer", "ground_truth", "solution", "reward_model.ground_truth")
ID_COLUMNS = ("id", "unique_id", "idx")
CATEGORY_COLUMNS = ("data_source", "source", "subject", "type")


def _get(row: dict, column: str) -> Any:
    value: Any = row
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _first_column(rows: list[dict], names: Sequence[str]) -> str | None:
    return next((n for n in names if rows and _get(rows[0], n) is not None), None)


class MathSuite(Suite):
    metrics = ("pass@1", "exceed_ratio")
    max_tokens = 4096

    def __init__(self, path: str, length_limit: int | None = None, question_column: str | None = None,
                 answer_column: str | None = None, after_tag: str | None = None) -> None:
        from gdpo_ray.data import read_dataset
        from gdpo_ray.rewards.math_answer import last_boxed

        self.name = f"math:{Path(path).stem}"
        if length_limit is not None:
            self.length_limit = length_limit
        data = read_dataset(path)
        rows = data.rows
        if not rows:
            raise ValueError(f"math suite {path}: the file has no rows")
        q = question_column or _first_column(rows, QUESTION_COLUMNS)
        a = answer_column or _first_column(rows, ANSWER_COLUMNS)
        if q is None or a is None:
            raise ValueError(f"math suite {path}: no {'question' if q is None else 'answer'} column "
                             f"(looked for {QUESTION_COLUMNS if q is None else ANSWER_COLUMNS}; the file "
                             f"has {sorted(rows[0])}): name it with question_column= / answer_column=")
        ids, cats = _first_column(rows, ID_COLUMNS), _first_column(rows, CATEGORY_COLUMNS)
        self._items, seen = [], set()
        for i, row in enumerate(rows):
            question, answer = _get(row, q), _get(row, a)
            if a == "solution" and isinstance(answer, str):
                answer = last_boxed(answer)
            if question in (None, "") or answer in (None, ""):
                raise ValueError(f"math suite: {data.where(i)} has no {q if question in (None, '') else a}")
            item_id = str(_get(row, ids)) if ids else str(i)
            if item_id in seen:
                raise ValueError(f"math suite: {data.where(i)} repeats the id {item_id!r}")
            seen.add(item_id)
            prompt = question if isinstance(question, list) else str(question) + INSTRUCTION
            self._items.append(EvalItem(item_id, prompt, str(_get(row, cats)) if cats else Path(path).stem,
                                        str(answer)))
        from gdpo_ray.rewards import get

        self._grade = get("math_correctness", after_tag=after_tag)

    def all_items(self) -> list[EvalItem]:
        return list(self._items)

    def score(self, item: EvalItem, completions: Sequence[Completion]) -> list[dict[str, float]]:
        texts = [c.text for c in completions]
        correct = self._grade([item.prompt] * len(texts), texts, ground_truth=[item.reference] * len(texts))
        return [{"pass@1": float(v), "exceed_ratio": exceeds(c, self.length_limit)}
                for v, c in zip(correct, completions)]
