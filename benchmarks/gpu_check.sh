#!/usr/bin/env sh
# Every gpu-marked test and the GPU variants of the benchmarks, in one go (under 10 minutes on
# one GPU), printing their figures. Three ways to run it:
#
#   sh benchmarks/gpu_check.sh fetch   here, with network and no GPU: fills .venv-gpu/wheels
#       (gitignored, about 35 MB) with what the lent device machine lacks.
#   sh benchmarks/gpu_check.sh         on the lent device machine (one H200, NO network, 64 MiB
#       carried at most; its image's python3 has torch 2.11+cu130, transformers, pyarrow and
#       pytest): call it with carry [".venv-gpu/wheels"]. It installs the carried set into that
#       python3 (the machine starts bare and is given back) and runs tests/gpu and the benchmarks.
#       Ray's 79 MB wheel does not fit: it travels as a tar.xz without its Java jars and the
#       dashboard's web build. DeepSpeed has no wheel on PyPI: fetch builds a pure-Python one.
#       Not there: vLLM (0.34.0's wheel is 239 MB and pins torch==2.14.0), so its tests skip;
#       NCCL between two processes on the one GPU needs NCCL >= 2.30 (torch 2.11 pins
#       nvidia-nccl-cu13 2.28.9), so unless the image's NCCL is newer the broadcast tests skip
#       and weight_sync reports nccl_skipped. The first lines printed say which.
#   sh benchmarks/gpu_check.sh         on a GPU machine with network and no .venv-gpu/wheels:
#       installs '.[test,gpu]' (official vLLM and the torch it pins) into .venv-gpu and runs
#       every gpu- and vllm-marked test.
set -eu
cd "$(dirname "$0")/.."
W=.venv-gpu/wheels
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ "${1:-}" = fetch ]; then
    HERE=python3
    [ -x .venv/bin/python ] && HERE=.venv/bin/python  # the CI set: its torch builds DeepSpeed
    version() { $HERE -c "import importlib.metadata as m; print('==' + m.version('$1'))" 2>/dev/null || true; }
    TARGET="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    tmp=$(mktemp -d)
    rm -rf "$W" && mkdir -p "$W"
    # what the image lacks, with the dependencies of it and of Ray, DeepSpeed (one version each)
    # shellcheck disable=SC2086
    $HERE -m pip download -q $TARGET -d "$W" "pydantic$(version pydantic)" "jsonschema$(version jsonschema)" \
        "hjson$(version hjson)" "dill$(version dill)" click filelock msgpack packaging protobuf pyyaml \
        requests einops ninja psutil py-cpuinfo tqdm
    DS_BUILD_OPS=0 $HERE -m pip wheel -q --no-deps --no-build-isolation -w "$W" "deepspeed$(version deepspeed)"
    # shellcheck disable=SC2086
    $HERE -m pip download -q --no-deps $TARGET -d "$tmp" "ray$(version ray)"
    mkdir "$tmp/ray" && (cd "$tmp/ray" && unzip -q ../ray-*.whl && rm -rf ray/jars ray/dashboard/client/build)
    tar -C "$tmp/ray" -cf - . | xz -T0 -9 > "$W/ray.tar.xz"
    rm -rf "$tmp"
    ls "$W"
    size=$(du -sm "$W" | cut -f1)
    echo "$W: $size MB (with the working tree it must stay under 64 MiB)"
    [ "$size" -lt 60 ] || { echo "too large to carry"; exit 1; }
    exit 0
fi

if [ -d "$W" ]; then  # the lent device machine: no network, the carried set
    PY=python3
    site=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "installing the carried set into $PY ($site)"
    $PY - "$W/ray.tar.xz" "$site" <<'EOF'
import sys
import tarfile

with tarfile.open(sys.argv[1]) as archive:
    archive.extractall(sys.argv[2], filter="tar")  # keeps the executable bits of Ray's binaries
EOF
    $PY -m pip install -q --no-index --no-compile --find-links "$W" deepspeed pydantic jsonschema hjson \
        dill click filelock msgpack packaging protobuf pyyaml requests
    export PYTHONPATH="$PWD"
    set -- tests/gpu  # the rest of tests/ needs packages that are not carried (and none a GPU)
else
    python3 -m venv .venv-gpu
    .venv-gpu/bin/pip install -q -e '.[test,gpu]'
    PY=.venv-gpu/bin/python
    set -- -m "gpu or vllm" tests
fi

$PY - <<'EOF'
import importlib.util

import torch

nccl = torch.cuda.nccl.version()
print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
      f"NCCL {'.'.join(map(str, nccl[:3]))}: two ranks on one GPU "
      f"{'allowed (NCCL_MULTI_RANK_GPU_ENABLE)' if tuple(nccl[:2]) >= (2, 30) else 'refused (< 2.30)'}; "
      f"vllm {'installed' if importlib.util.find_spec('vllm') else 'not installed'}")
EOF

failed=""
step() {  # name, seconds, command...: runs on after a failure; the summary names the failures
    name=$1 limit=$2
    shift 2
    echo "== $name"
    if ! timeout -k 10 "$limit" "$@"; then
        failed="$failed $name"
        # a step killed at its limit leaves its Ray cluster (and GPU memory) behind
        $PY -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true
    fi
}
step tests 240 $PY -m pytest "$@" -q -p no:cacheprovider
step rollout 60 $PY benchmarks/rollout.py --json --device cuda  # hf (and vllm where installed)
step learner 100 $PY benchmarks/learner.py --json --gpus 0.5  # DeepSpeed (NCCL) and plain torch
step advantages 40 $PY benchmarks/advantages.py --json
step weight_sync 120 $PY benchmarks/weight_sync.py --json --device cuda  # NCCL broadcast to hf engines
if [ -n "$failed" ]; then
    echo "FAILED:$failed"
    exit 1
fi
echo "all GPU checks passed"
