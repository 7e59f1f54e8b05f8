"""How DeepSpeed comes into a process: imported without its autotuner's MLflow import, its
JIT-built C++ ops cached per Python environment, none probed or built for a single learner, and
its Muon optimizer imported without compiling its kernels (a learner's optimizer is AdamW)."""

from __future__ import annotations

import hashlib
import importlib
import os
import pathlib
import sys

from gdpo_ray.kept_out import kept_out

#: DeepSpeed's Muon optimizer, which a learner never builds (``deepspeed_for``)
MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_deepspeed():
    """``import deepspeed``, without the MLflow import its autotuner makes when MLflow is installed
    (0.9 s and pandas in every learner, for autotuning runs, which a learner never makes); MLflow
    stays importable afterwards."""
    with kept_out("mlflow"):
        import deepspeed
    return deepspeed


def extensions_dir() -> str:
    """Where this Python environment's JIT-built torch extensions are cached."""
    key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    version = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return str(pathlib.Path.home() / ".cache" / "gdpo-ray" / "torch_extensions" / f"{version}-{key}")


def deepspeed_for(world_size: int):
    """DeepSpeed for a learner of a group of ``world_size``: C++ ops JIT-built into this
    environment's own cache (two environments sharing torch's default one rebuild them at every
    switch; ``TORCH_EXTENSIONS_DIR`` when set wins); with no peer to reduce with, no op is probed
    or built (the shm all-reduce is a C++ compile, ~20 s and ~2.5 GB cold on CPU).

    DeepSpeed imports its Muon optimizer in ``deepspeed.initialize`` and its ZeRO optimizers (to
    ask whether the optimizer is one), and that import wraps Muon's kernels in ``torch.compile``:
    1.1 s of every learner's start, for an optimizer a learner never builds. Here it is imported
    first with DeepSpeed's compile decorator as the identity: the same classes, so every such
    check answers as before; Muon's functions would run uncompiled."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    deepspeed = import_deepspeed()
    if MUON not in sys.modules:
        from deepspeed.runtime import compiler

        compile_decorator = compiler.compile
        compiler.compile = lambda: compiler.dummy_decorator
        try:
            importlib.import_module(MUON)
        finally:
            compiler.compile = compile_decorator
    if world_size == 1:
        deepspeed.ops.__compatible_ops__ = {}
    return deepspeed
