#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU and no network: install gptlab from this checkout (and the wheels
# brought along in .whl/, if any, for what the machine's Python lacks: the server's fastapi/uvicorn, fetched
# beforehand by benchmarks/gpu_wheels.sh), run the CUDA tests, then time training against nanoGPT's model and
# decoding against transformers (benchmarks/gpu.py). nanoGPT's checkout comes along too (its model.py is the peer).
#
#   benchmarks/gpu.sh [NANOGPT_CHECKOUT] [LOG_DIR]     # defaults: .gpu/nanogpt, ./gpu-logs
#
# Each stage has its own time limit and log; a failing stage is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
NANOGPT=${1:-.gpu/nanogpt}
LOGS=${2:-gpu-logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false GPTLAB_NO_KERNELS=1
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$LOGS/gpu.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gptlab-site .whl/*.whl \
        && export PYTHONPATH=/tmp/gptlab-site${PYTHONPATH:+:$PYTHONPATH}
fi
# the project itself, from these files: editable and without its dependencies (the machine's torch stays)
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$LOGS/install.txt" 2>&1 \
    || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import torch, gptlab; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$LOGS/$name.txt" 2>&1
    local rc=$?
    tail -n 40 "$LOGS/$name.txt"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}
stage tests "${TESTS_LIMIT:-200}" $PY -m pytest -m cuda -p no:cacheprovider -q -rs tests/test_cuda.py --durations=5
stage train "${TRAIN_LIMIT:-240}" $PY benchmarks/gpu.py train --nanogpt "$NANOGPT" ${TRAIN_ARGS:-}
stage decode "${DECODE_LIMIT:-180}" $PY benchmarks/gpu.py decode ${DECODE_ARGS:-}
