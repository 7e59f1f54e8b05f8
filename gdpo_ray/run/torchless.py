"""Imports that would bring torch into the driver, without it.

GDPO's driver runs no network: the policy lives in the learner and rollout actors, which import
torch in their own processes. Two of the driver's libraries import torch only for what the driver
never asks of them: RLlib's modules (``try_import_torch`` as each loads, for RLlib's own networks
and learners) and tensorboardX (to accept torch tensors as logged values). Both carry on without
it (RLlib with its stubs, tensorboardX with numpy), and keeping it out saves every run's driver
~180 MiB and ~0.9 s of its start (measured: USS 383 -> 203 MiB after RLlib's import).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator


@contextlib.contextmanager
def torch_kept_out() -> Iterator[None]:
    """While open, ``import torch`` raises ImportError in this process; a process that has
    imported torch already (a user's script, a test session) is left as it is, and anything
    imported later imports torch as usual."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # the import system's "not found" marker
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
