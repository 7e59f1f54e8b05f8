"""The CPU demos' policies: tiny local models with a short supervised warm start, cached.

A randomly initialised model never writes ``<answer>7</answer>``, so RL would have no signal. A
warm start fits the tiny model (``gdpo_ray.tiny_model``) to a deliberately mediocre teacher on
its task, so that every reward starts well below its maximum and RL has each of them to improve.
A task brings its teacher and its recipe (a dict of the settings, the cache key); this module
holds what they share: ``cached_model`` (built once per machine under ``$GDPO_RAY_CACHE``,
default ``~/.cache/gdpo-ray``, keyed by the recipe, renamed into place atomically) and
``fit_on_prompts``; each is a recipe on the project's one supervised trainer
(``gdpo_ray.sft.supervised_fit``: teacher forcing, the loss on the response tokens only).

``demo`` (this module): the ``addition`` task in two stages: ``clean_steps`` where every sum is
right (the model learns to add: it cannot learn it from noisy answers alone), then ``steps`` of
a teacher that writes the right sum only ``p_correct`` of the time (else one of the two
operands, a slip the model can represent per prompt: uniformly wrong answers make it forget how
to add). Throughout, the teacher writes the answer tags only ``p_format`` of the time (else
``\\boxed{}``) and a thought of 0-7 words (so about half the responses are short). Every demo
reward therefore starts at or below half its maximum (about 40 s on 2 cores, once).
``demo-tools``: ``gdpo_ray.warm_start_tools``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from gdpo_ray.sft import Example, supervised_fit

THOUGHT_WORDS = ["add", "the", "numbers", "step", "by", "think"]

#: the demo's recipe; changing any value (or the RNG order of its training) changes the model the
#: tests and docs quote numbers of
RECIPE = dict(hidden_size=128, layers=2, clean_steps=400, steps=200, batch_size=64, lr=3e-3,
              mix_lr=1e-3, p_format=0.4, p_correct=0.3, max_words=7, seed=0, version=1)



def cache_root(cache: str | Path | None = None) -> Path:
    """``cache``, else ``$GDPO_RAY_CACHE``, else ``~/.cache/gdpo-ray``."""
    return Path(cache or os.environ.get("GDPO_RAY_CACHE", Path.home() / ".cache" / "gdpo-ray"))


def cached_model(name: str, recipe: dict, build: Callable[[Path, dict], None],
                 cache: str | Path | None = None) -> Path:
    """``<cache>/<name>-<hash of recipe>``, made by ``build(directory, recipe)`` if missing."""
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_root(cache) / f"{name}-{key}"
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp, recipe)
    try:
        tmp.rename(target)  # atomic: a concurrent reader never sees half a directory
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def fit_on_prompts(path: Path, recipe: dict, prompts_of: Callable[[Any], list[list[int]]],
                   batches_of: Callable[[Any, list[list[int]], np.random.Generator], Iterable]) -> None:
    """Fits the untrained model in ``path`` (``supervised_fit``, seeded by ``recipe["seed"]``)
    and saves it. ``prompts_of(tokenizer)``: each row's prompt ids; the prefix they all share (a
    system message, the tools' listing) is cut off and run once per batch, and
    ``batches_of(tokenizer, the prompts past it, rng)`` gives the examples."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = prompts_of(tokenizer)
    shared = next(i for i, ids in enumerate(zip(*prompts)) if len(set(ids)) > 1)
    rng = np.random.default_rng(recipe["seed"])
    torch.manual_seed(recipe["seed"])
    supervised_fit(model, batches_of(tokenizer, [p[shared:] for p in prompts], rng), recipe["lr"],
                   tokenizer.pad_token_id, prefix=prompts[0][:shared])
    model.save_pretrained(path)


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """The token ids a rollout actor gives the model for ``messages`` (chat template, generation
    prompt, no extra special tokens)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def response_ids(tokenizer: Any, response: str) -> list[int]:
    """``response``'s token ids and the EOS token that ends it."""
    return tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


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

    from gdpo_ray.tiny_model import build_tiny_model

    build_tiny_model(path, hidden_size=recipe["hidden_size"], layers=recipe["layers"],
                     seed=recipe["seed"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = np.random.default_rng(recipe["seed"])
    torch.manual_seed(recipe["seed"])
    supervised_fit(model, _addition_batches(tokenizer, recipe, rng), recipe["lr"], tokenizer.pad_token_id)
    model.save_pretrained(path)
