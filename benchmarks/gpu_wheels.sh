#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels `benchmarks/gpu.sh` installs on a GPU machine that has none:
# what gptlab needs beyond a CUDA image's usual torch/transformers/tokenizers/safetensors (the server's fastapi and
# uvicorn with their dependencies), at the versions this checkout's constraints pin. Into .whl/ (git-ignored).
#
#   benchmarks/gpu_wheels.sh [PYTHON_VERSION]      # default 3.12: the GPU machine's Python, not this one's
# Versions are those installed in $PYTHON (default .venv/bin/python, the README's set-up), else the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
mkdir -p .whl
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
pinned() { "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p' || true; }
for name in fastapi starlette pydantic pydantic_core uvicorn annotated-types typing-inspection opentelemetry-api; do
    version=$(pinned "$name")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$name${version:+==$version}"
done
ls .whl
