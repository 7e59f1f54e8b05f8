"""A learner backend on torch's DistributedDataParallel: every rank holds the whole model and
AdamW's whole state, the gradient is averaged over the ranks in each backward."""

from __future__ import annotations

import pathlib
from typing import Any, Iterable, Iterator

import torch

from learners.learner import Learner


class DDPLearner(Learner):
    gathers = False  # every rank holds the full weights: nothing to gather for a push
    shares_prompts = False  # DDP's reducer expects one forward per backward

    def init_distributed(self) -> None:
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        torch.distributed.init_process_group("nccl" if cuda else "gloo")

    def wrap(self, model: Any) -> None:
        self.module = model.to(self.device)
        self.engine = torch.nn.parallel.DistributedDataParallel(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.config.lr, weight_decay=self.config.weight_decay)

    def backward(self, loss: Any, last: bool) -> None:
        loss.backward()  # DDP all-reduces (averages) the gradient here
        if last:
            params = [p for p in self.module.parameters() if p.grad is not None]
            self._norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip or float("inf")))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self) -> float:
        return self._norm

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def full_tensors(self, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        return ((name, param.detach().float()) for name, param in named)

    def save(self, path: str, tag: str, state: dict) -> None:
        if self.rank == 0:  # the ranks are replicas: one file
            (pathlib.Path(path) / tag).mkdir(parents=True, exist_ok=True)
            model = {n: p for n, p in self.module.named_parameters() if p.requires_grad or not self.config.lora}
            torch.save({"model": model, "optimizer": self.optimizer.state_dict(), "state": state},
                       pathlib.Path(path) / tag / "learner.pt")
            (pathlib.Path(path) / "latest").write_text(tag)
        torch.distributed.barrier()

    def load(self, path: str) -> dict:
        saved = torch.load(_latest(path), map_location=self.device, weights_only=False)
        self.module.load_state_dict(saved["model"], strict=False)
        self.optimizer.load_state_dict(saved["optimizer"])
        return saved["state"]

    @staticmethod
    def checkpoint_weights(path: str, model: Any, adapter_only: bool) -> dict[str, Any]:
        return torch.load(_latest(path), map_location="cpu", weights_only=False)["model"]


def _latest(path: str) -> pathlib.Path:
    return pathlib.Path(path) / (pathlib.Path(path) / "latest").read_text().strip() / "learner.pt"
