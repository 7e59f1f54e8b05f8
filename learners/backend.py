"""The learner backend contract: what the update (``learners.learner.Learner``) asks of the
engine that trains one rank, written once, with a registry of the backends (``learners.backend``).

A backend is a subclass of ``Learner`` (the GDPO update: micro-batches, the shared-prompt
forward, token logprobs, the policy loss, the thread dial, weights out, export) that fills in
this class's abstract methods; ``LearnerGroup`` starts N of it as Ray actors. The update calls:

- ``init_distributed()`` once: join the process group of the N ranks (``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT`` set; gloo on CPU, NCCL on GPU);
- ``wrap(model)`` once: the built model (Hugging Face, or PEFT's under ``llm.lora``, dropout
  off, in train mode) made the backend's, with torch's AdamW over its trainable parameters
  (``lr``, ``weight_decay``; betas and eps torch's; a constant learning rate); sets ``engine``
  (what forwards run through), ``module`` (the model inside it) and ``device``;
- per micro-batch, a forward through ``engine`` then ``backward(loss, last)``: the gradient
  accumulated (the ranks' averaged); after the mini-batch's last micro-batch the optimizer step,
  the gradient first clipped to ``grad_clip`` by its global norm (``grad_norm()`` reads it,
  before clipping); every rank runs the same number of micro-batches;
- ``param_groups``: the optimizer's (``lr`` read for the metrics, ``lr`` and ``weight_decay``
  set to the run's after a checkpoint is loaded);
- weights out, for a push, an export or a test (``learners.weight_sender``): ``full_tensors``
  of (name, parameter) pairs the sender names (every state-dict name, or under LoRA the
  adapter's trainable tensors), each the full unsharded tensor in float32 on the device;
  ``gathers`` says that is a collective (then every rank iterates alike); ``flat_weights``
  optionally hands out host byte ranges the weights already live in (no copy);
- ``save(path, tag, state)`` / ``load(path)``: model (under LoRA the adapter alone),
  optimizer and the small ``state`` (step, RNG), the latest ``tag`` under ``path`` (every rank
  calls both); ``checkpoint_weights`` reads a saved model's full float32 weights without a
  process group (``gdpo-ray eval CHECKPOINT``).

``shares_prompts`` says whether a micro-batch's rows may share their prompt's forward
(``learners/shared_prompts.py``: two forwards before one backward, a count that can differ
between ranks): not where each forward is a collective over the ranks.
"""

from __future__ import annotations

import abc
from typing import Any, Iterable, Iterator

from gdpo_ray.registry import import_path

#: ``learners.backend`` -> the learner class (``module:Class``), imported where it runs
BACKENDS = {"deepspeed": "learners.deepspeed_learner:DeepSpeedLearner",
            "fsdp2": "learners.fsdp2_learner:FSDP2Learner",
            "simulated": "learners.sim_learner:SimulatedLearner"}


def learner_class(backend: str) -> type:
    """The learner class of ``learners.backend``: a name of ``BACKENDS`` or ``package.module:Class``
    of a ``learners.learner.Learner`` subclass; ValueError naming the known ones."""
    path = BACKENDS.get(backend, backend)
    module, sep, name = str(path).partition(":")
    if not sep:
        raise ValueError(f"learners.backend must be one of {', '.join(BACKENDS)} (or 'package.module:Class' "
                         f"of a learners.learner.Learner); got {backend!r}; e.g. learners.backend=fsdp2")
    cls = import_path(path, f"learners.backend {backend!r}")
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if not (isinstance(cls, type) and issubclass(cls, LearnerBackend) and callable(getattr(cls, "update", None))) \
            or abstract:
        raise ValueError(f"learners.backend {backend!r} ({path}) is not a learner backend: "
                         + (f"it leaves abstract: {', '.join(abstract)}" if abstract else
                            "subclass learners.learner.Learner") + " (see learners.backend.LearnerBackend)")
    return cls


class LearnerBackend(abc.ABC):
    """The methods a backend fills in (the module docstring says when each is called)."""

    engine: Any  # what the forwards run through (.train(), .eval(), .training)
    module: Any  # the model inside it: Hugging Face's, or PEFT's under LoRA
    device: Any
    #: weights out are a collective (sharded parameters): every rank iterates ``full_tensors``
    gathers: bool = False

    @abc.abstractmethod
    def init_distributed(self) -> None:
        """Joins the ranks' process group."""

    @abc.abstractmethod
    def wrap(self, model: Any) -> None:
        """The model made this backend's, with its AdamW; sets ``engine``, ``module``, ``device``."""

    @abc.abstractmethod
    def backward(self, loss: Any, last: bool) -> None:
        """One micro-batch's backward; after the mini-batch's ``last``, the optimizer step."""

    @abc.abstractmethod
    def grad_norm(self) -> float:
        """The last optimizer step's global gradient norm, before clipping."""

    @property
    @abc.abstractmethod
    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups (``lr``, ``weight_decay``)."""

    @property
    @abc.abstractmethod
    def shares_prompts(self) -> bool:
        """Whether a micro-batch may forward each distinct prompt once (two forwards, one backward)."""

    @abc.abstractmethod
    def full_tensors(self, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """(name, the full float32 tensor on the device) of each (name, parameter)."""

    def full_shape(self, param: Any) -> list[int]:
        """A parameter's full shape, read without gathering it."""
        return list(param.shape)

    def flat_weights(self, named: Iterable[tuple[str, Any]]) -> list | None:
        """[(host bytes, [(offset, name, dtype, shape, nbytes)])] where the parameters already lie in
        flat host buffers (``gdpo_ray.weights.buckets.pack_flat_buckets``), else None."""
        return None

    @abc.abstractmethod
    def save(self, path: str, tag: str, state: dict) -> None:
        """Model (the adapter alone under LoRA), optimizer and ``state`` as ``tag``, the latest."""

    @abc.abstractmethod
    def load(self, path: str) -> dict:
        """The latest checkpoint under ``path`` back into model and optimizer; returns its ``state``."""

    @staticmethod
    @abc.abstractmethod
    def checkpoint_weights(path: str, model: Any, adapter_only: bool) -> dict[str, Any]:
        """A checkpoint's full float32 weights (the adapter's under LoRA), by ``model``'s names,
        read without a process group; ``model`` is the run's (Hugging Face's, or PEFT's)."""
