"""The CPU demo's policy: a tiny local model with a short supervised warm start, cached.

A randomly initialised model never writes ``<answer>7</answer>``, so RL would have no signal. The
warm start fits the tiny model (``gdpo_ray.tiny_model``) to a teacher on the ``addition`` task in
two stages: ``clean_steps`` where every sum is right (the model learns to add: it cannot learn
it from noisy answers alone), then ``steps`` of a deliberately mediocre teacher that writes the
right sum only ``p_correct`` of the time (else one of the two operands, a slip the model can
represent per prompt: uniformly wrong answers make it forget how to add). Throughout, the teacher writes
the answer tags only ``p_format`` of the time (else ``\\boxed{}``) and a thought of 0-7 words
(so about half the responses are short). Every demo reward therefore starts at or below half its
maximum, and RL has each of them to improve. The result is cached under
``$GDPO_RAY_CACHE`` (default ``~/.cache/gdpo-ray``), keyed by the recipe, so it is built once per
machine (about 20 s on 2 cores).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

THOUGHT_WORDS = ["add", "the", "numbers", "step", "by", "think"]

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
    recipe = RECIPE | overrides
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache or os.environ.get("GDPO_RAY_CACHE", Path.home() / ".cache" / "gdpo-ray"))
    target = root / f"demo-addition-{key}"
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _warm_start(tmp, recipe)
    try:
        tmp.rename(target)  # atomic: a concurrent reader never sees half a directory
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
    prompts = {}
    for a in range(10):
        for b in range(10):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"What is {a} + {b}?"}], add_generation_prompt=True,
                tokenize=False)
            prompts[a, b] = tokenizer(text, add_special_tokens=False)["input_ids"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=0.0)
    model.train()
    for step in range(recipe["clean_steps"] + recipe["steps"]):
        p_correct = 1.0 if step < recipe["clean_steps"] else recipe["p_correct"]
        if step == recipe["clean_steps"]:
            for group in optimizer.param_groups:
                group["lr"] = recipe["mix_lr"]
        ids, labels = [], []
        for _ in range(recipe["batch_size"]):
            a, b = (int(x) for x in rng.integers(0, 10, size=2))
            response = teacher_response(a, b, rng, recipe["p_format"], p_correct,
                                        recipe["max_words"])
            target = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids.append(prompts[a, b] + target)
            labels.append([-100] * len(prompts[a, b]) + target)
        width = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
        label_ids = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()
        loss = model(input_ids=input_ids, attention_mask=mask, labels=label_ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
