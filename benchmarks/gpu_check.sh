#!/usr/bin/env sh
# On a machine with one CUDA GPU: every gpu-marked test and the GPU variants of the benchmarks,
# in one go (under 10 minutes), printing their figures. Installs the GPU set (official vLLM and
# the torch it pins) into .venv-gpu; CPU machines never run this.
set -eu
cd "$(dirname "$0")/.."
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install -q -e '.[test,gpu]'
PY=.venv-gpu/bin/python
$PY -m pytest -m "gpu or vllm" tests -q -p no:cacheprovider
echo "rollout (hf and vllm on the GPU):"; $PY benchmarks/rollout.py --json --device cuda
echo "learner (DeepSpeed with NCCL over plain torch, on the GPU):"; $PY benchmarks/learner.py --json --gpus 1
echo "advantages:"; $PY benchmarks/advantages.py --json
echo "weight sync (NCCL broadcast, learner and hf engines on the GPU):"; $PY benchmarks/weight_sync.py --json --device cuda
