"""A weight transport of your own: learner rank 0 gathers the whole state dict and puts it into
Ray's object store as ONE object, which every rollout actor loads (the simplest transport; fine
for small models: no buckets, so the gathered copy must fit in rank 0's memory at once).

A transport sends from the ``LearnerGroup`` to the receivers of the ``RolloutGroup``:
``send(version, receivers) -> Pushed`` and ``close()``. ``Pushed.sent`` records what was sent
(each tensor's digest: every push is attested against what the actors' engines then hold);
``Pushed.buckets`` is what the rollout group hands to every actor's ``set_weights`` (and to an
actor started later); ``None`` would mean the receivers have loaded the version already (a
broadcast). Registering the class in
``TRANSPORTS`` makes ``training.weight_sync`` accept its name in the driver's process.
"""

import ray

from gdpo_ray.run.transports import TRANSPORTS, Pushed
from gdpo_ray.weights.digest import Sent, digest


class GatheredTransport:
    name = "gathered"

    def __init__(self, learners, bucket_bytes: int) -> None:
        self.learners = learners  # bucket_bytes is not used: one object holds everything

    def send(self, version: int, receivers) -> Pushed:
        weights = self.learners.get_weights()  # {name: numpy array}, gathered on rank 0
        sent = Sent()
        sent.add(list(weights), [str(v.dtype) for v in weights.values()], [digest(v) for v in weights.values()],
                 sum(v.nbytes for v in weights.values()), shapes=[v.shape for v in weights.values()])
        return Pushed(version, sent, buckets=ray.put(weights))

    def close(self) -> None:
        """Nothing is held between sends."""


TRANSPORTS["gathered"] = GatheredTransport
