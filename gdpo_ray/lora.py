"""LoRA adapters (``llm.lora``): the setting, checked and normalized; PEFT's ``LoraConfig`` of it;
the model's linear modules it may target; the names PEFT saves an adapter's weights under.

``llm.lora`` takes PEFT's own names: ``r`` (the rank, required), ``lora_alpha`` (the scale
numerator: the update is ``lora_alpha / r * B @ A``; PEFT's default 8), ``lora_dropout`` (0.0)
and ``target_modules`` (a list of module names, matched as PEFT matches a list: a module whose
full name is the entry or ends with ``.<entry>``; or ``all-linear``: every linear layer but the
output head; the default). Absent, None or ``{}``: full fine-tuning.

Only ``gdpo_ray.config`` and third-party packages are imported here (the basement, STYLE.md §14);
torch, transformers and peft are imported where they are used, so that checking the setting
costs nothing.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any, Mapping

from gdpo_ray.config import unknown_key

#: the keys of ``llm.lora`` and their defaults (PEFT's, but ``r``, which has none here)
DEFAULTS: dict[str, Any] = {"r": None, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}
ALL_LINEAR = "all-linear"
FIELD = "llm.lora"


def lora_settings(value: Mapping[str, Any] | None) -> dict | None:
    """``llm.lora`` normalized: all four keys filled (``target_modules`` a list of names or
    ``"all-linear"``), or None for full fine-tuning (None or an empty mapping). Raises
    ValueError naming ``llm.lora.<key>``, the value, the rule and the fix."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{FIELD} must be a mapping of PEFT's LoRA settings or null; got {value!r} "
                         f"({type(value).__name__}); e.g. {FIELD}={{r: 8, lora_alpha: 16}}")
    if not value:
        return None
    for key in value:
        if key not in DEFAULTS:
            raise ValueError(unknown_key(key, list(DEFAULTS), FIELD))
    if "r" not in value:
        raise ValueError(f"{FIELD}.r is required: the rank of the adapters, e.g. {FIELD}={{r: 8}} "
                         f"(or {FIELD}=null for full fine-tuning)")
    out = {**DEFAULTS, **value}
    r = out["r"]
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{FIELD}.r must be an integer >= 1 (the rank of the adapters); got {r!r}; "
                         f"e.g. {FIELD}.r=8 (or {FIELD}=null for full fine-tuning)")
    alpha = out["lora_alpha"]
    if not _number(alpha) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"{FIELD}.lora_alpha must be a finite number > 0 (the adapters' update is "
                         f"scaled by lora_alpha / r); got {alpha!r}; e.g. {FIELD}.lora_alpha=16")
    dropout = out["lora_dropout"]
    if not _number(dropout) or not math.isfinite(dropout) or not 0 <= dropout < 1:
        raise ValueError(f"{FIELD}.lora_dropout must be a number in [0, 1) (the dropout on the "
                         f"adapters' input); got {dropout!r}; e.g. {FIELD}.lora_dropout=0.05")
    targets = out["target_modules"]
    if isinstance(targets, (list, tuple)):
        if not targets or not all(isinstance(t, str) and t.strip(".") for t in targets):
            raise ValueError(f"{FIELD}.target_modules must be a non-empty list of module names, or "
                             f"{ALL_LINEAR!r}; got {targets!r}; e.g. {FIELD}.target_modules="
                             f"[q_proj, k_proj, v_proj, o_proj]")
        targets = list(dict.fromkeys(targets))  # PEFT takes them as a set; the order as written
    elif targets != ALL_LINEAR:
        raise ValueError(f"{FIELD}.target_modules must be a list of module names or {ALL_LINEAR!r}; "
                         f"got {targets!r}; e.g. {FIELD}.target_modules=[q_proj, v_proj] (a single "
                         f"name is a list of one)")
    return {"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": targets}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def describe(settings: Mapping[str, Any] | None) -> str:
    """``{r: 8, lora_alpha: 16, lora_dropout: 0.0, target_modules: all-linear}`` as YAML would
    write it, or ``none (full fine-tuning)``."""
    if not settings:
        return "none (full fine-tuning)"
    return "{" + ", ".join(f"{k}: {flow(v)}" for k, v in settings.items()) + "}"


