"""gdpo-ray: multi-reward RL for LLMs with GDPO, Ray-native.

The public API: ``from gdpo_ray import GDPO, GDPOConfig`` (the RLlib algorithm and its config,
``gdpo_ray.run.algorithm``) and the advantage math (``compute_advantages``,
``compute_advantage_details``, ``ESTIMATORS``; ``gdpo_ray.advantages``, pure numpy). Every name
is imported on first use, so importing a basement module (``gdpo_ray.config``, the math, the
rewards) never imports Ray or RLlib.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "GDPO": "gdpo_ray.run.algorithm",
    "GDPOConfig": "gdpo_ray.run.algorithm",
    "ESTIMATORS": "gdpo_ray.advantages",
    "compute_advantages": "gdpo_ray.advantages",
    "compute_advantage_details": "gdpo_ray.advantages",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gdpo_ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
