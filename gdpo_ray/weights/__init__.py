"""Weights out: the learners' parameters to every rollout actor (``actors`` and ``learners`` meet
here instead of importing each other).

- ``buckets``: the wire format (buckets of bounded size; pack, unpack);
- ``channels``: the members' side of a broadcast group (gloo, NCCL, vLLM's weight transfer;
  the backend agreement), used by learner rank 0 and the rollout actors.

The driver's side, one class per ``training.weight_sync``, is ``gdpo_ray.run.transports``; the
learner's sending side is ``learners.weight_sender.WeightSender``.
"""
