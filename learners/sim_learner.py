"""The simulated learner (``learners.backend: simulated``): no model, no torch in its update; it
reads its share of every update's groups from the object store as any learner does, sleeps the
time the timing model (``gdpo_ray.simulation``) gives their tokens, and pushes a payload of
``simulation.weight_bytes`` (under ``llm.lora`` that times ``lora_fraction``, under adapter
names) through the real transports, digested and attested, so that a large run's driver,
buffer and pushes can be measured on one machine (docs/scale.md).

The payload is ``weight_tensors`` float32 tensors in one flat host buffer (as DeepSpeed's
ZeRO-1/2 weights lie: pushes are byte ranges of it, ``learners.backend.LearnerBackend.
flat_weights``); each update writes the step into every tensor's first element, so every push
differs from the last and an engine that kept old weights fails its attestation. The update's
metrics are those of a learner with the losses 0 (nothing is computed) and ``modelled_s``, the
seconds slept. The ranks do not talk to each other: each sleeps for its own share, as the
real ranks compute in parallel.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from learners.learner import Learner, LearnerConfig
from learners.weight_sender import WeightSender

PAYLOAD = "payload.npy"  # a checkpoint's weights (beside state.json)


class _Payload:
    """The pushed weights as a module's state dict: names -> float32 views of one flat buffer."""

    def __init__(self, total_bytes: int, tensors: int, adapter: bool, seed: int) -> None:
        count = max(1, min(tensors, total_bytes // 4))
        sizes = np.full(count, total_bytes // 4 // count, dtype=np.int64)
        sizes[: total_bytes // 4 % count] += 1
        self.flat = np.random.default_rng(seed).standard_normal(int(sizes.sum()), dtype=np.float32)
        self.names = [f"base_model.model.layers.{i}.lora_A.weight" if adapter else f"model.layers.{i}.weight"
                      for i in range(count)]
        self.offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        self.sizes = sizes

    def state_dict(self, keep_vars: bool = True) -> dict[str, np.ndarray]:
        return {name: self.flat[o:o + n] for name, o, n in zip(self.names, self.offsets, self.sizes)}

    def named_parameters(self) -> Iterator[tuple[str, np.ndarray]]:
        return iter(self.state_dict().items())


class SimulatedLearner(Learner):
    """One simulated rank (see the module docstring), started by ``LearnerGroup`` as any backend:
    every method ``LearnerGroup`` calls is its own but ``address``."""

    gathers = False
    device = "cpu"
    simulated = True  # (gdpo_ray.run.validation: its payload needs simulated engines)

    def __init__(self, config: LearnerConfig, rank: int, world_size: int) -> None:
        from gdpo_ray.batch import arrow_without_pandas
        from gdpo_ray.config import FIELDS
        from gdpo_ray.simulation import timing_model

        arrow_without_pandas()
        self.config, self.rank, self.world_size = config, rank, world_size
        settings = {k: f.default for k, f in FIELDS.items() if f.section == "simulation"} | dict(config.simulation or {})
        self.timing, self.time_scale = timing_model(settings["timing"]), float(settings["time_scale"])
        size = settings["weight_bytes"] * (settings["lora_fraction"] if config.lora else 1)
        self.module = self.engine = _Payload(max(4, int(size)), settings["weight_tensors"], bool(config.lora),
                                             config.seed)
        self.sender = WeightSender(self)
        self.step, self.channel = 0, None
        self._pushes, self._digests = 0, {}

    # -- what LearnerGroup calls ------------------------------------------------------------

    def setup(self, master_addr: str, master_port: int) -> None:
        pass  # no process group: nothing is reduced

    def set_threads(self, threads: int, ticket: int) -> None:
        pass  # nothing computes

    def update(self, groups: Sequence[Any], advantages: np.ndarray, threads: int | None = None,
               ticket: int = 0, version: int | None = None) -> dict[str, float]:
        """Sleeps ``TimingModel.update_s`` of the prompt and response tokens of this rank's groups."""
        from gdpo_ray.groups import read_rows

        start = time.perf_counter()
        batches = read_rows(groups)
        rows = sum(b.num_rows for b in batches)
        if rows != len(advantages):
            raise ValueError(f"{len(advantages)} advantages for {rows} rollouts")
        tokens = sum(_values(b.column(c)) for b in batches for c in ("prompt_token_ids", "response_token_ids"))
        modelled = self.timing.update_s(tokens, self.config.epochs)
        time.sleep(modelled * self.time_scale)
        self.step += 1
        self.module.flat[self.module.offsets] = self.step  # every push differs from the last
        zero = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", "grad_norm", "loss_first", "loss_last",
                              "padding_fraction"), 0.0)
        return zero | {"tokens": float(tokens), "modelled_s": modelled, "lr": float(self.config.lr),
                       "time_s": time.perf_counter() - start, "compute_s": modelled * self.time_scale}

    def weight_buckets(self, bucket_bytes: int) -> tuple[list[Any], Any, int] | None:
        """As ``Learner.weight_buckets``: rank 0 puts the payload's buckets into the object store
        (its digests taken at once: ``sent_digests`` returns them)."""
        if self.rank != 0:
            return None
        refs, sent = self.sender.put_buckets(bucket_bytes)
        self._pushes += 1
        self._digests[self._pushes] = self.sender.digests_of(refs)
        for old in [p for p in self._digests if p <= self._pushes - 4]:  # nobody asked for them
            del self._digests[old]
        return refs, sent, self._pushes

    def sent_digests(self, push: int) -> Any:
        return self._digests.pop(push)

    def open_broadcast(self, host: str, port: int, world_size: int) -> str:
        from gdpo_ray.weights.channels import open_channel

        if self.channel is not None:
            self.channel.close()
        self.channel = open_channel(host, port, 0, world_size, "gloo")
        return self.channel.backend

    def broadcast_weights(self, bucket_bytes: int) -> Any:
        return self.channel.send(self.sender, bucket_bytes) if self.rank == 0 else None

    def get_weights(self) -> dict[str, np.ndarray] | None:
        return {n: t.copy() for n, t in self.module.state_dict().items()} if self.rank == 0 else None

    def save_checkpoint(self, path: str) -> None:
        self.save(path, f"step{self.step}", {"step": self.step})

    def load_checkpoint(self, path: str) -> int:
        self.step = self.load(path)["step"]
        return self.step

    def export_hf(self, path: str, merged: str | None = None) -> None:
        """No model to export: rank 0 writes ``simulated.json`` (what the run simulated) instead."""
        if self.rank == 0:
            for target in filter(None, (path, merged)):
                os.makedirs(target, exist_ok=True)
                Path(target, "simulated.json").write_text(json.dumps(
                    {"simulated": True, "timing": self.timing.name, "step": self.step}))

    # -- LearnerBackend: what a model would need -------------------------------------------

    def init_distributed(self) -> None:
        pass

    def wrap(self, model: Any) -> None:
        pass  # there is no model

    def backward(self, loss: Any, last: bool) -> None:
        pass

    def grad_norm(self) -> float:
        return 0.0

    @property
    def param_groups(self) -> list[dict]:
        return [{"lr": self.config.lr, "weight_decay": self.config.weight_decay}]

    @property
    def shares_prompts(self) -> bool:
        return False

    def full_tensors(self, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        return iter(named)

    def flat_weights(self, named: Iterable[tuple[str, Any]]) -> list:
        """The payload's one flat buffer, as bytes, with every tensor's place in it."""
        entries = [(int(o) * 4, name, "float32", (int(n),), int(n) * 4) for name, o, n in
                   zip(self.module.names, self.module.offsets, self.module.sizes)]
        return [(self.module.flat.view(np.uint8), entries)]

    def save(self, path: str, tag: str, state: dict) -> None:
        if self.rank == 0:
            folder = Path(path, tag)
            folder.mkdir(parents=True, exist_ok=True)
            np.save(folder / PAYLOAD, self.module.flat)
            (folder / "state.json").write_text(json.dumps(state))
            Path(path, "latest").write_text(tag)

    def load(self, path: str) -> dict:
        folder = Path(path, Path(path, "latest").read_text().strip())
        self.module.flat[:] = np.load(folder / PAYLOAD)
        return json.loads((folder / "state.json").read_text())

    @staticmethod
    def checkpoint_weights(path: str, model: Any, adapter_only: bool) -> dict[str, Any]:
        raise ValueError(f"{path} is a simulated run's checkpoint: it holds no model to evaluate")


def _values(column: Any) -> int:
    """The number of values of a list column (its tokens), read from its offsets."""
    offsets = column.offsets if hasattr(column, "offsets") else None
    if offsets is None:  # a chunked array
        return sum(_values(chunk) for chunk in column.chunks)
    return int(offsets[-1].as_py()) - int(offsets[0].as_py())
