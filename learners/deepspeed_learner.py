"""The DeepSpeed backend (``learners.backend=deepspeed``, the default): a DeepSpeed engine, ZeRO
stage 0-3 (``training.zero_stage``), fp32 or bf16, with a client torch AdamW; DeepSpeed clips the
gradient (``gradient_clipping``) and averages it over the ranks. The update itself is
``learners.learner.Learner``'s; what is DeepSpeed's is here: the engine, its accumulation
boundary, ZeRO-3's gathered parameters and ZeRO-1/2's flat buffers for a push, its checkpoints.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator

from learners.deepspeed_env import deepspeed_for
from learners.learner import Learner, LearnerConfig

# LearnerConfig: also imported from here (the tests, the benchmarks)
__all__ = ["DeepSpeedLearner", "LearnerConfig"]


def _save_trainable_only(engine) -> None:
    """A checkpoint's module file under LoRA holds the adapter alone. DeepSpeed's
    ``exclude_frozen_parameters`` drops each frozen parameter under the one name
    ``named_parameters()`` gives it, so a tied one's other name stays: ``lm_head.weight`` under
    ``tie_word_embeddings`` is the whole embedding matrix (SmolLM2-135M, r 8: 113 of the module
    file's 123 MB). The engine's ``module_state_dict`` then also drops every other name of a
    frozen parameter; loading is non-strict under LoRA, the frozen weights being the model's files."""
    full = engine.module_state_dict

    def module_state_dict(*args, exclude_frozen_parameters: bool = False, **kwargs):
        state = full(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name, param in engine.module.named_parameters(remove_duplicate=False):
                if not param.requires_grad:
                    state.pop(name, None)
        return state

    engine.module_state_dict = module_state_dict


class DeepSpeedLearner(Learner):
    """One rank on a DeepSpeed engine (``engine``; ``module`` is the model inside it)."""

    def init_distributed(self) -> None:
        import torch

        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        self._deepspeed = deepspeed_for(self.world_size)
        self._deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")

    def wrap(self, model: Any) -> None:
        cfg = self.config
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = self.torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.grad_clip, "zero_optimization": {"stage": cfg.zero_stage},
            "bf16": {"enabled": cfg.precision == "bf16"}, "steps_per_print": 10**9,
        }
        self.engine, *_ = self._deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        if cfg.lora:
            _save_trainable_only(self.engine)
        self.module, self.device = self.engine.module, self.engine.device

    @property
    def gathers(self) -> bool:  # ZeRO-3 partitions every parameter
        return self.config.zero_stage == 3

    @property
    def shares_prompts(self) -> bool:  # ZeRO-3 gathers the partitioned weights in every forward
        return self.config.zero_stage < 3

    def backward(self, loss: Any, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()  # DeepSpeed steps at the accumulation boundary only

    def grad_norm(self) -> float:
        return float(self.engine.get_global_grad_norm() or 0.0)

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    # -- weights out --------------------------------------------------------------------------

    def full_tensors(self, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Each ZeRO-3 parameter gathered on its own (a collective), the others as they are."""
        for name, param in named:
            if self.config.zero_stage == 3 and hasattr(param, "ds_id"):
                with self._deepspeed.zero.GatheredParameters([param]):
                    yield name, param.detach().float().clone()
            else:
                yield name, param.detach().float()

    def full_shape(self, param: Any) -> list[int]:
        """A ZeRO-3 partition keeps its full shape in ``ds_shape``."""
        return list(param.ds_shape if hasattr(param, "ds_shape") else param.shape)

    def flat_weights(self, named: Iterable[tuple[str, Any]]) -> list | None:
        """Under ZeRO-1/2 on the host every parameter is a view into DeepSpeed's flat buffers
        (``bit16_groups_flat``): [(the buffer's bytes, [(offset, name, dtype, shape, nbytes)])]
        over every name, or None where some tensor lies outside them (ZeRO-0/3, GPU)."""
        torch = self.torch
        flats = getattr(getattr(self.engine, "optimizer", None), "bit16_groups_flat", None)
        if not flats or self.config.zero_stage not in (1, 2) or self.device.type != "cpu":
            return None
        spans = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in flats]
        entries: list[list] = [[] for _ in flats]
        for name, tensor in named:
            ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            hit = [i for i, (a, b) in enumerate(spans) if a <= ptr and ptr + nbytes <= b]
            if not hit or not tensor.is_contiguous():
                return None
            entries[hit[0]].append((ptr - spans[hit[0]][0], name,
                                    str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), nbytes))
        return [(f.detach().view(-1).view(torch.uint8).numpy(), e)
                for f, e in zip(flats, entries) if e]

    # -- checkpoints --------------------------------------------------------------------------

    def save(self, path: str, tag: str, state: dict) -> None:
        """DeepSpeed's checkpoint: ``path/latest`` names ``tag``, its directory the module and
        optimizer files, ``state`` as its client state."""
        self.engine.save_checkpoint(path, tag=tag, client_state=state,
                                    exclude_frozen_parameters=bool(self.config.lora))

    def load(self, path: str) -> dict:
        _, state = self.engine.load_checkpoint(path, load_module_strict=not self.config.lora)
        return state

    @staticmethod
    def checkpoint_weights(path: str, model: Any, adapter_only: bool) -> dict[str, Any]:
        """Any ZeRO stage's, gathered to float32 by DeepSpeed's ``zero_to_fp32``."""
        from learners.deepspeed_env import import_deepspeed

        import_deepspeed()  # without its autotuner's MLflow import
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(path, exclude_frozen_parameters=adapter_only)
