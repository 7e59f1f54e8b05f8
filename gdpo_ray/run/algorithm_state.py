"""What a GDPO run saves and restores, and how it recovers from a dead learner: the ``GDPO``
algorithm's state methods (``GDPOState``, a base of ``gdpo_ray.run.algorithm.GDPO``).

A checkpoint holds the driver's state (policy version, prompts, buffer, counters) in RLlib's
state file and the learners' own checkpoint (model, optimizer, RNG, step, in their backend's
format: ``learners.backend``) in ``learner/``, and the model's parameter names and shapes,
written atomically (``gdpo_ray.run.checkpoints.save_atomically``) and verified against its
manifest (and the configured model) before a restore. A restore keeps the run's timeline: the
newer checkpoints of the one it leaves are set aside, and pruning never deletes the checkpoint a
recovery goes back to. A learner's death restores the last checkpoint (or the start) on new
learners; the step then runs again, with the steps between, and ``train()`` returns it once.
"""

from __future__ import annotations

import logging
import pathlib
import tempfile
from typing import Any

from gdpo_ray.run.checkpoints import (check_model, prune_checkpoints, save_atomically, set_aside_newer,
                                      verify_checkpoint, write_model_record)
from gdpo_ray.run.rllib_base import Checkpointable

logger = logging.getLogger(__name__)