def flow(value: Any) -> str:
    """One value of the setting as YAML's flow style writes it: ``8``, ``[q_proj, v_proj]``."""
    return f"[{', '.join(map(str, value))}]" if isinstance(value, (list, tuple)) else str(value)


def peft_config(settings: Mapping[str, Any]):
    """PEFT's ``LoraConfig`` of normalized settings (``lora_settings``): a causal LM, no bias
    trained."""
    from peft import LoraConfig, TaskType

    targets = settings["target_modules"]
    return LoraConfig(r=settings["r"], lora_alpha=settings["lora_alpha"],
                      lora_dropout=settings["lora_dropout"],
                      target_modules=targets if targets == ALL_LINEAR else list(targets),
                      bias="none", task_type=TaskType.CAUSAL_LM)


def linear_module_names(model_path: str | Path) -> list[str]:
    """The distinct short names (``q_proj``, ``down_proj``, ...) of the model's linear layers but
    its output head, sorted; the model is built from its config on the meta device (no weights
    are read nor memory taken). Cached per path."""
    return sorted({name.rpartition(".")[2] for name in _linear_modules(str(model_path))})


@functools.lru_cache(maxsize=16)
def _linear_modules(model_path: str) -> tuple[str, ...]:
    """The full names of the model's linear layers but its output head."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    except Exception as err:  # noqa: BLE001 - whatever an unknown or damaged config raises
        raise ValueError(f"{FIELD}.target_modules: cannot build the model {model_path} from its "
                         f"config to find its linear modules ({type(err).__name__}: {err}); "
                         f"llm.model_path must be a causal LM that transformers' "
                         f"AutoModelForCausalLM builds") from None
    head = model.get_output_embeddings()
    return tuple(name for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear) and module is not head)


def check_target_modules(settings: Mapping[str, Any] | None, model_path: str | Path) -> None:
    """Every name of ``target_modules`` matches a linear layer of the model as PEFT matches a
    list entry (a full module name equal to it or ending with ``.<entry>``); raises ValueError
    naming the entry and the model's linear modules."""
    if not settings or settings["target_modules"] == ALL_LINEAR:
        return
    full = _linear_modules(str(model_path))
    for entry in settings["target_modules"]:
        if not any(name == entry or name.endswith(f".{entry}") for name in full):
            raise ValueError(f"{FIELD}.target_modules: the model has no linear module named {entry!r}; "
                             f"its linear modules: {', '.join(linear_module_names(model_path))} "
                             f"(or use {FIELD}.target_modules={ALL_LINEAR})")


def is_adapter_tensor(name: str) -> bool:
    """Whether a tensor's name is a LoRA adapter's (PEFT's ``lora_A``/``lora_B`` and their
    embedding forms, as a PEFT model holds them or a saved adapter names them): the one place the
    system decides it (the engines load such tensors as the adapter, checkpoints and learners
    keep them as what is trained)."""
    return any(f".{part}" in name for part in ("lora_A.", "lora_B.", "lora_embedding_A", "lora_embedding_B"))


def adapter_key(name: str, adapter_name: str = "default") -> str:
    """A parameter's name in a PEFT model -> its name in a saved adapter (PEFT's
    ``get_peft_model_state_dict``): the adapter's name removed,
    ``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``."""
    if name.endswith(f".{adapter_name}"):  # an nn.Parameter: the adapter's name ends it
        return name.removesuffix(f".{adapter_name}")
    head, _, suffix = name.rpartition(".")
    return f"{re.sub(re.escape(f'.{adapter_name}') + '$', '', head)}.{suffix}"


def module_key(saved_name: str, adapter_name: str = "default") -> str:
    """The inverse of ``adapter_key``, as PEFT loads a saved adapter: the adapter's name put
    back after the ``lora_*`` part, ``...q_proj.lora_A.weight`` -> ``...q_proj.lora_A.default.weight``;
    a name without ``lora_`` (a bias) is returned as it is."""
    head, sep, tail = saved_name.rpartition("lora_")
    if not sep:
        return saved_name
    first, dot, rest = tail.partition(".")
    return f"{head}lora_{first}.{adapter_name}" + (f".{rest}" if dot else "")
