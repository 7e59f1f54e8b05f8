"""gdpo-ray checkpoints on disk: what makes one complete, and what a resumed run may change.

``save_atomically`` (``GDPO.save_to_path``) writes a checkpoint aside, then ``COMPLETE_MARKER``,
then renames it into place; only a directory holding the marker is a checkpoint
(``check_checkpoint``).
``resume_changes`` compares a new run's config with the checkpoint's, before anything starts.
"""

from __future__ import annotations

import pathlib
import shutil
import uuid
from typing import Any, Callable

from gdpo_ray import config as fields

#: written last into a checkpoint: only a directory holding it is a complete checkpoint
COMPLETE_MARKER = "gdpo_checkpoint_complete"


def save_atomically(path: str | pathlib.Path, write: Callable[[pathlib.Path], None], note: str) -> str:
    """A checkpoint at ``path``, atomically: ``write(aside)`` fills a directory beside it, then
    ``COMPLETE_MARKER`` (holding ``note``) marks it complete, then it is renamed to ``path`` (an
    older checkpoint there is replaced only then). A save cut short leaves a ``.partial-*``
    directory, which nothing counts or resumes from."""
    final = pathlib.Path(path).resolve()
    aside = final.with_name(f"{final.name}.partial-{uuid.uuid4().hex[:8]}")
    write(aside)
    (aside / COMPLETE_MARKER).write_text(f"{note}\n")
    if final.exists() and any(final.iterdir()):
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
        aside.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        if final.exists():
            final.rmdir()
        aside.rename(final)
    return str(final)


def check_checkpoint(checkpoint: str) -> None:
    """Raises ValueError unless ``checkpoint`` is a complete gdpo-ray checkpoint."""
    root = pathlib.Path(checkpoint)
    if not (root / "class_and_ctor_args.pkl").is_file():
        raise ValueError(f"--resume {checkpoint}: not a gdpo-ray checkpoint (no class_and_ctor_args.pkl)")
    if not (root / COMPLETE_MARKER).is_file():
        siblings = sorted(p.name for p in root.parent.iterdir() if (p / COMPLETE_MARKER).is_file())
        raise ValueError(f"--resume {checkpoint}: an incomplete checkpoint (its save was cut short: "
                         f"no {COMPLETE_MARKER}); resume from a complete one"
                         + (f" beside it: {siblings}" if siblings else ""))


def resume_changes(config: Any, checkpoint: str) -> list[tuple[str, Any, Any]]:
    """(field, saved value, this config's value) of every GDPO field that differs from the
    checkpoint's config. Raises ValueError, before anything starts, if a field marked
    ``fixed_on_resume`` (``gdpo_ray.config.RESUME_FIXED``) differs: the saved prompt state
    would then point into other data."""
    saved = saved_config(checkpoint)
    names = [*fields.FIELDS, *fields.RLLIB_FIELDS]
    changes = [(name, saved.get(name), getattr(config, name)) for name in names
               if saved.get(name) != getattr(config, name)]
    for name, old, new in changes:
        if name in fields.RESUME_FIXED:
            section = (fields.FIELDS | fields.RLLIB_FIELDS)[name].section
            raise ValueError(f"--resume {checkpoint}: {section}.{name} was {old!r} "
                             f"and is {new!r} now; a run resumes on the data it started with (set it "
                             f"back, or start a new run)")
    return changes


def saved_config(checkpoint: str) -> dict:
    """The GDPO fields a checkpoint was written with."""
    import pickle

    check_checkpoint(checkpoint)
    with open(pathlib.Path(checkpoint) / "class_and_ctor_args.pkl", "rb") as f:
        return pickle.load(f)["ctor_args_and_kwargs"][0][0]


def export_checkpoint_policy(checkpoint: str, out: str) -> str:
    """A checkpoint's policy as a Hugging Face model directory ``out``: the learners' DeepSpeed
    state (any ZeRO stage, gathered to fp32 by DeepSpeed's ``zero_to_fp32``) in the run's base
    model (its config and tokenizer)."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gdpo_ray.model_files import resolve_model_path

    base = resolve_model_path(saved_config(checkpoint)["model_path"])
    weights = get_fp32_state_dict_from_zero_checkpoint(str(pathlib.Path(checkpoint) / "learner"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = sorted(set(missing) - set(getattr(model, "_tied_weights_keys", None) or ()))
    if missing or unexpected:
        raise ValueError(f"checkpoint {checkpoint}: its weights do not fit the base model {base} "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out
