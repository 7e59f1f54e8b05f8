"""Weight transports (driver side): how a new policy version gets from the learners to the rollout
actors. One class per transport, chosen once from ``training.weight_sync`` (``TRANSPORTS``,
``make_transport``), each with one interface:

    send(version, receivers) -> Pushed    # connects the receivers if they changed, sends
    close()                               # forgets the connection (rebuilt at the next send)

Every transport sends from a ``learners.learner_group.LearnerGroup`` to the actors of an
``actors.rollout_group.RolloutGroup`` (``receivers()``: handles of ``RolloutActor``, whose
``set_weights`` / ``join_broadcast`` / ``receive_weights`` are the receiving side).

and ``push_weights(transport, rollouts, version)`` is the one way a version goes out (after an
update, a learner recovery, a restore): dead actors replaced first (no new work is started: a
restored prompt state stays as saved), the version sent, actors a failed broadcast left behind
replaced, the rollout group told (``RolloutGroup.on_update``).

``ObjectStoreTransport``: learner rank 0 writes buckets (``gdpo_ray.weights.buckets``) once into
Ray's object store; each actor reads them zero-copy, and an actor started later loads the same
refs. ``BroadcastTransport``: learner rank 0 and the actors form a group of their own
(``gdpo_ray.weights.channels``: gloo, NCCL, or vLLM's weight transfer, as the members agree),
rebuilt when the actors change. A receiver that dies before or during a broadcast costs no more
than that version: the group is dropped, every actor whose part did not complete (the dead one,
and survivors left waiting inside the collective) is named for replacement, and the version goes
out through the object store instead. A dead learner raises (the algorithm's learner recovery).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol, Sequence

import ray
from ray.actor import ActorHandle

from actors.rollout_group import RolloutGroup
from gdpo_ray.weights.digest import Sent
from learners.learner_group import LearnerGroup

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Pushed:
    """One version sent. ``sent``: what the sender sent (each tensor's digest and bucket, the
    bytes: ``gdpo_ray.weights.digest.Sent``; without the digests where ``digests`` is given);
    ``buckets``: ObjectRefs each receiver loads (and an actor started later), or None when every
    receiver has loaded the version already; ``reports``: the receivers' attestations in hand
    already (a broadcast's parts); ``replace``:
    actors to be replaced (their part of a broadcast failed); ``digests``: the ObjectRef of the
    full record where ``sent`` holds the sizes only (the sender digests the object store's copies
    while the receivers load them)."""

    version: int
    sent: Sent
    buckets: list[ray.ObjectRef] | dict | None = None  # {}: nothing to load (``SharedTransport``)
    digests: ray.ObjectRef | None = None
    reports: tuple[tuple[ActorHandle, dict], ...] = ()
    replace: tuple[ActorHandle, ...] = ()

    @property
    def peak_bytes(self) -> int:
        """The largest bucket's bytes (or tensor's, for vLLM's transfer)."""
        return self.sent.peak_bytes


class WeightTransport(Protocol):
    name: str

    def send(self, version: int, receivers: Sequence[ActorHandle]) -> Pushed: ...

    def close(self) -> None: ...


class ObjectStoreTransport:
    """Buckets in Ray's object store: any cluster, any device; nothing to connect."""

    name = "object_store"

    def __init__(self, learners: LearnerGroup, bucket_bytes: int) -> None:
        self.learners, self.bucket_bytes = learners, bucket_bytes

    def send(self, version: int, receivers: Sequence[ActorHandle]) -> Pushed:
        refs, sent, digests = self.learners.weight_buckets(self.bucket_bytes)
        return Pushed(version, sent, buckets=refs, digests=digests)

    def close(self) -> None:
        """Nothing is held between sends."""


class _Broken(Exception):
    def __init__(self, actors: list[ActorHandle], cause: Any) -> None:
        super().__init__(str(cause).splitlines()[0][:300] if str(cause) else type(cause).__name__)
        self.actors = actors


class BroadcastTransport:
    """A broadcast from learner rank 0 over a group of its own with the receivers, bypassing
    the object store: NCCL when learner and engines are all on CUDA (vLLM engines through
    vLLM's weight transfer), else gloo; ``backend`` says which once connected."""

    name = "broadcast"

    def __init__(self, learners: LearnerGroup, bucket_bytes: int, grace_s: float = 10.0) -> None:
        self.learners, self.bucket_bytes, self.grace_s = learners, bucket_bytes, grace_s
        self.members: list[ActorHandle] | None = None
        self.backend: str | None = None
        self._fallback = ObjectStoreTransport(learners, bucket_bytes)

    def connect(self, receivers: Sequence[ActorHandle]) -> None:
        """Builds the group with ``receivers`` (ranks 1..n) unless it has them already."""
        if self.members == list(receivers):
            return
        self.members = None
        host, port = self.learners.broadcast_address()
        world = 1 + len(receivers)
        parts = [(a, a.join_broadcast.remote(host, port, i + 1, world)) for i, a in enumerate(receivers)]
        self.backend = self._settle([self.learners.open_broadcast_async(host, port, world)], parts)[0][0]
        self.members = list(receivers)

    def send(self, version: int, receivers: Sequence[ActorHandle]) -> Pushed:
        try:
            self.connect(receivers)
            parts = [(a, a.receive_weights.remote(version)) for a in receivers]
            results, reports = self._settle(self.learners.broadcast_weights_async(self.bucket_bytes), parts)
        except _Broken as broken:
            logger.warning("weight broadcast of version %d failed (%s); replacing %d rollout "
                           "actor(s) and pushing through the object store", version, broken,
                           len(broken.actors))
            self.close()
            pushed = self._fallback.send(version, receivers)
            return dataclasses.replace(pushed, replace=tuple(broken.actors))
        return Pushed(version, results[0], reports=tuple(reports))

    def close(self) -> None:
        self.members = None

    def _settle(self, learner_refs: list[ray.ObjectRef],
                parts: list[tuple[ActorHandle, ray.ObjectRef]]) -> tuple[list, list]:
        """The learners' results of a broadcast step whose other members are ``parts``, and the
        members' (actor, result). Raises a learner's death as it is; any other failure as
        ``_Broken`` naming the actors whose part did not complete (those still waiting
        ``grace_s`` after the learners gave up are stuck in the collective)."""
        try:
            results, failed = ray.get(learner_refs), None
        except ray.exceptions.RayActorError:
            raise  # a learner died: not the broadcast's to handle
        except ray.exceptions.RayTaskError as err:  # e.g. gloo: "Connection closed by peer"
            results, failed = None, err
        refs = [ref for _, ref in parts]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.grace_s if failed else None)
        broken, members = [], []
        for actor, ref in parts:
            if ref not in done:
                broken.append(actor)
                continue
            try:
                members.append((actor, ray.get(ref)))
            except ray.exceptions.RayError:
                broken.append(actor)
        if failed is not None or broken:
            raise _Broken(broken or [a for a, _ in parts], failed or "a rollout actor died")
        return results, members


