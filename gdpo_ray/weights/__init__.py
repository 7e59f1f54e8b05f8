"""Weights out: the learners' parameters to every rollout actor (``actors`` and ``learners`` meet
here instead of importing each other).

- ``buckets``: the wire format (buckets of bounded size; pack, unpack);
- ``channels``: the members' side of a broadcast group (gloo, NCCL, vLLM's weight transfer;
  the backend agreement), used by learner rank 0 and the rollout actors;
- ``transports``: the driver's side, one class per ``training.weight_sync`` (object store,
  broadcast), and ``push_weights``, the one way a version goes out.

The learner's sending side is ``learners.weight_sender.WeightSender``.
"""
