"""The learners as a group on Ray: N ranks of the learner class of ``learners.backend``
(``learners.backend.BACKENDS``: DeepSpeed, FSDP2) gang-scheduled in one placement group, one
torch.distributed process group among them, every call fanned out to all ranks.

An update's groups are split among the ranks whole and contiguous (``split_groups``), balanced by
their tokens; the advantages travel with their rows. While an update runs, ``set_threads`` turns
the ranks' torch threads through their ``dial`` concurrency group (``training.threads_alone``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from gdpo_ray.config import merge_resources
from learners.backend import learner_class
from learners.learner import LearnerConfig


def split_groups(tokens: Sequence[int], parts: int) -> list[list[int]]:
    """Group indices per learner: whole groups, contiguous, balanced by ``tokens`` per group."""
    if len(tokens) < parts:
        raise ValueError(f"{len(tokens)} groups cannot feed {parts} learners: every learner "
                         "needs a group (raise the groups per step or lower num_learners)")
    cum = np.cumsum(tokens, dtype=np.float64)
    mid = cum - np.asarray(tokens) / 2
    share = np.minimum((mid / (cum[-1] / parts)).astype(int), parts - 1)
    out = [np.flatnonzero(share == k).tolist() for k in range(parts)]
    if any(not o for o in out):  # a very uneven batch: equal counts instead
        out = [a.tolist() for a in np.array_split(np.arange(len(tokens)), parts)]
    return out


#: how long the learners' placement group may wait for resources (an autoscaler adding nodes)
PLACEMENT_TIMEOUT_S = 900.0


class LearnerGroup:
    """N learners in a placement group (gang-scheduled), one process group among them."""

    def __init__(self, config: LearnerConfig, num_learners: int = 1, num_cpus_per_learner: float = 1,
                 num_gpus_per_learner: float = 0, bundle_extra: dict | None = None,
                 host: type | None = None) -> None:
        """``bundle_extra``: resources added to every learner's bundle for a rollout actor placed
        beside it (the colocated layout: ``RolloutGroup(placement_group=group.pg)``, or one
        hosted in the learner's process); ``host``: a class mixed into the learners' (the
        methods of a rollout actor served by the learner: ``generation.engine_in_learner``)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        backend = learner_class(config.backend)  # an unknown one fails before any resource is taken
        bundle = merge_resources({"CPU": num_cpus_per_learner, "GPU": num_gpus_per_learner},
                                 bundle_extra or {})
        # inside a Ray Tune trial the learners take bundles of the trial's own placement group
        # (GDPO.default_resource_request reserved them); a second group would wait forever
        current = ray.util.get_current_placement_group()
        self.pg, self._own_pg = current, current is None
        if self._own_pg:
            self.pg = placement_group([bundle] * num_learners, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            if self._own_pg:
                ray.util.remove_placement_group(self.pg)
            raise RuntimeError(
                f"the {num_learners} learner(s) (each {bundle}) were not placed within "
                f"{PLACEMENT_TIMEOUT_S:g} s: the cluster's free resources are "
                f"{ray.available_resources()}; ask for less (learners.num_learners, "
                f"learners.num_cpus_per_learner / num_gpus_per_learner) or add nodes") from None
        # the backend's class (set_threads runs beside an update, in the concurrency group "dial",
        # and sent_digests beside the next update, in "digest")
        if host is not None:
            backend = type(f"{backend.__name__}With{host.__name__}", (host, backend), {})
        cls = ray.remote(concurrency_groups={"dial": 1, "digest": 1})(backend)
        self._updates = 0  # the tickets of the updates: set_threads names the one it is for
        env = {"env_vars": {"OMP_NUM_THREADS": str(config.num_threads), "TOKENIZERS_PARALLELISM": "false",
                            "DS_ACCELERATOR": "cuda" if num_gpus_per_learner else "cpu"}}
        self.learners = [
            cls.options(num_cpus=num_cpus_per_learner, num_gpus=num_gpus_per_learner, runtime_env=env,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self.pg, placement_group_bundle_index=i if self._own_pg else -1,
                        )).remote(config, i, num_learners)
            for i in range(num_learners)]
        addr, port = ray.get(self.learners[0].address.remote())
        ray.get([learner.setup.remote(addr, port) for learner in self.learners])

    def update(self, groups: Sequence[Any], advantages: np.ndarray, version: int | None = None) -> dict[str, float]:
        """Whole groups (GroupRefs) and the advantages of their rows, split across learners;
        returns rank 0's metrics (global values). ``version``: the policy version trained (the
        off-policy metrics by staleness)."""
        return self._ray.get(self.update_async(groups, advantages, version=version))[0]

    def update_async(self, groups: Sequence[Any], advantages: np.ndarray, threads: int | None = None,
                     version: int | None = None) -> list[Any]:
        """``update`` without waiting: the ObjectRefs of every learner's metrics (rank 0 first).
        ``threads``: each learner's torch threads to start with (default ``num_threads``)."""
        self._updates += 1
        sizes = [g.stop - g.start for g in groups]
        starts = np.concatenate(([0], np.cumsum(sizes)))
        calls = []
        for learner, share in zip(self.learners, split_groups(sizes, len(self.learners))):
            rows = np.concatenate([advantages[starts[g]:starts[g + 1]] for g in share])
            calls.append(learner.update.remote([groups[g] for g in share], rows, threads, self._updates, version))
        return calls

    def set_threads(self, threads: int) -> None:
        """The running update's torch threads from each learner's next layer on (the cores the
        rollout actors leave idle; ``training.threads_alone``). Does not wait."""
        for learner in self.learners:
            learner.set_threads.options(concurrency_group="dial").remote(threads, self._updates)

    # -- weights out (the transports of gdpo_ray.run.transports drive these) --------------

    def weight_buckets(self, bucket_bytes: int) -> tuple[list[Any], Any, Any]:
        """The weights (under LoRA: the adapter) as buckets in the object store, from rank 0
        (the others take part in the gathers of sharded weights): (their ObjectRefs, what was
        sent but the digests: ``gdpo_ray.weights.digest.Sent``, the ObjectRef of the full record
        with the digests, which rank 0 takes from the store's copies while the receivers load
        them)."""
        refs, sent, push = self._on_all(lambda learner: learner.weight_buckets.remote(bucket_bytes))[0]
        return refs, sent, self.learners[0].sent_digests.options(concurrency_group="digest").remote(push)

    def broadcast_address(self) -> tuple[str, int]:
        """Where learner rank 0 hosts a broadcast group: its node's address and a free port."""
        return self._ray.get(self.learners[0].address.remote())

    def open_broadcast_async(self, host: str, port: int, world_size: int) -> Any:
        """Rank 0 opens a broadcast group as its root: the ObjectRef of the agreed backend."""
        return self.learners[0].open_broadcast.remote(host, port, world_size)

    def broadcast_weights_async(self, bucket_bytes: int) -> list[Any]:
        """Every rank's part of one broadcast (rank 0 sends): ObjectRefs, rank 0's of what was
        sent (``digest.Sent``)."""
        return [learner.broadcast_weights.remote(bucket_bytes) for learner in self.learners]

    def _on_all(self, call) -> list[Any]:
        """``call(learner)`` (an ObjectRef) on every learner, results in rank order
        (collectives need all ranks)."""
        return self._ray.get([call(learner) for learner in self.learners])

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler, RNG and step of every rank, under ``path``."""
        self._on_all(lambda learner: learner.save_checkpoint.remote(path))

    def load_checkpoint(self, path: str) -> int:
        """``save_checkpoint``'s state back; returns the learner step."""
        return self._on_all(lambda learner: learner.load_checkpoint.remote(path))[0]

    def export_hf(self, path: str, merged: str | None = None) -> None:
        """The policy as a Hugging Face model directory (rank 0 writes it); under LoRA a PEFT
        adapter directory, and the merged model in ``merged`` (``Learner.export_hf``)."""
        self._on_all(lambda learner: learner.export_hf.remote(path, merged))

    def get_weights(self) -> dict[str, np.ndarray]:
        """The full weights (rank 0's, gathered where the backend shards them)."""
        return self._on_all(lambda learner: learner.get_weights.remote())[0]

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for learner in self.learners:
            self._ray.kill(learner)
        if self._own_pg:
            remove_placement_group(self.pg)