class SharedTransport:
    """Nothing to send: the engine is hosted by learner rank 0 and shares its module
    (``generation.engine_in_learner``, ``gdpo_ray.run.in_learner``). A push is an empty load
    that gives the engine its version (ordered after the update, before the next call, on the
    learner's one queue of calls); its report attests an empty record."""

    name = "shared"

    def send(self, version: int, receivers: Sequence[ActorHandle]) -> Pushed:
        return Pushed(version, Sent(), buckets={})

    def close(self) -> None:
        """Nothing is held between sends."""


TRANSPORTS: dict[str, type[WeightTransport]] = {"object_store": ObjectStoreTransport, "broadcast": BroadcastTransport}


def make_transport(name: str, learners: LearnerGroup, bucket_bytes: int) -> WeightTransport:
    """The transport ``training.weight_sync`` names, sending from ``learners``."""
    if name not in TRANSPORTS:
        raise ValueError(f"weight_sync must be one of {sorted(TRANSPORTS)}; got {name!r}")
    return TRANSPORTS[name](learners, bucket_bytes)


def push_weights(transport: WeightTransport, rollouts: RolloutGroup, version: int) -> Pushed:
    """``version`` to every rollout actor of ``rollouts`` (a ``RolloutGroup``) through
    ``transport``; too-stale buffered groups are re-issued (``on_update``). What was sent goes
    to the group's ``PushLedger``, with the reports in hand; the others are checked as they
    arrive (``actors.attestation``)."""
    rollouts.collect()  # actors that died since the last push (their calls failed): replaced
    pushed = transport.send(version, rollouts.receivers())
    rollouts.ledger.expect(version, pushed.sent if pushed.digests is None else pushed.digests)
    if pushed.replace:
        rollouts.restart(pushed.replace)
    for actor, report in pushed.reports:
        rollouts.ledger.report(rollouts.label(actor), version, report)
    rollouts.on_update(version, pushed.buckets)
    return pushed
