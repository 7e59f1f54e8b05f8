"""Attestation of weight pushes: no rollout actor goes on sampling from weights it was not sent.

For every push the sender records what it sent (``gdpo_ray.weights.digest.Sent``: each tensor's
digest, dtype, shape and bucket); every rollout actor, once its engine has loaded the version,
reports the digests of what the engine holds (``RolloutActor.attest``, read back from the engine).
A digest depends on every element's value and position and on the tensor's row length, so an
engine holding the right values in the wrong places (rows permuted or reversed, a transpose, q/k/v
shards swapped in a fused tensor, signs swapped within a +x/-x pair) is caught too. The
``PushLedger`` (held by the ``RolloutGroup``, fed by the transports) compares them as the
reports arrive, without waiting for them: the rollout actors keep generating. A push is
attested once every actor it went to has reported matching digests (``attested``: the metric
``weights/attested``). A mismatch, a load that raised, or an actor that has not reported a
version ``timeout_s`` after it was pushed stops the run (``WeightPushFailed``) with the actor,
the version, the tensor and its bucket, and what to check; a load that failed because the
weights were lost with their sender (a learner that died before every actor fetched them) is
``WeightsLost``, which the driver recovers from as from that learner's death. An engine that
cannot read its weights back (``weight_digests`` raising NotImplementedError: vLLM over several
workers) is warned about once and its pushes are not counted attested. An actor that died
meanwhile owes no report (its replacement loads the version and reports it); a streaming actor
that skipped a version because it held a newer one already is attested by the newer one's report.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from gdpo_ray.weights.digest import Sent, compare

logger = logging.getLogger(__name__)

#: how long an actor may take to report a pushed version (a batched actor loads it after the
#: generate calls queued before it)
ATTEST_TIMEOUT_S = 900.0

WHAT_TO_CHECK = ("check that the engine's load_weights applies every tensor it is given and "
                 "weight_digests reads back what it computes with (a custom engine), that every "
                 "bucket arrived (the object store's memory, training.weight_bucket_mb), and that "
                 "learners and engines agree on llm.lora and the model")


class WeightPushFailed(RuntimeError):
    """A rollout actor does not hold the weights it was sent: the run stops."""


class WeightsLost(WeightPushFailed):
    """A rollout actor could not fetch a push's weights: they were lost with the process that
    held them, the learner that sent them having died (Ray's ``ObjectLostError``); or that
    learner died before giving the digests of what it sent. Not the actor's fault: the driver
    recovers as from that learner's death, which pushes again."""


@dataclasses.dataclass
class _Due:
    label: str
    version: int
    push: int | None  # which push of that version (a version is pushed again after a recovery)
    ref: Any  # the ObjectRef of the actor's report
    since: float


class PushLedger:
    """What each push sent, and the reports still due from the actors it went to. Pushes are
    told apart by their order, not their version: after a learner recovery a version goes out
    again with other weights, and reports of the first push are checked against the first."""

    def __init__(self, timeout_s: float = ATTEST_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.sent: dict[int, Any] = {}  # push -> what it sent (a Sent, or the ObjectRef of one)
        self.due: list[_Due] = []
        self.attested = 0  # pushes every receiver of which reported matching digests
        self._latest: dict[int, int] = {}  # version -> its latest push
        self._matched: dict[int, int] = {}  # push -> reports checked and matching
        self._counted: set[int] = set()  # pushes counted in ``attested``
        self._unverified: set[str] = set()  # actors whose engine cannot read its weights back (warned)
        self._pushes = 0

    def expect(self, version: int, sent: Any) -> None:
        """The sender's record of a push of ``version`` (its reports are compared with this): a
        ``Sent``, or the ObjectRef of one on its way (the sender digests the object store's
        copies while the receivers load them; reports wait for it)."""
        self._pushes += 1
        self.sent[self._pushes], self._latest[version] = sent, self._pushes
        self._prune()

    def awaiting(self, label: str, version: int, ref: Any) -> None:
        """``ref`` will hold actor ``label``'s report of loading the latest push of ``version``."""
        self.due.append(_Due(label, version, self._latest.get(version), ref, time.monotonic()))

    def report(self, label: str, version: int, report: dict) -> None:
        """An actor's report of the latest push of ``version``, in hand already (a broadcast's
        part), checked now."""
        push = self._latest.get(version)
        self._arrived(push, wait=True)  # a broadcast's record comes with its reports: no wait
        self._check(label, push, version, report)
        self._settled(push)

    def drop_due(self) -> None:
        """Forgets the reports still due: a learner recovery pushes the restored weights to every
        actor, and those reports are checked as any; the loads of earlier pushes are moot (some
        of their weights may have gone with the learner that died)."""
        self.due.clear()

    def settle(self, timeout_s: float = 300.0) -> None:
        """Waits (at most ``timeout_s``) until every report due and the senders' records have
        arrived, then checks them (``poll``): nothing is due after it."""
        import ray

        if self.due:
            ray.wait([d.ref for d in self.due], num_returns=len(self.due), timeout=timeout_s)
        for push in {d.push for d in self.due}:
            sent = self.sent.get(push) if push is not None else None
            if sent is not None and not isinstance(sent, Sent):
                ray.wait([sent], timeout=timeout_s)
        self.poll()

    def poll(self) -> None:
        """Checks every report that has arrived; raises ``WeightPushFailed`` on a mismatch or on
        a report overdue by ``timeout_s``. Never waits."""
        if not self.due:
            return
        import ray

        refs = [d.ref for d in self.due]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)
        ready, now = set(ready), time.monotonic()
        for due in list(self.due):
            if due.ref in ready:
                try:
                    report = ray.get(due.ref)
                except ray.exceptions.RayActorError:  # it died: its replacement reports instead
                    self.due.remove(due)
                    self._settled(due.push)
                    continue
                except ray.exceptions.RayTaskError as err:
                    cause = getattr(err, "cause", None) or err
                    said = (f"{due.label} failed to load weights version {due.version}: "
                            f"{str(cause).splitlines()[0][:400]}")
                    if isinstance(cause, ray.exceptions.ObjectLostError):
                        raise WeightsLost(f"{said}; the learner that sent them is gone") from None
                    raise WeightPushFailed(f"{said}; {WHAT_TO_CHECK}") from None
                if self._arrived(due.push, wait=False):  # else checked once the sender's record comes
                    self.due.remove(due)
                    self._check(due.label, due.push, due.version, report)
                    self._settled(due.push)
                    continue
            if now - due.since > self.timeout_s:
                if due.ref in ready:  # the actor reported; the sender's digests did not come
                    raise WeightPushFailed(
                        f"the sender of weights version {due.version} has not given the digests "
                        f"of what it sent {now - due.since:.0f} s after the push (the limit is "
                        f"{self.timeout_s:g} s): learner rank 0 may be stuck")
                raise WeightPushFailed(
                    f"{due.label} has not reported holding weights version {due.version} "
                    f"{now - due.since:.0f} s after the push (the limit is {self.timeout_s:g} s): "
                    f"it may be stuck in a generate call or a load; {WHAT_TO_CHECK}")

    def _arrived(self, push: int | None, wait: bool) -> bool:
        """Whether the sender's record of ``push`` is in hand (fetched now if it has arrived, or
        with ``wait`` until it does, at most ``timeout_s``). A sender that died before giving it
        lost the weights too (``WeightsLost``: the driver recovers and pushes again); one whose
        digests raised stops the run with the cause."""
        sent = self.sent.get(push) if push is not None else None
        if sent is None or isinstance(sent, Sent):
            return True
        import ray

        if not wait and not ray.wait([sent], timeout=0, fetch_local=True)[0]:
            return False
        try:
            self.sent[push] = ray.get(sent, timeout=self.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as err:
            raise WeightsLost(f"the sender of push {push} died before recording its digests "
                              f"({str(err).splitlines()[0][:200]})") from None
        except ray.exceptions.GetTimeoutError:
            raise WeightPushFailed(f"the sender of push {push} has not given the digests of what it "
                                   f"sent within {self.timeout_s:g} s: learner rank 0 may be stuck") from None
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None) or err
            raise WeightPushFailed(f"the sender of push {push} could not digest what it sent: "
                                   f"{str(cause).splitlines()[0][:400]}") from None
        return True

    def _check(self, label: str, push: int | None, version: int, report: dict) -> None:
        if report.get("unverified") and label not in self._unverified:
            self._unverified.add(label)
            logger.warning("%s cannot read back the weights it holds (%s): its pushes are loaded but "
                           "not attested (weights/attested does not count them)", label, report["unverified"])
        sent = self.sent.get(push) if push is not None else None
        if sent is None or report.get("digests") is None:
            return  # no record of this push (a test's hand-made weights), or a version skipped
        if report.get("version") != version:
            raise WeightPushFailed(f"{label} reports version {report.get('version')} after loading "
                                   f"version {version}; {WHAT_TO_CHECK}")
        wrong = compare(sent.digests, report["digests"], sent.rounded, sent.shapes)
        if wrong:
            first = wrong[0].split(":")[0].split("+")[0].split(" ")[0]
            where = f" (bucket {sent.buckets[first]} of {sent.count})" if first in sent.buckets else ""
            more = f"; and {len(wrong) - 1} more tensor(s) differ" if len(wrong) > 1 else ""
            raise WeightPushFailed(
                f"{label} does not hold the weights version {version} it was sent: "
                f"{wrong[0]}{where}{more}. The run stops rather than sample from a policy it did "
                f"not mean to; {WHAT_TO_CHECK}")
        self._matched[push] = self._matched.get(push, 0) + 1

    def _settled(self, push: int | None) -> None:
        """Counts ``push`` attested once no report of it is due any more and one at least
        matched (reports of actors that died owe nothing)."""
        if (push is not None and push not in self._counted and self._matched.get(push, 0)
                and not any(d.push == push for d in self.due)):
            self._counted.add(push)
            self.attested += 1

    def _prune(self) -> None:
        """Keeps the records of pushes some report is still due for, and the latest version's
        latest push (an actor started later loads it)."""
        keep = {d.push for d in self.due} | {self._latest[max(self._latest)]}
        self.sent = {k: v for k, v in self.sent.items() if k in keep}
        self._matched = {k: v for k, v in self._matched.items() if k in keep}
        self._latest = {v: k for v, k in self._latest.items() if k in keep}
