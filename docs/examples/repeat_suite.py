"""An eval suite family of your own: ``repeat:<n>`` asks the model to repeat one of n words;
``pass@1`` is 1 when the answer is the word.

A suite subclasses ``gdpo_ray.eval.suite.Suite`` (``name``, ``metrics``, ``all_items``,
``score``); a factory registered in ``gdpo_ray.eval.suites.SUITES`` builds it from the text
after the family's colon. Registering it makes ``make_suite``, ``gdpo_ray.run.eval_runner.evaluate``
and ``training.eval_suite`` accept ``repeat:<n>`` in the process that imported this module.
"""

from gdpo_ray.eval.suite import EvalItem, Suite
from gdpo_ray.eval.suites import SUITES

WORDS = ("apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "forest")


class RepeatWord(Suite):
    metrics = ("pass@1",)
    max_tokens = 8

    def __init__(self, n: int, length_limit: int | None = None) -> None:
        if not 1 <= n <= len(WORDS):
            raise ValueError(f"repeat:<n> takes 1 <= n <= {len(WORDS)}; got {n}")
        self.name = f"repeat:{n}"
        self.words = WORDS[:n]

    def all_items(self) -> list[EvalItem]:
        return [EvalItem(id=f"repeat_{i}", prompt=f"Repeat the word: {w}", category="repeat", reference=w)
                for i, w in enumerate(self.words)]

    def score(self, item, completions) -> list[dict[str, float]]:
        return [{"pass@1": float(c.text.strip().strip(".").lower() == item.reference)} for c in completions]


@SUITES.register("repeat")
def repeat(n: str, **options) -> Suite:
    return RepeatWord(int(n or 3), **options)