class GDPOState:
    """``GDPO``'s state: recovery, ``get_state`` / ``set_state``, checkpoints, the policy's export
    (it reads the algorithm's ``learners``, ``rollouts``, ``prompts``, ``buffer``, ``counters``)."""

    def _recover(self, err: Exception) -> None:
        """A learner died: new learners, then the last checkpoint (or the start) restored;
        ``last_recovery`` says (the step that failed, the step restored)."""
        failed = self.policy_version + 1
        logger.warning("a learner died in step %d (%s); recovering from %s", failed, err,
                       self._last_checkpoint or "the start of the run")
        self.counters["learner_recoveries"] += 1
        # events that happened stay counted (the restored state predates some of them), and the
        # train() calls made stay made: the redone steps are not new iterations
        events = (self.counters["learner_recoveries"], dict(self.rollouts.stats),
                  self.buffer.dropped_stale, self._iteration)
        self.rollouts.ledger.drop_due()  # the restored weights go out to every actor, checked
        try:
            self.learners.shutdown()
        except Exception:  # noqa: BLE001 - some of them are dead already
            pass
        self._start_learners()
        if self.config.engine_in_learner:  # the rollout actor lived in the dead learner: hosted anew
            self.rollouts.restart(self.rollouts.receivers())
        if self._last_checkpoint:
            self.restore_from_path(self._last_checkpoint)
        else:
            self.rollouts.discard_in_flight()
            self.set_state(self._initial_state)
            self._push_weights(self.policy_version)
        self.last_recovery = (failed, self.policy_version)
        self.counters["learner_recoveries"], stats, self.buffer.dropped_stale, self._iteration = events
        self.rollouts.stats.update(stats)

    def _checkpoint_step(self) -> None:
        """The automatic checkpoint of this step (``training.checkpoint_every``), the one a
        learner's death goes back to (it counts only once complete: written aside, then renamed),
        then the oldest beyond ``training.keep_checkpoints`` deleted, never that one."""
        self._last_checkpoint = self.save_to_path(
            str(self._checkpoint_root / f"step_{self.policy_version:06d}"))
        prune_checkpoints(self._checkpoint_root, self.config.keep_checkpoints, protect=[self._last_checkpoint])

    # -- checkpoints ---------------------------------------------------------------------------

    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict:
        in_buffer = self.buffer.group_ids()
        return {"policy_version": self.policy_version, "iteration": self.iteration,
                "prompts": self.prompts.state_dict(in_buffer=in_buffer),
                "buffer": self.buffer.state_dict(), "counters": dict(self.counters),
                "rollout_stats": dict(self.rollouts.stats) if getattr(self, "rollouts", None) else {}}

    def set_state(self, state: dict) -> None:
        self.policy_version = state["policy_version"]
        self._iteration = state["iteration"]
        self.prompts.load_state_dict(state["prompts"])
        self.buffer.load_state_dict(state["buffer"])
        self.counters = dict(state["counters"])
        if getattr(self, "rollouts", None) and state.get("rollout_stats"):
            self.rollouts.stats.update(state["rollout_stats"])

    def get_checkpointable_components(self) -> list:
        return []

    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack=False) -> str:
        """A checkpoint, atomically (``checkpoints.save_atomically``): the driver's state in
        RLlib's files, the learners' checkpoint in ``learner/``, the model's parameter names and
        shapes (``checkpoints.MODEL_RECORD``)."""
        def write(aside: pathlib.Path) -> None:
            Checkpointable.save_to_path(self, str(aside), state=state, filesystem=filesystem,
                                        use_msgpack=use_msgpack)
            self.learners.save_checkpoint(str(aside / "learner"))
            write_model_record(aside, self.config.model_path, self.model_path)

        final = path or tempfile.mkdtemp(prefix="gdpo-ckpt-")
        return save_atomically(final, write, f"policy_version {self.policy_version}")

    @classmethod
    def from_checkpoint(cls, path, filesystem=None, *, resume_without_manifest: bool = False, **kwargs) -> Any:
        """A GDPO from a checkpoint; every file is verified against the checkpoint's manifest
        before any actor starts (``checkpoints.verify_checkpoint``; one without a manifest only
        with ``resume_without_manifest``, as ``training.resume_without_manifest``)."""
        _verify(path, filesystem, resume_without_manifest)
        return super().from_checkpoint(path, filesystem=filesystem, verified=True, **kwargs)

    def restore_from_path(self, path, *args, verified: bool = False, **kwargs) -> None:
        """The checkpoint's state (verified first, unless it just was: its files against its
        manifest, its model against ``llm.model_path``), then its weights out. The run's
        checkpoints newer than the restored one belong to the timeline it leaves: set aside
        (``checkpoints.set_aside_newer``, said once) before it writes any of its own."""
        if not verified:
            config = getattr(self, "config", None)
            _verify(path, kwargs.get("filesystem"), getattr(config, "resume_without_manifest", False), config)
        self.rollouts.discard_in_flight()  # the restored prompt state re-issues what was in flight
        Checkpointable.restore_from_path(self, path, *args, **kwargs)
        self.learners.load_checkpoint(str(pathlib.Path(path) / "learner"))
        self._keep_timeline(path)
        self._last_checkpoint = str(path)  # a learner's death goes back here, not to the start
        self._push_weights(self.policy_version)

    def _keep_timeline(self, restored: Any) -> None:
        """The automatic checkpoints' folder's checkpoints newer than the state just restored,
        moved aside (named, once): they are of the timeline the restore left."""
        moved = set_aside_newer(self._checkpoint_root, self.policy_version)
        if moved is not None:
            folder, names = moved
            logger.warning("restored step %d (%s): the run's checkpoints of later steps, %s, are of the "
                           "timeline this restore leaves: moved to %s, so that its own checkpoints "
                           "(training.keep_checkpoints, a later resume) are not mixed with them",
                           self.policy_version, restored, ", ".join(names), folder)

    def export_policy(self, path: str) -> str:
        """The current policy as a Hugging Face model directory (from_pretrained / vLLM); under
        LoRA a PEFT adapter directory, and the merged model beside it in ``<path>-merged``."""
        merged = f"{str(path).rstrip('/')}-merged" if self.config.lora else None
        self.learners.export_hf(str(path), merged)
        return str(path)


def _verify(path: Any, filesystem: Any, without_manifest: bool, config: Any = None) -> None:
    """A local checkpoint's files against its manifest, and its model against ``config``'s
    (ValueError naming what differs)."""
    if filesystem is None and isinstance(path, (str, pathlib.Path)) and "://" not in str(path):
        warnings = verify_checkpoint(str(path), "restoring", without_manifest)
        if config is not None:
            warnings += check_model(config, str(path), "restoring")
        for warning in warnings:
            logger.warning(warning)
