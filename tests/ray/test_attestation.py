"""Every weight push is attested (issue 30): a transport that drops a bucket or corrupts one, or
an engine whose load silently does nothing, stops the run with the actor, the version, the tensor
and its bucket; a faithful run counts its pushes attested and reports their bytes and seconds."""

import dataclasses

import numpy as np
import pytest

from actors.attestation import WeightPushFailed
from gdpo_ray.run.transports import ObjectStoreTransport
from tests.ray.test_algorithm import demo_config

INERT = "generation.engine=tests.engines:InertHFEngine"


def stopped(algo, steps: int = 4) -> str:
    """The message that stopped ``algo`` within ``steps`` steps (reports arrive while it runs)."""
    try:
        with pytest.raises(WeightPushFailed) as err:
            for _ in range(steps):
                algo.train()
    finally:
        algo.stop()
    return " ".join(str(err.value).split())


def test_a_dropped_bucket_stops_the_run(ray_cluster, monkeypatch):
    send = ObjectStoreTransport.send

    def drop_the_last(self, version, receivers):
        pushed = send(self, version, receivers)
        return dataclasses.replace(pushed, buckets=pushed.buckets[:-1])

    monkeypatch.setattr(ObjectStoreTransport, "send", drop_the_last)
    message = stopped(demo_config("training.weight_bucket_mb=1").build_algo())
    assert "rollout actor 0 (Ray actor" in message and "weights version 1 it was sent" in message
    assert "not reported as held by the engine (bucket 1 of 2)" in message, message
    assert "check that the engine's load_weights applies every tensor" in message


