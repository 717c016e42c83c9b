#!/bin/bash
# What one SGLang EAGLE-3 step costs against one plain decode step, by chain length, on a 135M target:
# why SGLang's speculative decoding of SmolLM2-135M is slower than plain decoding even with a drafter
# that accepts ~2.1 tokens a step (issue "A drafter that pays").
#
# Each config is its own server launch (SGLang 0.5.17, the flags of profiles/h200-embedded.json's sglang
# engine, the shipped warm-started drafter), 3 warm-up requests, then 20 MT-bench first turns as raw text
# (no chat template: this measures step cost, not the gated acceptance), 96 greedy tokens each with
# ignore_eos, one at a time. ms_per_step = client wall time / verify steps (spec_verify_ct; plain: output
# tokens), so it includes each request's prefill and HTTP round trip (~1/96 of a request's steps).
# A plain launch is repeated (plain2): between launches plain decode moved by 20% on one H100
# (issue 28's launch effect), which bounds what one launch per config can tell.
#
# On a lease after the sglang and model wheelhouses are installed (scripts/h200_engine_ab.sh) and a
# suite run has converted the model and installed the bundle into /tmp/kcache:
#   CONFIGS="plain steps1 steps3 steps3-nooverlap steps5 plain2 steps7" bash benchmarks/sglang_spec_cost.sh
# Results: one JSON line per config in $OUT/steps.jsonl; the H100 run of 2026-12-07 (two device calls,
# the first four configs, then the last three) is benchmarks/sglang-spec-cost/h100-20261207.jsonl.
set -u
OUT=${OUT:?set OUT to a results folder}
M=${MODEL:-/tmp/kcache/models/smollm2-135m-instruct-b179c9523d0e}
D=${DRAFTER:-$(ls -d /tmp/kcache/eagle3/bundles/c6777fd6e43c3e90*/drafter)}
PROMPTS=${PROMPTS:-.carry/data/mt_bench_questions.jsonl}
run() {  # NAME [server args...]
  name=$1; shift
  /tmp/sglang-python -m sglang.launch_server --model-path "$M" --host 127.0.0.1 --port 31000 --dtype bfloat16 \
    --random-seed 0 --context-length 2048 --mem-fraction-static 0.3 --attention-backend triton \
    --sampling-backend pytorch --cuda-graph-max-bs-decode 128 --enable-metrics "$@" > "$OUT/$name.server.log" 2>&1 &
  pid=$!
  t0=$(date +%s)
  until curl -s -o /dev/null http://127.0.0.1:31000/health_generate; do
    sleep 1; [ $(( $(date +%s) - t0 )) -gt 200 ] && break
  done
  echo "$name ready in $(( $(date +%s) - t0 )) s"
  python3 - "$name" "$PROMPTS" <<'PY'
import json, os, sys, time, urllib.request
qs = [json.loads(line) for line in open(sys.argv[2])][:20]
def gen(text):
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 96, "temperature": 0,
                                                         "ignore_eos": True}}).encode()
    t = time.perf_counter()
    req = urllib.request.Request("http://127.0.0.1:31000/generate", body, {"Content-Type": "application/json"})
    r = json.loads(urllib.request.urlopen(req).read())
    return time.perf_counter() - t, r["meta_info"]
for q in qs[:3]:
    gen(q["turns"][0])  # warm-up: first requests pay lazy initialisation
tot = toks = ver = 0.0
for q in qs:
    dt, m = gen(q["turns"][0])
    tot += dt; toks += m["completion_tokens"]; ver += m.get("spec_verify_ct", 0) or 0
out = {"name": sys.argv[1], "tok_s": toks / tot, "ms_per_step": 1000 * tot / (ver or toks),
       "accept_len": (toks / ver) if ver else 1.0, "requests": len(qs)}
print(json.dumps(out))
open(os.path.join(os.environ["OUT"], "steps.jsonl"), "a").write(json.dumps(out) + "\n")
PY
  kill $pid; wait $pid 2>/dev/null; sleep 2
}
S="--speculative-algorithm EAGLE3 --speculative-draft-model-path $D --speculative-eagle-topk 1"
for c in ${CONFIGS:-plain steps1 steps3 steps3-nooverlap steps5 plain2 steps7}; do
  case "$c" in
    plain*) run "$c" ;;
    steps*-nooverlap) n=${c#steps}; n=${n%-nooverlap}
      run "$c" $S --speculative-num-steps "$n" --speculative-num-draft-tokens $((n + 1)) --disable-overlap-schedule ;;
    steps*) n=${c#steps}; run "$c" $S --speculative-num-steps "$n" --speculative-num-draft-tokens $((n + 1)) ;;
    *) echo "unknown config $c (plainN, stepsN, stepsN-nooverlap)" >&2; exit 2 ;;
  esac
done
