"""The GDPO policy update of one learner rank, whatever engine trains it (``learners.backend``).

Each learner is one rank of a torch.distributed group (gloo on CPU, NCCL on GPU) whose backend
(DeepSpeed, FSDP2: ``learners.backend.BACKENDS``) holds the model and its AdamW. An update
receives whole groups (never split: ``learners.learner_group.split_groups``) with their
advantages, already computed on the driver over the whole batch, and for each epoch and
mini-batch:
  1. packs rows into micro-batches under a token budget (longest first), the same number of
     micro-batches on every rank (empty ones where a rank has fewer) so that the backends'
     collectives line up;
  2. computes logprobs of the response tokens under logits / temperature (as the rollouts did;
     rows that share a prompt share its forward, ``learners.shared_prompts``), and the policy
     loss of ``gdpo_ray.losses`` normalized by the mini-batch's global token and rollout
     counts, so that the accumulated gradient is exactly the mini-batch's;
  3. takes one optimizer step (the gradient clipped by its global norm, by the backend).
``learners.learner_group.LearnerGroup`` places the learners and fans calls out to them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Sequence

import numpy as np

from gdpo_ray.causal_lm import takes_cache
from gdpo_ray.config import check_value, default
from gdpo_ray.losses import PolicyLossConfig, policy_loss
from gdpo_ray.off_policy import Tally
from gdpo_ray.truncation import Truncation
from gdpo_ray.weights.digest import VARIANTS, warm_host_digest
from learners.backend import LearnerBackend
from learners.response_logprobs import response_logprobs
from learners.packing import packs_exactly
from learners.rows import Row, plan_groups, plan_micro_batches, rows_of
from learners.shared_prompts import distinct_prompts
from learners.thread_dial import ThreadDial
from learners.weight_sender import WeightSender


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """A learner's settings; defaults and rules are those of the config fields of the same names
    (``gdpo_ray.config``; ``epochs`` is RLlib's ``num_epochs``)."""

    model_path: str  # a HF model directory
    model_files: Any = None  # the directory shipped through the object store (gdpo_ray.model_files)
    backend: str = default("backend")  # learners.backend: deepspeed or fsdp2 (learners.backend.BACKENDS)
    zero_stage: int = default("zero_stage")  # DeepSpeed's only
    precision: str = default("precision")  # fp32 or bf16
    lr: float = default("lr")
    weight_decay: float = default("weight_decay")
    grad_clip: float | None = default("grad_clip")
    micro_batch_tokens: int = default("micro_batch_tokens")  # tokens per micro-batch (real ones when packed)
    packing: bool = default("packing")  # rows end to end, no padding (learners/packing.py), where the model takes it
    mini_batches: int = default("mini_batches")  # optimizer steps per epoch over a batch
    epochs: int = default("num_epochs")
    temperature: float = default("temperature")  # logits / T, as in the rollouts
    truncation: Truncation = Truncation()  # the rollouts' truncated sampling (gdpo_ray.truncation.Truncation.of)
    gradient_checkpointing: bool = default("gradient_checkpointing")  # recompute activations in backward
    loss: PolicyLossConfig = PolicyLossConfig()
    seed: int = 0
    num_threads: int = default("num_threads")
    threads_alone: int | None = default("threads_alone")  # lent while no rollout runs (set_threads)
    lora: Any = None  # llm.lora's PEFT settings (gdpo_ray.lora.lora_settings), or None: full weights
    base_model_name: str | None = None  # an exported adapter's base: the hub name, where the model has one
    digest_variants: tuple = VARIANTS  # the engines' possible lower precisions (actors.engines.digest_variants)
    pushes: bool = True  # weights go out to engines (False: an engine shares the module, nothing is digested)
    simulation: Any = None  # section simulation's settings (a simulated learner's timing model and push)

    def __post_init__(self) -> None:
        for name in ("backend", "zero_stage", "lr", "grad_clip", "micro_batch_tokens", "mini_batches",
                     "temperature", "num_threads", "threads_alone"):
            check_value(name, getattr(self, name), f"LearnerConfig.{name}")
        check_value("num_epochs", self.epochs, "LearnerConfig.epochs")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be 'fp32' or 'bf16'; got {self.precision!r}")


def without_dropout(model) -> None:
    """Turns the model's own dropout off (its modules and the attention's functional dropout
    rate): in train mode, which gradient checkpointing and lora_dropout need, a learner's
    logprobs stay those the rollout engines compute."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


class Learner(LearnerBackend):
    """One rank; a backend subclass fills in ``LearnerBackend``'s methods. ``setup`` joins the
    process group and builds the model."""

    def __init__(self, config: LearnerConfig, rank: int, world_size: int) -> None:
        from gdpo_ray.batch import arrow_without_pandas
        from gdpo_ray.model_files import local_dir

        arrow_without_pandas()
        self.config, self.rank, self.world_size = config, rank, world_size
        self.model_path = local_dir(config.model_path, config.model_files)
        self.step = 0
        self._ticket = 0  # the update running (or last run): LearnerGroup's count
        self._lent = (-1, config.num_threads)  # (the update it is for, torch threads) of the last set_threads
        self._version: int | None = None  # the policy version the running update trains

    def address(self) -> tuple[str, int]:
        """This node's address and a free port (asked of rank 0 for the rendezvous)."""
        import ray

        from gdpo_ray.weights.channels import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
        import torch

        cfg = self.config
        torch.set_num_threads(cfg.num_threads)
        os.environ.update(RANK=str(self.rank), LOCAL_RANK="0", WORLD_SIZE=str(self.world_size),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        self.torch = torch
        self.init_distributed()
        from transformers import AutoModelForCausalLM

        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        without_dropout(model)  # the model's own: its logprobs must be the rollouts' (LoRA's stays)
        if cfg.gradient_checkpointing:  # non-reentrant: no input needs requires_grad (frozen embeddings under LoRA)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.lora:  # PEFT's LoRA layers: only the adapter is trained (and has optimizer state)
            from peft import get_peft_model

            from gdpo_ray.lora import peft_config

            model = get_peft_model(model, peft_config(cfg.lora))
        model.train()  # for gradient checkpointing and lora_dropout; old and reference logprobs in eval mode
        self.dial = ThreadDial(cfg.num_threads)  # the cores lent while no rollout runs (set_threads)
        if (cfg.threads_alone or cfg.num_threads) != cfg.num_threads:  # then also within an update
            self.dial.attach(model)
        self.wrap(model)
        self.ref = None
        self._fused: dict[int, bool] = {}  # id(model) -> its logprobs through token_logprobs
        self._tokens: dict[str, int] = {}  # positions the forwards computed, and the real ones among them
        self._packs: dict[int, bool] = {}  # id(model) -> its forward packed (learners/packing.py)
        self.sender = WeightSender(self, adapter_only=bool(cfg.lora), variants=tuple(cfg.digest_variants))
        self.channel = None
        self._digester, self._digesting, self._pushes = None, {}, 0  # weight_buckets' digests, on a thread
        if self.rank == 0 and cfg.pushes:  # the first push need not wait for the compiled digest
            warm_host_digest()
        if cfg.loss.kl_coef > 0 and not cfg.lora:  # the frozen reference policy of the KL term
            # (under LoRA the reference is the same model with its adapter disabled)
            self.ref = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
            self.ref.to(self.device).eval().requires_grad_(False)

    # -- the update -------------------------------------------------------------------------

    def _logprobs(self, model, rows: list[Row], want_entropy: bool = False):
        """[B, R] logprobs of the response tokens, the loss mask, their entropy sum
        (``learners.response_logprobs``)."""
        return response_logprobs(model, rows, device=self.device, temperature=self.config.temperature,
                                 truncation=self.config.truncation, packed=self._packed(model),
                                 shared=self._prompt_sharing(model, rows), fused=self._fused_head(model),
                                 want_entropy=want_entropy, tokens=self._tokens)

    def _packed(self, model) -> bool:
        """Whether ``model``'s forward is packed (``learners/packing.py``: its kind, then a probe,
        once per model; every rank probes at once)."""
        if not self.config.packing:
            return False
        if id(model) not in self._packs:
            with self._inference():
                self._packs[id(model)] = packs_exactly(model, self.device)
        return self._packs[id(model)]

    def _plan(self, rows: list[Row]) -> list[list[int]]:
        """The micro-batches: whole groups under the budget of real tokens where the forward is
        packed, else rows longest first under the budget of padded tokens."""
        if self._packed(self.engine):
            return plan_groups(rows, self.config.micro_batch_tokens)
        return plan_micro_batches([len(r.prompt) + len(r.response) for r in rows], self.config.micro_batch_tokens)

    def _prompt_sharing(self, model, rows: list[Row]) -> tuple[list[np.ndarray], np.ndarray] | None:
        """``distinct_prompts`` of the rows where the forward runs each distinct prompt once
        (``learners/shared_prompts.py``), else None: it does where rows share prompts (a group's
        do), the model takes a cache, no checkpointing turns the cache off, and the backend
        allows it (``shares_prompts``: not where each forward gathers sharded weights with every
        rank, ZeRO-3's or FSDP2's: the ranks' counts of forwards must match, whatever their rows)."""
        if self.config.gradient_checkpointing or not self.shares_prompts or not takes_cache(model):
            return None
        firsts, row_prompt = distinct_prompts([r.prompt for r in rows])
        return (firsts, row_prompt) if len(firsts) < len(rows) else None

    def _fused_head(self, model) -> bool:
        """Whether ``model``'s logprobs go through ``token_logprobs`` (probed once per model)."""
        from learners.token_logprobs import fused_head

        if id(model) not in self._fused:
            with self._inference():
                self._fused[id(model)] = fused_head(model, self.device)
        return self._fused[id(model)]

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        torch = self.torch
        # on this rank's device: the default group on CUDA is NCCL only, which takes no CPU tensor
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op.upper()))
        return t.tolist()

    def set_threads(self, threads: int, ticket: int) -> None:
        """torch threads for update ``ticket`` from its next layer on (sent beside a running
        update, in the actor's ``dial`` concurrency group; one for another update is ignored)."""
        self._lent = (ticket, threads)
        if ticket == self._ticket:
            self.dial.set(threads)

    def update(self, groups: Sequence[Any], advantages: np.ndarray, threads: int | None = None,
               ticket: int = 0, version: int | None = None) -> dict[str, float]:
        """One policy update over this rank's share: whole groups (GroupRefs, read zero-copy
        here) and the advantages of their rows, in order. ``threads``: torch threads to start
        with (default ``num_threads``); ``set_threads(n, ticket)`` turns them while it runs;
        ``version``: the policy version it trains (the off-policy metrics by staleness)."""
        from gdpo_ray.groups import read_rows

        cfg = self.config
        start = time.perf_counter()
        self.dial.set(threads or cfg.num_threads)
        self._ticket = ticket  # then the lent count, if set_threads came first (either order holds)
        lent_for, lent = self._lent
        if lent_for == ticket:
            self.dial.set(lent)
        self.dial.apply()
        turns = self.dial.turns
        rows = rows_of(read_rows(groups), np.asarray(advantages))
        if not rows:
            raise ValueError(f"learner {self.rank} received no rollouts: give every learner a group")
        compute_start = time.perf_counter()
        fresh = cfg.epochs == 1 and cfg.mini_batches == 1  # old policy = current: no extra pass
        old = None if fresh else self._old_logprobs(rows)
        rng = np.random.default_rng([cfg.seed, self.step])  # the same mini-batch split on every rank
        history, tally = [], Tally()
        self._tokens = {}
        self._version = version
        for _ in range(cfg.epochs):
            for mb in np.array_split(rng.permutation(len(rows)), cfg.mini_batches):
                history.append(self._mini_batch([rows[i] for i in mb],
                                                None if old is None else [old[i] for i in mb], tally))
        self.step += 1
        threads_end, turns = self.dial.applied, self.dial.turns - turns
        self.dial.set(cfg.num_threads)  # the lent cores back before generation resumes beside it
        self.dial.apply()
        out = {k: float(np.mean([h[k] for h in history])) for k in history[0]}
        out.update(self._gathered(tally).metrics())
        computed = self._tokens.get("computed", 0)  # this update's forwards (old logprobs included)
        out["padding_fraction"] = (computed - self._tokens.get("real", 0)) / computed if computed else 0.0
        out.update(loss_first=history[0]["loss"], loss_last=history[-1]["loss"], threads_end=float(threads_end),
                   thread_turns=float(turns), lr=float(self.param_groups[0]["lr"]),
                   time_s=time.perf_counter() - start,
                   compute_s=time.perf_counter() - compute_start)  # forward, backward, step
        return out

    def _old_logprobs(self, rows: list[Row]) -> list[np.ndarray]:
        """Logprobs under the policy at the start of the update (the PPO "old" policy)."""
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(rows)
        plan = self._plan(rows)
        n_micro = int(self._all_reduce([len(plan)], "max")[0])  # sharded weights: gathered in every forward
        with self._inference():
            for m in range(n_micro):
                mb = plan[m] if m < len(plan) else [0]
                lp, _, _ = self._logprobs(self.engine, [rows[i] for i in mb])
                if m < len(plan):
                    for j, i in enumerate(mb):
                        out[i] = lp[j, :len(rows[i].response)].cpu().numpy()
        return out

    @contextlib.contextmanager
    def _inference(self):
        """No gradient, and eval mode: the adapters' dropout off, as the policy samples."""
        training = self.engine.training
        self.engine.eval()
        try:
            with self.torch.no_grad():
                yield
        finally:
            self.engine.train(training)

    def _reference_logprobs(self, rows: list[Row]):
        """Logprobs under the reference policy of the KL term: the initial model, or under
        LoRA the model with its adapter disabled (the base model, no second copy)."""
        with self._inference():
            if self.ref is not None:
                return self._logprobs(self.ref, rows)[0]
            with self.module.disable_adapter() if self.config.lora else contextlib.nullcontext():
                return self._logprobs(self.engine, rows)[0]

    def _padded(self, values: Sequence[np.ndarray], width: int):
        out = np.zeros((len(values), width), np.float32)  # a copy: v may be a read-only Arrow view
        for i, v in enumerate(values):
            out[i, :len(v)] = v
        return self.torch.from_numpy(out).to(self.device)

    def _gathered(self, tally: Tally) -> Tally:
        """Every rank's off-policy tally merged (each rank's on all: one small gather per update)."""
        if self.world_size == 1:
            return tally
        parts: list[Any] = [None] * self.world_size
        self.torch.distributed.all_gather_object(parts, (tally.sums, tally.extremes))
        merged = Tally()
        for sums, extremes in parts:
            part = Tally()
            part.sums, part.extremes = sums, extremes
            merged.merge(part)
        return merged

    def _staleness(self, rows: list[Row], width: int):
        """[B, width] per token: the update's version minus the one that sampled it (None where
        the version is not known)."""
        if self._version is None:
            return None
        out = np.zeros((len(rows), width), np.int64)
        for i, r in enumerate(rows):
            if r.versions is not None:
                out[i, :len(r.versions)] = self._version - r.versions
        return self.torch.from_numpy(out).to(self.device)

    def _mini_batch(self, rows: list[Row], old: list[np.ndarray] | None, tally: Tally) -> dict[str, float]:
        torch, cfg = self.torch, self.config
        plan = self._plan(rows)
        tokens, seqs = self._all_reduce([sum(r.sampled_tokens() for r in rows), len(rows)])
        n_micro = int(self._all_reduce([len(plan)], "max")[0])
        # the backends average gradients over ranks: normalize by the global counts / world size
        norm_tokens, norm_seqs = tokens / self.world_size, seqs / self.world_size
        loss_sum = pg_sum = kl_sum = weight = entropy = 0.0
        weighted: dict[str, float] = {}
        for m in range(n_micro):
            real = m < len(plan)
            idx = plan[m] if real else [0]  # an empty micro-batch keeps the collectives in step
            part = [rows[i] for i in idx]
            logp, mask, ent = self._logprobs(self.engine, part, want_entropy=real)
            old_t = logp.detach() if old is None else self._padded([old[i] for i in idx], logp.shape[1])
            ref = None
            if cfg.loss.kl_coef > 0:
                ref = self._reference_logprobs(part)
            adv = torch.tensor([r.advantage for r in part], dtype=torch.float32, device=self.device)
            loss, metrics = policy_loss(
                logp, old_t, adv, mask, cfg.loss,
                rollout_logprobs=self._padded([r.rollout_logprobs for r in part], logp.shape[1]),
                ref_logprobs=ref, num_tokens=norm_tokens, num_sequences=norm_seqs,
                staleness=self._staleness(part, logp.shape[1]) if real else None,
                tally=tally if real else Tally())
            self.backward(loss if real else loss * 0.0, last=m == n_micro - 1)
            if real:
                loss_sum += metrics.pop("loss")
                pg_sum += metrics.pop("pg_loss")
                kl_sum += metrics.pop("kl", 0.0)
                w = metrics.pop("tokens")
                for k, v in metrics.items():
                    weighted[k] = weighted.get(k, 0.0) + v * w
                weight += w
                entropy += float(ent)
        # each rank's sums are its share of the global mean, times world_size
        total_loss, total_pg, total_kl, total_entropy = self._all_reduce([loss_sum, pg_sum, kl_sum, entropy])
        out = {k: v / max(weight, 1.0) for k, v in weighted.items()}  # this rank's token means
        out.update(loss=total_loss / self.world_size, pg_loss=total_pg / self.world_size,
                   kl=total_kl / self.world_size, entropy=total_entropy / max(tokens, 1.0),
                   grad_norm=self.grad_norm(), tokens=tokens)
        return out

    # -- weights, checkpoints ----------------------------------------------------------------

    def weight_buckets(self, bucket_bytes: int) -> tuple[list[Any], Any, int] | None:
        """Rank 0: (ObjectRefs of the weight buckets, what was sent but the digests:
        ``digest.Sent``, this push's number), the digests being taken meanwhile on a thread from
        the written copies (``sent_digests(number)``); None elsewhere. Every rank must call it
        (sharded weights are gathered one at a time)."""
        if self.rank != 0:
            self.sender.take_part()
            return None
        for earlier in list(self._digesting.values()):  # one push's copies digested at a time: its
            earlier.exception()  # buckets leave the store before the next ones come (errors kept)
        refs, sent = self.sender.put_buckets(bucket_bytes)
        if self._digester is None:
            from concurrent.futures import ThreadPoolExecutor

            self._digester = ThreadPoolExecutor(1, thread_name_prefix="weight-digests")
        self._pushes += 1
        self._digesting[self._pushes] = self._digester.submit(self.sender.digests_of, refs)
        for old in [p for p in list(self._digesting) if p <= self._pushes - 4]:  # nobody asked for them
            self._digesting.pop(old, None)  # (sent_digests pops the others, on its own thread)
        return refs, sent, self._pushes

    def sent_digests(self, push: int) -> Any:
        """The full record (``digest.Sent``) of ``weight_buckets``' call number ``push``, once
        its digests are taken. Called in the concurrency group "digest": it runs beside the
        next update (the copies digested are the store's, which nothing writes)."""
        return self._digesting.pop(push).result()  # (dict operations are atomic: no lock)

    def open_broadcast(self, host: str, port: int, world_size: int) -> str:
        """Rank 0 joins a weight broadcast group as its root (with the rollout actors),
        proposing NCCL on CUDA and gloo on CPU; returns the backend the group agreed on
        (``gdpo_ray.weights.channels``)."""
        from gdpo_ray.weights.channels import open_channel

        if self.channel is not None:
            self.channel.close()
        self.channel = open_channel(host, port, 0, world_size,
                                    "nccl" if self.device.type == "cuda" else "gloo")
        return self.channel.backend

    def broadcast_weights(self, bucket_bytes: int) -> Any:
        """Rank 0 sends the weights over its broadcast channel (every rank takes part in the
        gathers of sharded weights); returns what was sent (``digest.Sent``) on rank 0, None elsewhere."""
        if self.rank != 0:
            self.sender.take_part()
            return None
        return self.channel.send(self.sender, bucket_bytes)

    def get_weights(self) -> dict[str, np.ndarray] | None:
        """Full weights on rank 0 (None elsewhere); every rank must call it."""
        out = {name: t.numpy().copy() for name, t in self.sender.host_tensors()}
        return out if self.rank == 0 else None

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, RNG and step; under LoRA the adapter (the frozen base weights are
        the model's own files) and its optimizer state."""
        state = {"step": self.step, "torch_rng": self.torch.get_rng_state().tolist()}
        self.save(path, f"step{self.step}", state)

    def load_checkpoint(self, path: str) -> int:
        torch = self.torch
        state = self.load(path)
        self.step = state["step"]
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        for group in self.param_groups:  # this run's settings, not the saved ones
            group["lr"], group["weight_decay"] = self.config.lr, self.config.weight_decay
        return self.step

    def export_hf(self, path: str, merged: str | None = None) -> None:
        """The current policy as a HF model directory (rank 0 writes; all ranks must call).
        Under LoRA ``path`` is a PEFT adapter directory (``adapter_config.json`` naming the base
        model: ``PeftModel.from_pretrained(base, path)``) and ``merged``, when given, the
        adapter merged into the base model as a plain HF model directory."""
        weights = dict(self.sender.host_tensors())
        if self.rank != 0:
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from gdpo_ray.model_files import saved_dtype

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        dtype = getattr(self.torch, saved_dtype(self.model_path))  # the base model's: bf16 stays bf16
        if not self.config.lora:
            model.load_state_dict(weights, strict=False)
            model.to(dtype).save_pretrained(path)
            tokenizer.save_pretrained(path)
            return
        from peft import get_peft_model, set_peft_model_state_dict

        from gdpo_ray.lora import peft_config

        model = get_peft_model(model, peft_config(self.config.lora))
        # get_peft_model names this learner's copy of the model; the adapter names the model's hub
        # name where it has one (gdpo_ray.model_files.hub_name), else the driver's path
        model.peft_config["default"].base_model_name_or_path = (
            self.config.base_model_name or str(self.config.model_path))
        result = set_peft_model_state_dict(model, weights)
        if getattr(result, "unexpected_keys", None):
            raise RuntimeError(f"adapter tensors PEFT does not know: {result.unexpected_keys[:3]}")
        model.save_pretrained(path)
        if merged:
            model.merge_and_unload().to(dtype).save_pretrained(merged)
            tokenizer.save_pretrained(merged)
