"""Learner throughput: tokens/s through DeepSpeedLearner over a plain torch loop, packed rows
against padded ones, and the padding of real jobs.

1. The same update on the same model and batch in the same kind of process (a Ray actor with
   one torch thread): logprobs of the responses under logits / T, the GDPO policy loss over
   token-budget micro-batches, one AdamW step. The plain loop has no DeepSpeed engine, no
   process group and no metrics; the learner runs it padded as the loop does
   (``training.packing: false``), then packed (``learners/packing.py``). Keys:
   ``deepspeed_over_torch`` (aim >= 0.8), ``packed_over_padded`` (tokens/s, packed over padded).
2. ``--jobs demo smollm2``: a few steps of each job (vs_trl.py's: the demo preset; SmolLM2-135M
   on smollm2_math's job), packed and padded, means over the steps after the first:
   ``padding_fraction_<job>`` (padded positions over
   all the learner computed, its forwards of old logprobs included; aim <= 0.1),
   ``padding_fraction_<job>_padded``, ``update_s_<job>_packed_over_padded``.

    python benchmarks/learner.py [--json] [--groups 8] [--group-size 8] [--zero-stage 2] [--gpus 0.5]
        [--jobs demo smollm2] [--job-steps 4] [--smoke]

``--smoke``: 2 groups of 2, one timed update each; the demo job, one step of 2 prompts x 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._smoke import parse_args  # noqa: E402


class PlainTorch:
    """The same update written directly in torch."""

    def __init__(self, model_path: str, budget: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.torch, self.budget = torch, budget
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6)

    def update(self, groups, advantages) -> float:
        from gdpo_ray.groups import read_groups
        from gdpo_ray.losses import PolicyLossConfig, policy_loss
        from learners.rows import plan_micro_batches, rows_of

        torch = self.torch
        start = time.perf_counter()
        rows = rows_of(read_groups(groups), np.asarray(advantages))
        tokens = sum(len(r.response) for r in rows)
        for mb in plan_micro_batches([len(r.prompt) + len(r.response) for r in rows], self.budget):
            part = [rows[i] for i in mb]
            width = max(len(r.prompt) + len(r.response) for r in part)
            rlen = max(len(r.response) for r in part)
            ids = torch.zeros((len(part), width), dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, r in enumerate(part):
                seq = np.concatenate([r.prompt, r.response])
                ids[i, :len(seq)], attn[i, :len(seq)] = torch.from_numpy(seq), 1
            ids, attn = ids.to(self.device), attn.to(self.device)
            logits = self.model(input_ids=ids, attention_mask=attn).logits.float()
            logp = torch.zeros((len(part), rlen), device=self.device)
            mask = torch.zeros((len(part), rlen), dtype=torch.bool, device=self.device)
            for i, r in enumerate(part):
                p, n = len(r.prompt), len(r.response)
                logp[i, :n] = torch.log_softmax(logits[i, p - 1:p - 1 + n], -1).gather(
                    1, ids[i, p:p + n, None])[:, 0]
                mask[i, :n] = True
            adv = torch.tensor([r.advantage for r in part], device=self.device)
            loss, _ = policy_loss(logp, logp.detach(), adv, mask, PolicyLossConfig(), num_tokens=tokens,
                                  num_sequences=len(rows))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpus", type=float, default=0,
                        help="the GPU variant: each side's share of a GPU (both actors live at once, "
                             "so 0.5 on a one-GPU machine; 1 needs two GPUs)")
    parser.add_argument("--jobs", nargs="*", default=["demo", "smollm2"], choices=["demo", "smollm2"])
    parser.add_argument("--job-steps", type=int, default=4, help="steps per job and side (the first not counted)")
    args = parse_args(parser, {"groups": 2, "group_size": 2, "repeats": 1, "jobs": ["demo"], "job_steps": 1})

    import ray

    from gdpo_ray.groups import GroupRef
    from gdpo_ray.batch import GroupData, build_groups, group_bounds
    from gdpo_ray.models.tiny import build_tiny_model
    from learners.deepspeed_learner import LearnerConfig
    from learners.learner_group import LearnerGroup

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "m", hidden_size=256, layers=4))
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
        groups = []
        for p in range(args.groups):
            responses = [rng.integers(3, 300, rng.integers(64, 256)).tolist() for _ in range(args.group_size)]
            groups.append(GroupData(
                prompt_id=str(p), group_id=f"{p}/e0/a0", prompt_token_ids=list(range(1, 33)),
                response_token_ids=responses, response_logprobs=[[-5.0] * len(r) for r in responses],
                finish_reasons=["stop"] * args.group_size, policy_version=0,
                rewards=np.zeros((args.group_size, 1)), reward_errors=[[""]] * args.group_size))
        batch = build_groups(groups, ["r"])
        ref = ray.put(batch)
        refs = [GroupRef(ref, a, b, g, 0) for g, a, b in group_bounds(batch)]
        adv = rng.standard_normal(batch.num_rows).astype(np.float32)
        tokens = int(batch.column("response_length").to_numpy().sum())
        sides = {packing: LearnerGroup(LearnerConfig(model_path=model, zero_stage=args.zero_stage, packing=packing,
                                                     micro_batch_tokens=4096), num_learners=1,
                                       num_gpus_per_learner=args.gpus) for packing in (False, True)}
        plain = ray.remote(PlainTorch).options(num_cpus=1, num_gpus=args.gpus).remote(model, 4096)
        for group in sides.values():  # warm up every side
            group.update(refs, adv)
        ray.get(plain.update.remote(refs, adv))
        times: dict = {False: [], True: [], "torch": []}
        for _ in range(args.repeats):  # alternating, so that a slow moment costs every side alike
            for packing, group in sides.items():
                times[packing].append(group.update(refs, adv)["time_s"])
            times["torch"].append(ray.get(plain.update.remote(refs, adv)))
        for group in sides.values():
            group.shutdown()
        ray.shutdown()
    ds_tps, torch_tps, packed_tps = (tokens / min(times[k]) for k in (False, "torch", True))
    results = {"tokens": tokens, "deepspeed_tokens_per_s": ds_tps, "torch_tokens_per_s": torch_tps,
               "deepspeed_over_torch": ds_tps / torch_tps, "packed_tokens_per_s": packed_tps,
               "packed_over_padded": packed_tps / ds_tps}
    for job in args.jobs:
        results |= job_padding(job, args.job_steps, args.smoke)
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in results.items()} | {"smoke": args.smoke}))
        return
    print(f"Update of {args.groups} groups x {args.group_size} ({tokens} response tokens), "
          f"ZeRO-{args.zero_stage}, best of {args.repeats}:")
    print(f"  DeepSpeedLearner {ds_tps:8.0f} tok/s   plain torch {torch_tps:8.0f} tok/s   -> "
          f"{results['deepspeed_over_torch']:.2f} (aim >= 0.8)")
    print(f"  packed           {packed_tps:8.0f} tok/s   -> {results['packed_over_padded']:.2f} of padded")
    for job in args.jobs:
        print(f"  {job}: padding {results[f'padding_fraction_{job}']:.3f} packed (aim <= 0.1), "
              f"{results[f'padding_fraction_{job}_padded']:.3f} padded; update time packed / padded "
              f"{results[f'update_s_{job}_packed_over_padded']:.2f}")


def job_padding(job: str, steps: int, smoke: bool) -> dict:
    """A few steps of vs_trl.py's ``job``, packed and padded: the learners' padding fraction and
    update seconds (means over the steps)."""
    from benchmarks.vs_trl import JOBS
    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    preset, overrides, _, _ = JOBS[job]
    small = ["training.prompts_per_step=2", "training.group_size=2"] if smoke else []
    out = {}
    for packing in (True, False):
        config = apply_sections(GDPOConfig(), load_preset(preset, [*overrides, *small,
                                                                   f"training.packing={str(packing).lower()}"]))
        algo = config.build_algo()
        try:
            rows = [algo.train() for _ in range(steps)]
        finally:
            algo.stop()
        suffix, steady = "" if packing else "_padded", rows[1:] or rows  # (the first step warms up)
        out[f"padding_fraction_{job}{suffix}"] = float(np.mean([r["learner/padding_fraction"] for r in steady]))
        out[f"update_s_{job}{suffix}"] = float(np.mean([r["timing/update_s"] for r in steady]))
    out[f"update_s_{job}_packed_over_padded"] = out[f"update_s_{job}"] / out[f"update_s_{job}_padded"]
    return out


if __name__ == "__main__":
    main()
