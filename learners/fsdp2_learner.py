"""The FSDP2 backend (``learners.backend=fsdp2``): torch's ``fully_shard`` over the N learners
(gloo on CPU, NCCL on GPU), full fine-tuning or a PEFT LoRA adapter, the update of
``learners.learner.Learner``.

Each decoder layer (the model's ``_no_split_modules``) is one FSDP group and the root the rest
(embeddings, final norm, head): parameters, gradients and AdamW's state are sharded over the
ranks (ZeRO-3's layout; ``training.zero_stage`` does not apply), each layer's weights gathered for
its forward and again for its backward (on one learner kept from the one to the other: the demo's
update 0.29 -> 0.22 s, DeepSpeed's 0.19), the gradient reduce-scattered (averaged over the ranks)
after every micro-batch's backward. The optimizer is torch's AdamW on the shards with DeepSpeed's
settings here (``lr``, ``weight_decay``, torch's betas and eps, a constant learning rate), the
gradient clipped to ``grad_clip`` by its global norm first: the same update as DeepSpeed's to
float rounding (``tests/ray/test_fsdp2.py``). ``training.precision=bf16``: FSDP2's mixed
precision (bf16 weights in the forward and backward, float32 shards, gradients reduced in
float32); a push then sends the weights as the forward sees them, bf16-rounded, in float32.

Weights out: each parameter gathered on its own (``DTensor.full_tensor``, a collective), full and
in float32, as DeepSpeed's ZeRO-3 path sends them. Checkpoints: torch's distributed checkpoint
(``torch.distributed.checkpoint``, one file per rank and a metadata file) of the model (under
LoRA the adapter alone) and the optimizer, ``latest`` naming the tag, ``learner_state.json`` the
step and RNG; a checkpoint loads on any number of learners.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Iterable, Iterator

from gdpo_ray.causal_lm import unwrapped
from learners.learner import Learner

#: the file of a checkpoint's step and RNG (beside the distributed checkpoint's)
STATE_FILE = "learner_state.json"


class FSDP2Learner(Learner):
    """One rank; ``engine`` and ``module`` are the sharded model itself."""

    gathers = True  # every parameter is a shard: weights out are all-gathers

    def init_distributed(self) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        torch = self.torch
        if torch.cuda.is_available():  # Ray gives each learner its own GPU: device 0 of its view
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))

    def wrap(self, model: Any) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        torch, cfg = self.torch, self.config
        bf16 = cfg.precision == "bf16"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                      reduce_dtype=torch.float32 if bf16 else None)
        layers = set(getattr(unwrapped(model), "_no_split_modules", None) or ())
        # one learner: its shard is the whole layer, kept gathered from the forward to the backward
        regather = self.world_size > 1
        for module in list(model.modules()):  # the layers first, then the root: one group each
            if type(module).__name__ in layers:
                fully_shard(module, mesh=self.mesh, mp_policy=policy, reshard_after_forward=regather)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)  # moves the shards to the mesh's device
        self.engine = self.module = model
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                           lr=cfg.lr, weight_decay=cfg.weight_decay)
        self._grad_norm = 0.0

    @property
    def shares_prompts(self) -> bool:  # every forward gathers the layers' weights with every rank
        return self.world_size == 1

    def backward(self, loss: Any, last: bool) -> None:
        """The gradient reduce-scattered into the shards' after each backward; after the last,
        clipped by its global norm (over every rank's shards), then AdamW."""
        torch = self.torch
        loss.backward()
        if not last:
            return
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip or float("inf"))
        self._grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self) -> float:
        return self._grad_norm

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def full_tensors(self, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Each shard gathered on its own (an all-gather; the root's parameters may be held
        gathered already, after a forward), as float32; under bf16 rounded as the forward sees it."""
        torch = self.torch
        for name, param in named:
            tensor = param.detach()
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if self.config.precision == "bf16":
                tensor = tensor.to(torch.bfloat16)
            yield name, tensor.float()

    # -- checkpoints --------------------------------------------------------------------------

    def _options(self, **kwargs: Any) -> Any:
        """The state dicts' options: under LoRA the adapter alone (the base is the model's files)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=bool(self.config.lora), **kwargs)

    def _state_dicts(self) -> tuple[dict, dict]:
        """The model's and the optimizer's state dicts (sharded). Under LoRA every name of a frozen
        parameter is left out: ``ignore_frozen_params`` keeps a tied one's second name,
        ``lm_head.weight`` under ``tie_word_embeddings``, the whole embedding matrix."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.module, self.optimizer, options=self._options())
        if self.config.lora:
            trainable = {n for n, p in self.module.named_parameters(remove_duplicate=False) if p.requires_grad}
            model = {name: value for name, value in model.items() if name in trainable}
        return model, optim

    def save(self, path: str, tag: str, state: dict) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        model, optim = self._state_dicts()
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(pathlib.Path(path) / tag))
        if self.rank == 0:  # as DeepSpeed keeps rank 0's client state
            (pathlib.Path(path) / tag / STATE_FILE).write_text(json.dumps(state))
            (pathlib.Path(path) / "latest").write_text(tag)
        dist.barrier()

    def load(self, path: str) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        folder = pathlib.Path(path) / (pathlib.Path(path) / "latest").read_text().strip()
        model, optim = self._state_dicts()
        dcp.load({"model": model, "optim": optim}, checkpoint_id=str(folder))
        set_state_dict(self.module, self.optimizer, model_state_dict=model, optim_state_dict=optim,
                       options=self._options(strict=not self.config.lora))
        return json.loads((folder / STATE_FILE).read_text())

    @staticmethod
    def checkpoint_weights(path: str, model: Any, adapter_only: bool) -> dict[str, Any]:
        """The saved model's tensors in ``model``'s names (its trainable ones under LoRA),
        resharded into full tensors by the distributed checkpoint's reader, in this process."""
        import torch.distributed.checkpoint as dcp

        folder = pathlib.Path(path) / (pathlib.Path(path) / "latest").read_text().strip()
        saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        weights = {name: t.detach().float().clone() for name, t in model.state_dict().items()
                   if f"model.{name}" in saved and (not adapter_only or name in trainable)}
        dcp.load({"model": weights}, checkpoint_id=str(folder), no_dist=True)
        return weights
