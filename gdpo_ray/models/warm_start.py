"""What the demo models' warm starts share: a tiny local model (``gdpo_ray.models.tiny``) fitted
to a deliberately mediocre teacher on its task, cached.

A randomly initialised model never writes ``<answer>7</answer>``, so RL would have no signal. A
warm start fits the tiny model to a teacher whose mistakes are slips the model can represent
per prompt, so that every reward starts well below its maximum and RL has each of them to
improve. A task brings its teacher and its recipe (a dict of the settings, the cache key:
``demo``, ``demo_tools``, ``demo_count``, ``demo_agent``); this module holds what they share:
``cached_model`` (built once per machine under ``$GDPO_RAY_CACHE``, default
``~/.cache/gdpo-ray``, keyed by the name and the recipe, renamed into place atomically) and
``fit_on_prompts``; each is a recipe on the project's one supervised trainer
(``gdpo_ray.sft.supervised_fit``: teacher forcing, the loss on the response tokens only).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from gdpo_ray.sft import supervised_fit


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
