"""``demo``: the tiny model warm-started on the ``addition`` task, cached: the CPU demo's policy.

As every demo model (``gdpo_ray.models.warm_start``), it is fitted to a deliberately mediocre
teacher, in two stages: ``clean_steps`` where every sum is right (the model learns to add: it
cannot learn it from noisy answers alone), then ``steps`` of a teacher that writes the right sum
only ``p_correct`` of the time (else one of the two operands, a slip the model can represent per
prompt: uniformly wrong answers make it forget how to add). Throughout, the teacher writes the
answer tags only ``p_format`` of the time (else ``\\boxed{}``) and a thought of 0-7 words (so
about half the responses are short). Every demo reward therefore starts at or below half its
maximum (about 40 s on 2 cores, once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gdpo_ray.models.warm_start import cached_model, chat_prompt_ids, response_ids
from gdpo_ray.sft import Example, supervised_fit

THOUGHT_WORDS = ["add", "the", "numbers", "step", "by", "think"]

#: the demo's recipe; changing any value (or the RNG order of its training) changes the model the
#: tests and docs quote numbers of
RECIPE = dict(hidden_size=128, layers=2, clean_steps=400, steps=200, batch_size=64, lr=3e-3,
              mix_lr=1e-3, p_format=0.4, p_correct=0.3, max_words=7, seed=0, version=1)


def teacher_response(a: int, b: int, rng: np.random.Generator, p_format: float, p_correct: float,
                     max_words: int) -> str:
    """One response of the mediocre teacher for "What is a + b?"."""
    words = rng.choice(THOUGHT_WORDS, size=int(rng.integers(0, max_words + 1)))
    # a wrong answer is a slip the model can represent per prompt: one of the operands
    value = a + b if rng.random() < p_correct else (a if rng.random() < 0.5 else b)
    answer = f"<answer>{value}</answer>" if rng.random() < p_format else f"\\boxed{{{value}}}"
    return f"<think>{' '.join(words)}</think>{answer}"


def demo_model_dir(cache: str | Path | None = None, **overrides) -> Path:
    """The warm-started demo model directory (built on first use, then reused)."""
    return cached_model("demo-addition", RECIPE | overrides, _warm_start, cache)


def _addition_batches(tokenizer: Any, recipe: dict, rng: np.random.Generator
                      ) -> Iterator[tuple[float, list[Example]]]:
    """The demo's stages: ``clean_steps`` of right sums at ``lr``, then ``steps`` of the
    mediocre teacher at ``mix_lr``."""
    prompts = {(a, b): chat_prompt_ids(tokenizer, [{"role": "user", "content": f"What is {a} + {b}?"}])
               for a in range(10) for b in range(10)}
    for step in range(recipe["clean_steps"] + recipe["steps"]):
        clean = step < recipe["clean_steps"]
        examples = []
        for _ in range(recipe["batch_size"]):
            a, b = (int(x) for x in rng.integers(0, 10, size=2))
            response = teacher_response(a, b, rng, recipe["p_format"], 1.0 if clean else recipe["p_correct"],
                                        recipe["max_words"])
            examples.append((prompts[a, b], response_ids(tokenizer, response)))
        yield (recipe["lr"] if clean else recipe["mix_lr"]), examples


def _warm_start(path: Path, recipe: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gdpo_ray.models.tiny import build_tiny_model

    build_tiny_model(path, hidden_size=recipe["hidden_size"], layers=recipe["layers"],
                     seed=recipe["seed"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = np.random.default_rng(recipe["seed"])
    torch.manual_seed(recipe["seed"])
    supervised_fit(model, _addition_batches(tokenizer, recipe, rng), recipe["lr"], tokenizer.pad_token_id)
    model.save_pretrained(path)