def test_a_corrupted_bucket_stops_the_run(ray_cluster, monkeypatch):
    import ray

    send = ObjectStoreTransport.send

    def corrupt_the_first(self, version, receivers):
        pushed = send(self, version, receivers)
        bucket = ray.get(pushed.buckets[0])
        arrays = [a.copy() for a in bucket["arrays"]]
        arrays[0][len(arrays[0]) // 2] ^= 0x40  # one bit of one tensor
        return dataclasses.replace(pushed, buckets=[ray.put(dict(bucket, arrays=arrays)), *pushed.buckets[1:]])

    monkeypatch.setattr(ObjectStoreTransport, "send", corrupt_the_first)
    message = stopped(demo_config("training.weight_bucket_mb=1").build_algo())
    assert "does not hold the weights version 1 it was sent" in message
    assert "the engine holds other values than were sent (bucket 0 of 2)" in message, message


@pytest.mark.parametrize("sync", ["object_store", "broadcast"])
def test_an_engine_whose_load_does_nothing_stops_the_run(ray_cluster, sync):
    message = stopped(demo_config(INERT, f"training.weight_sync={sync}").build_algo())
    assert "does not hold the weights version 1 it was sent" in message, message
    assert "the engine holds other values than were sent (bucket 0 of 1)" in message


def test_a_faithful_run_attests_every_push_and_reports_its_bytes(ray_cluster):
    algo = demo_config().build_algo()
    try:
        results = [algo.train() for _ in range(3)]
    finally:
        algo.stop()
    assert [r["weights/attested"] for r in results][-1] >= 2  # the reports of the last push may be due
    assert all(r["weights/attested"] <= r["step"] for r in results)
    assert len({r["weights/push_bytes"] for r in results}) == 1 and results[0]["weights/push_bytes"] > 1e6
    assert all(np.isfinite(r["weights/push_s"]) and r["weights/push_s"] > 0 for r in results)


def test_the_cli_stops_with_the_message(ray_cluster, tmp_path, monkeypatch, capsys):
    from gdpo_ray.run.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["train", "demo", INERT, "run.steps=4", f"run.output_dir={tmp_path}", "training.prompts_per_step=4",
                 "training.group_size=4", "generation.max_tokens=32", "run.export_policy=false"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "gdpo-ray train: stopped: rollout actor 0" in err and "does not hold the weights version 1" in err
    assert "Traceback" not in err


def test_an_actor_that_never_reports_stops_the_run(ray_cluster):
    """A report still missing ``timeout_s`` after its push: stopped, not waited on forever."""
    import time

    from actors.attestation import PushLedger
    from gdpo_ray.weights.digest import Sent

    @ray_cluster.remote
    def never() -> dict:
        time.sleep(600)

    ledger = PushLedger(timeout_s=0.5)
    ledger.expect(1, Sent())
    ref = never.remote()
    ledger.awaiting("rollout actor 3", 1, ref)
    ledger.poll()  # not overdue yet: nothing happens
    time.sleep(0.6)
    with pytest.raises(WeightPushFailed, match=r"rollout actor 3 has not reported holding weights version 1 "
                                               r"\d+ s after the push \(the limit is 0.5 s\)"):
        ledger.poll()
    ray_cluster.cancel(ref, force=True)


def test_weights_lost_with_their_learner_are_a_recovery_not_a_bad_load(ray_cluster):
    """A push whose buckets died with the learner that put them (before an actor fetched them)
    is ``WeightsLost``: the driver recovers from it as from the learner's death, and a recovery
    forgets the reports of earlier pushes (its own push is checked as any)."""
    import time

    from actors.attestation import PushLedger, WeightsLost
    from gdpo_ray.weights.digest import Sent

    @ray_cluster.remote
    class Sender:  # a learner: the buckets it puts are owned by it, and die with it
        def put(self) -> list:
            return [ray_cluster.put(np.zeros(1 << 18))]  # 2 MiB: in the object store, as buckets are

    @ray_cluster.remote
    def load(buckets: list) -> dict:  # a rollout actor's load: fetches each bucket
        ray_cluster.get(buckets[0])
        return {"version": 3, "digests": None}

    sender = Sender.remote()
    buckets = ray_cluster.get(sender.put.remote())
    ray_cluster.kill(sender)
    with pytest.raises(ray_cluster.exceptions.RayActorError):  # dead before any actor fetched them
        ray_cluster.get(sender.put.remote())
    deadline = time.monotonic() + 60  # and its bucket freed (a copy still in the store is served)
    while True:
        try:
            ray_cluster.get(buckets[0], timeout=5)
        except ray_cluster.exceptions.ObjectLostError:
            break
        assert time.monotonic() < deadline, "the dead sender's bucket is still served after 60 s"
        time.sleep(0.2)
    ledger = PushLedger()
    ledger.expect(3, Sent())
    ledger.awaiting("rollout actor 0", 3, load.remote(buckets))
    ray_cluster.wait([ledger.due[0].ref])
    with pytest.raises(WeightsLost, match=r"rollout actor 0 failed to load weights version 3: .*; the learner "
                                          r"that sent them is gone"):
        ledger.poll()
    ledger.awaiting("rollout actor 0", 3, load.remote(buckets))
    ledger.drop_due()  # a recovery
    ledger.poll()
    assert ledger.due == []


def test_reports_wait_for_the_senders_digests_and_a_dead_sender_is_weights_lost(ray_cluster):
    """The sender's record may follow the push (its digests of the store's copies, taken while
    the receivers load them): reports in hand wait for it, never checked against nothing; once
    it comes a mismatch stops the run; a sender that died before giving it lost the weights."""
    import time

    from actors.attestation import PushLedger, WeightsLost
    from gdpo_ray.weights.digest import Sent

    @ray_cluster.remote
    def record(delay: float, digest: int) -> Sent:
        time.sleep(delay)
        sent = Sent()
        sent.add(["w"], ["float32"], [digest], 4)
        return sent

    @ray_cluster.remote
    def report(digest: int) -> dict:
        return {"version": 1, "digests": {"w": digest}}

    ledger = PushLedger()
    ledger.expect(1, record.remote(1.5, 7))
    ledger.awaiting("rollout actor 0", 1, report.remote(8))
    ray_cluster.wait([ledger.due[0].ref])
    ledger.poll()  # the report is in, the record is not: nothing is checked, nothing settled
    assert len(ledger.due) == 1 and ledger.attested == 0
    deadline = time.monotonic() + 30
    with pytest.raises(WeightPushFailed, match="rollout actor 0 does not hold the weights version 1 it was sent"):
        while time.monotonic() < deadline:
            ledger.poll()
            time.sleep(0.05)
    ledger = PushLedger()
    ledger.expect(2, record.remote(0, 7))
    ledger.report("rollout actor 0", 2, {"version": 2, "digests": {"w": 7}})  # in hand: waits for the record
    assert ledger.attested == 1

    @ray_cluster.remote
    class Learner:
        def digests(self) -> Sent:
            time.sleep(600)

    learner = Learner.remote()
    ledger = PushLedger()
    ledger.expect(3, learner.digests.remote())
    ledger.awaiting("rollout actor 0", 3, report.remote(7))
    ray_cluster.wait([ledger.due[0].ref])
    ray_cluster.kill(learner)
    with pytest.raises(WeightsLost, match="the sender of push 1 died before recording its digests"):
        while True:
            ledger.poll()
            time.sleep(0.05)

    @ray_cluster.remote
    def broken() -> Sent:
        raise ValueError("no digest today")

    @ray_cluster.remote
    def failed_load() -> dict:
        raise RuntimeError("the engine refused the tensor")

    ledger = PushLedger()  # a digest that raised stops the run with its cause: not a lost learner
    ledger.expect(4, broken.remote())
    ledger.awaiting("rollout actor 0", 4, report.remote(7))
    ray_cluster.wait([ledger.due[0].ref])
    with pytest.raises(WeightPushFailed, match="the sender of push 1 could not digest what it sent: .*no digest today"):
        ledger.settle()
    ledger = PushLedger()  # a load that failed is told at once, not after the sender's record
    late = record.remote(600, 7)
    ledger.expect(5, late)
    ledger.awaiting("rollout actor 0", 5, failed_load.remote())
    ray_cluster.wait([ledger.due[0].ref])
    with pytest.raises(WeightPushFailed, match="rollout actor 0 failed to load weights version 5: .*refused the tensor"):
        ledger.poll()
    ray_cluster.cancel(late, force=True)


def test_an_engine_holding_the_push_in_bfloat16_is_attested(ray_cluster):
    """The learners send float32; an engine computing in bfloat16 holds each tensor rounded, and
    matches the digests of the rounded tensors the sender took too."""
    algo = demo_config("generation.engine_kwargs={dtype: bfloat16}").build_algo()
    try:
        for _ in range(2):
            algo.train()
        ray_cluster.get([d.ref for d in algo.rollouts.ledger.due])
        algo.rollouts.collect()
        assert algo.rollouts.ledger.attested == 2
    finally:
        algo.stop()
