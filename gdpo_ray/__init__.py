"""gdpo-ray: multi-reward RL for LLMs with GDPO, Ray-native.

The advantage math (``gdpo_ray.advantages``) is pure numpy/torch and imports nothing else.
"""

from gdpo_ray.advantages import ESTIMATORS, compute_advantage_details, compute_advantages

__version__ = "0.1.0"
__all__ = ["ESTIMATORS", "compute_advantages", "compute_advantage_details", "__version__"]
