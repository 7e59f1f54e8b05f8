"""Imports made as if a package were not installed: ``with kept_out("torch"): import ray.rllib``.

A library that can do without a package imports it anyway where it is installed, for what this
process never asks of it: RLlib's modules import torch for RLlib's own networks and
tensorboardX to accept torch tensors (the driver runs no network: ~180 MiB and ~0.9 s of every
driver's start), DeepSpeed's autotuner imports MLflow (0.9 s and pandas in every learner), and
pyarrow imports pandas the first time it builds an array, to ask whether the values are pandas
objects (0.27 s and ~40 MiB in every actor). Each carries on without it.

The package is kept out by an import finder placed first, which answers that it does not exist
(``ModuleNotFoundError``, as an absent package gives), not by ``sys.modules[name] = None``:
pyarrow's compiled import takes that ``None`` for the module itself.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Iterator


@contextlib.contextmanager
def kept_out(package: str) -> Iterator[None]:
    """While open, an import of ``package`` or of any of its modules raises
    ``ModuleNotFoundError`` in this process. A process that has imported it already is left as
    it is; afterwards it imports as usual."""
    if package in sys.modules:
        yield
        return
    finder = _NotInstalled(package)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


class _NotInstalled(importlib.abc.MetaPathFinder):
    """An import finder for which the package ``name`` is not installed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] == self.name:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None
