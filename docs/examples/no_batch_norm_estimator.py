"""An advantage estimator of your own: GDPO without the batch normalization (each reward
normalized in its group, the weighted sum as the advantage).

An estimator takes (rewards [N, K] float64 in contiguous groups, groups, weights [K], eps, ulp)
and returns an ``EstimatorOutput``; the building blocks (``normalize_in_groups``,
``cancel_residue``, ``normalize_batch``) are in ``gdpo_ray/normalization.py``, the built-ins in
``gdpo_ray/advantages.py``.
Registering it under a name makes ``training.estimator`` accept that name (the driver computes
advantages, so importing this module in the driver's process is enough).
"""

import dataclasses

from gdpo_ray.advantages import ESTIMATORS, gdpo


@ESTIMATORS.register("gdpo_no_batch_norm")
def gdpo_no_batch_norm(rewards, groups, weights, eps, ulp):
    out = gdpo(rewards, groups, weights, eps, ulp)
    return dataclasses.replace(out, advantages=out.summed, batch_mean=0.0, batch_std=1.0)
