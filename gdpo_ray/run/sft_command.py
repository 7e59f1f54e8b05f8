"""``gdpo-ray sft``: supervised fine-tuning on demonstrations (``gdpo_ray.sft``), the first stage
before GDPO, writing a model directory that ``llm.model_path`` takes."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DESCRIPTION = """\
Fine-tune MODEL (a model directory, a hub name in the local cache, or a built-in model: smollm2,
demo, ...) on demonstrations, tokenized exactly as the multi-turn rollouts tokenize (the same
chat template, system prompt and tools; tool turns out of the loss). --data takes TRL's SFT
layouts (jsonl/json/parquet): conversational 'messages' (assistant 'tool_calls', 'tool' turns,
an optional 'tools' column) or 'prompt'/'completion'; or task:<name> (task:tool_arithmetic_demos).
--config takes the system prompt, tool environment and tools_in_system_prompt of the training
config that follows, so the model is trained on the prompts it will see. Writes the model and
its tokenizer to --output (default sft/<model>-<time>/), with sft.json (settings, counts, losses)
and sft_log.jsonl (one line per step); then: gdpo-ray train CONFIG llm.model_path=<that dir>."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("sft", help="supervised fine-tuning on demonstrations (before GDPO)",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model directory, hub name or built-in model (smollm2, demo, ...)")
    p.add_argument("--data", required=True, help="demonstrations: a jsonl/json/parquet file or task:<name>")
    p.add_argument("--output", help="where the model goes (default sft/<model>-<time>/)")
    p.add_argument("--config", help="a training preset or YAML (and its run directory's config.yaml): its "
                   "data.system_prompt, data.tool_environment and data.tools_in_system_prompt")
    p.add_argument("--system-prompt", help="a system message before every prompt without one")
    p.add_argument("--environment", metavar="MODULE:CLASS", help="the tool environment whose tools the "
                   "prompts show (rows without a 'tools' column)")
    p.add_argument("--tools-in-system-prompt", choices=["auto", "always", "never"],
                   help="where the tools are shown (default auto, or the config's)")
    p.add_argument("--lora", metavar="YAML", help="LoRA settings as llm.lora takes them, e.g. '{r: 8, "
                   "lora_alpha: 16}': the adapter is trained, then merged into the written model")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW's learning rate, constant (default 1e-5)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, help="stop after this many steps")
    p.add_argument("--max-length", type=int, default=2048, help="longer examples (tokens) are left out, "
                   "counted (default 2048)")
    p.add_argument("--limit", type=int, help="the first N rows of --data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.set_defaults(run=run)


def _settings(args: argparse.Namespace) -> dict:
    """The system prompt, environment and tools_in_system_prompt: the command line's, else the
    config's, else none / auto."""
    out = {"system_prompt": None, "tool_environment": None, "tools_in_system_prompt": "auto"}
    if args.config:
        from gdpo_ray.run.algorithm import GDPOConfig
        from gdpo_ray.run.eval_rewards import config_path
        from gdpo_ray.run.presets import apply_sections, load_preset

        source = config_path(args.config, None) if Path(args.config).is_dir() else args.config
        c = apply_sections(GDPOConfig(), load_preset(source))
        out = {k: getattr(c, k) for k in out}
    given = {"system_prompt": args.system_prompt, "tool_environment": args.environment,
             "tools_in_system_prompt": args.tools_in_system_prompt}
    return out | {k: v for k, v in given.items() if v is not None}


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as err:
        print(f"gdpo-ray sft: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import torch
    import yaml
    from transformers import AutoTokenizer

    from gdpo_ray import sft
    from gdpo_ray.environments.tool_prompt import check_mode, in_system
    from gdpo_ray.lora import lora_settings
    from gdpo_ray.model_files import resolve_model_path
    from gdpo_ray.run.preflight import check_model

    for name in ("epochs", "batch_size", "max_length", "num_threads", "max_steps", "limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0; got {args.lr}")
    lora = lora_settings(yaml.safe_load(args.lora)) if args.lora else None
    settings = _settings(args)
    check_mode(settings["tools_in_system_prompt"])
    check_model(args.model)
    torch.set_num_threads(args.num_threads)
    model_dir = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools, shown = [], False
    if settings["tool_environment"] is not None:
        from gdpo_ray.environments.spec import environment_paths, load_environment

        paths = environment_paths(settings["tool_environment"])
        tools = {name: list(load_environment(path).schemas) for name, path in paths.items()}
        tools = tools[None] if None in tools else tools  # TRL's dict form: per the row's class
    shown = in_system(settings["tools_in_system_prompt"], tokenizer)
    rows = args.data
    if args.data.startswith("task:"):
        from gdpo_ray.tasks import TASKS

        rows = TASKS.get(args.data.removeprefix("task:"))()  # the task's own size and seed
    if args.limit is not None:
        from gdpo_ray.data import read_dataset

        rows = read_dataset(rows).rows[:args.limit]
    examples, too_long = sft.read_examples(rows, sft.Tokenizer(tokenizer, settings["system_prompt"], tools, shown),
                                           args.max_length)
    output = Path(args.output or Path("sft") / f"{Path(str(args.model)).name}-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"gdpo-ray sft: {len(examples)} examples from {args.data}"
          + (f" ({too_long} longer than --max-length {args.max_length} left out)" if too_long else "")
          + (", the tools in the system message" if tools and shown else ""), flush=True)
    output.mkdir(parents=True, exist_ok=True)
    losses = []
    with open(output / "sft_log.jsonl", "w") as log:
        def record(line: dict) -> None:
            losses.append(line["loss"])
            log.write(json.dumps(line) + "\n")
            log.flush()

        sft.train(model_dir, examples, output, lora=lora, epochs=args.epochs, lr=args.lr,
                  batch_size=args.batch_size, max_steps=args.max_steps, seed=args.seed, log=record)
    summary = {"model": str(args.model), "data": args.data, "examples": len(examples), "left_out_too_long": too_long,
               "steps": len(losses), "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "lora": lora, "epochs": args.epochs, "lr": args.lr,
               "batch_size": args.batch_size, **settings}
    (output / "sft.json").write_text(json.dumps(summary, indent=1) + "\n")
    def shown(loss: float | None) -> str:
        return "n/a" if loss is None else f"{loss:.4f}"

    print(f"gdpo-ray sft: loss {shown(summary['first_loss'])} -> {shown(summary['last_loss'])} "
          f"over {len(losses)} steps")
    print(f"gdpo-ray sft: model {output} (train on it: gdpo-ray train CONFIG llm.model_path={output})")
    return 0
