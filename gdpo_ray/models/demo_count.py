"""``demo-count``: the tiny model warm-started on ``task:count``, cached: the policy of the
math-with-a-length-limit study.

The study needs a length limit that binds: a task whose right answers are themselves longer
than the limit on some items, so that no format escapes it. In ``count`` ("Count from 23 to
27.") the answer is the numbers in order; with this tokenizer a number is two digit tokens and
a space, so a right answer of k numbers takes 3k + 2 tokens (``<answer>``, ``</answer>`` and the
end of turn): with the study's limit of 14 tokens the counts of 5 to 7 numbers (half the items)
cannot be right and short, a count of 4 only without a ``<think>`` block, 2 or 3 with a short one.

The teacher, as for the demo (``gdpo_ray.models.demo``), is mediocre in ways the model can
represent per prompt: ``clean_steps`` of right counts (the model learns to count and to stop),
then ``steps`` in which the count is right only ``p_correct`` of the time (else one slip: it
stops a number early, goes one number past the end, or leaves out a number in the middle);
throughout, a thought of 0 to ``max_words`` words before the answer (the slack every method
can drop first, as the paper's policies first shorten their reasoning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gdpo_ray.models.warm_start import cached_model, chat_prompt_ids, response_ids
from gdpo_ray.sft import Example, supervised_fit

#: the recipe (the cache key)
RECIPE = dict(hidden_size=128, layers=2, vocab_size=512, clean_steps=1200, steps=150, batch_size=64,
              lr=3e-3, mix_lr=1e-3, p_correct=0.4, max_words=4, seed=0, version=1)
#: the tags: one token each
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
THOUGHT_WORDS = ["count", "up", "by", "one", "each", "number"]


def slip(numbers: list[int], rng: np.random.Generator) -> list[int]:
    """The count with one mistake: a number short, one past the end, or one left out inside."""
    kind = int(rng.integers(3))
    if kind == 0:
        return numbers[:-1]
    if kind == 1:
        return numbers + [numbers[-1] + 1]
    inside = 1 + int(rng.integers(len(numbers) - 2)) if len(numbers) > 2 else 1
    return numbers[:inside] + numbers[inside + 1:]


def teacher_response(a: int, b: int, rng: np.random.Generator, p_correct: float, max_words: int) -> str:
    """One response of the mediocre teacher to "Count from a to b."."""
    words = rng.choice(THOUGHT_WORDS, size=int(rng.integers(0, max_words + 1)))
    numbers = list(range(a, b + 1))
    if rng.random() >= p_correct:
        numbers = slip(numbers, rng)
    return f"<think>{' '.join(words)}</think><answer>{' '.join(map(str, numbers))}</answer>"


def count_model_dir(cache: str | Path | None = None, **overrides) -> Path:
    """The warm-started counting model directory (built on first use, then reused)."""
    return cached_model("demo-count", RECIPE | overrides, _warm_start, cache)


def _count_batches(tokenizer: Any, rows: list[dict], recipe: dict, rng: np.random.Generator
                   ) -> Iterator[tuple[float, list[Example]]]:
    """``clean_steps`` of right counts at ``lr``, then ``steps`` of the mediocre teacher at
    ``mix_lr``, over every count of the task."""
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": r["prompt"]}]) for r in rows]
    bounds = [(int(r["ground_truth"].split()[0]), int(r["ground_truth"].split()[-1])) for r in rows]
    for step in range(recipe["clean_steps"] + recipe["steps"]):
        clean = step < recipe["clean_steps"]
        examples = []
        for i in rng.integers(len(rows), size=recipe["batch_size"]):
            response = teacher_response(*bounds[i], rng, 1.0 if clean else recipe["p_correct"],
                                        recipe["max_words"])
            examples.append((prompts[i], response_ids(tokenizer, response)))
        yield (recipe["lr"] if clean else recipe["mix_lr"]), examples


def _warm_start(path: Path, recipe: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gdpo_ray.tasks import count
    from gdpo_ray.models.tiny import QWEN2_PATTERN, build_tiny_model

    rows = count()
    corpus = ["system user assistant", " ".join(THOUGHT_WORDS), "0 1 2 3 4 5 6 7 8 9"]
    corpus += [r["prompt"] for r in rows[:20]]
    build_tiny_model(path, hidden_size=recipe["hidden_size"], layers=recipe["layers"],
                     vocab_size=recipe["vocab_size"], seed=recipe["seed"], corpus=corpus,
                     pattern=QWEN2_PATTERN, added_tokens=TAGS)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = np.random.default_rng(recipe["seed"])
    torch.manual_seed(recipe["seed"])
    supervised_fit(model, _count_batches(tokenizer, rows, recipe, rng), recipe["lr"], tokenizer.pad_token_id)
    model.save_pretrained(path)
