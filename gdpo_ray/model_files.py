"""Where a run's model is: ``resolve_model_path`` (the named models, or a directory), and a
model directory that exists only on the driver's node, shipped to the other nodes.

On one machine every actor reads the driver's model directory. On a cluster the driver's local
folders (the demo's warm-started model in ``~/.cache``, a checkpoint exported on the head) do not
exist on the rollout and learner nodes: the driver puts the directory's files into Ray's object
store once (``pack``) and each actor that cannot see the path writes them into a node-local cache
keyed by their content hash (``local_dir``), so every process starts from the same bytes. Models
larger than ``max_bytes`` are not shipped: give them a path every node can read (shared storage)
or a hub name.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

MAX_BYTES = 4 << 30


def pack(path: str | Path, max_bytes: int = MAX_BYTES) -> Any | None:
    """ObjectRef of ``{"digest", "files": {relative path: bytes}}``, or None when ``path`` is
    not a local directory (a hub name) or is larger than ``max_bytes``."""
    import ray

    root = Path(path)
    if not root.is_dir():
        return None
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if sum(p.stat().st_size for p in files) > max_bytes:
        return None
    digest = hashlib.sha256()
    payload = {}
    for p in files:
        rel = p.relative_to(root).as_posix()
        data = p.read_bytes()
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        payload[rel] = data
    return ray.put({"digest": digest.hexdigest()[:16], "files": payload})


def local_dir(path: str, shipped: Any | None, cache: str | Path | None = None) -> str:
    """``path`` if this node can read it, else the shipped copy in a node-local cache."""
    if shipped is None or (Path(path) / "config.json").exists():
        return path
    import ray

    bundle = ray.get(shipped) if isinstance(shipped, ray.ObjectRef) else shipped
    root = Path(cache or os.environ.get("GDPO_RAY_CACHE", Path.home() / ".cache" / "gdpo-ray"))
    target = root / "shipped" / bundle["digest"]
    if (target / "config.json").exists():
        return str(target)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    for rel, data in bundle["files"].items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    try:
        tmp.rename(target)  # atomic: a concurrent actor on this node never sees half of it
    except OSError:  # another actor finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


#: the warm-started tiny models, by name: their builder's module and function (built on first use)
WARM_STARTED = {"demo": ("gdpo_ray.models.demo", "demo_model_dir"),
                "demo-tools": ("gdpo_ray.models.demo_tools", "tools_model_dir"),
                "demo-count": ("gdpo_ray.models.demo_count", "count_model_dir"),
                "demo-agent": ("gdpo_ray.models.demo_agent", "agent_model_dir")}
#: every model a config may name instead of a directory
BUILT_IN_MODELS = (*WARM_STARTED, "tiny", "smollm2")
#: the model hub names of the built-in models converted from a hub model: what an exported LoRA
#: adapter names as its base (``adapter_config.json``), and what ``resolve_model_path`` takes back
HUB_NAMES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
_HUB_NAME = r"[A-Za-z0-9][\w.-]*/[\w.-]+"


def hub_name(spec: str | Path) -> str | None:
    """The model hub name ``spec`` stands for: a built-in's (``HUB_NAMES``), or ``spec`` itself
    when it is a hub name (``org/name``, not a folder here); None for a local directory and for
    the models made locally (``demo``, ``tiny``), which have none."""
    import re

    spec = str(spec)
    if spec in HUB_NAMES:
        return HUB_NAMES[spec]
    if spec in BUILT_IN_MODELS or Path(spec).expanduser().exists() or not re.fullmatch(_HUB_NAME, spec):
        return None
    return spec


def check_available(spec: str) -> None:
    """Whether a built-in model can be made here, checked before any actor starts (``GDPOConfig
    .validate``): ``smollm2`` needs its wheel and ``gguf`` until it has been converted once."""
    if spec == "smollm2":
        from gdpo_ray.models.smollm2 import check_smollm2

        check_smollm2()


def resolve_model_path(spec: str) -> Path:
    """``demo`` (the warm-started tiny model of the addition demo), ``demo-tools`` and
    ``demo-count`` (those of the tool-calling and math-length studies), ``demo-agent`` (the
    agent preset's), ``tiny`` (random),
    ``smollm2`` or a directory; a hub name as its snapshot in the local Hugging Face cache, and a
    built-in's hub name (``HUB_NAMES``) not in that cache as the built-in (an exported adapter
    names its base by the hub name: it loads offline from the same local model)."""
    built_in = next((name for name, hub in HUB_NAMES.items() if hub == spec), None)
    if built_in is not None:
        try:
            return hub_model(spec) or Path(spec)
        except ValueError:  # not in the hub cache: the local conversion of the same model
            return resolve_model_path(built_in)
    if spec in WARM_STARTED:
        import importlib

        module, builder = WARM_STARTED[spec]
        return getattr(importlib.import_module(module), builder)()
    if spec == "smollm2":
        from gdpo_ray.models.smollm2 import smollm2_dir

        return smollm2_dir()
    if spec == "tiny":
        import tempfile

        from gdpo_ray.models.tiny import build_tiny_model

        target = Path(tempfile.gettempdir()) / "gdpo-ray-tiny-model"
        return target if (target / "config.json").exists() else build_tiny_model(target)
    return hub_model(spec) or Path(spec)


def hub_model(spec: str, cache_dir: str | Path | None = None) -> Path | None:
    """A Hugging Face hub name (``org/name``, not a folder here) as its snapshot in the local hub
    cache (nothing is downloaded: a run starts from what is on the machine); None for anything
    else. A hub name that is not in the cache raises ValueError naming it and the fix."""
    import re

    if Path(spec).expanduser().exists() or not re.fullmatch(_HUB_NAME, spec):
        return None
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec, cache_dir=cache_dir, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub's error types vary by version)
        raise ValueError(f"model {spec!r} is not a local directory nor a model in the Hugging Face cache; "
                         f"download it first (huggingface-cli download {spec}) and give its name or "
                         f"directory, or use one of {', '.join(BUILT_IN_MODELS)}") from None


def same_model(a: str | Path, b: str | Path) -> bool:
    """Whether two models are the same: one directory, or copies (the same config, the same
    weight files of the same sizes). Each is a directory or a name ``resolve_model_path`` takes
    (``smollm2``, a hub name: what an adapter's ``base_model_name_or_path`` holds)."""
    import json

    a, b = _model_dir(a), _model_dir(b)
    if a is None or b is None:
        return False
    if a == b:
        return True

    def identity(folder: Path) -> tuple | None:
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return None
        config.pop("_name_or_path", None)
        files = sorted((f.name, f.stat().st_size) for f in folder.iterdir()
                       if f.suffix in (".safetensors", ".bin", ".pt"))
        return json.dumps(config, sort_keys=True), files

    return identity(a) is not None and identity(a) == identity(b)


def _model_dir(spec: str | Path) -> Path | None:
    """``spec``'s model directory (a folder here, or a name resolved); None where it is neither."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        return resolve_model_path(str(spec)).expanduser().resolve()
    except ValueError:  # a hub name not in the cache
        return None


def saved_dtype(path: str | Path) -> str:
    """The dtype a model directory's weights are stored in (its config.json's ``dtype``, or
    ``torch_dtype`` in older files; float32 when it names none): an exported policy keeps it."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"
