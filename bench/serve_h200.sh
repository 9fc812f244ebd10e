#!/usr/bin/env bash
# Issue 10's measured sequence against a fresh `kvrelay serve` (dummy full-size weights), one topology:
#   solo TTFT at 1k / 8k / 32k prompts and solo decode at 8k context (8k/256), 64 staggered streams of
#   1k in / 256 out, and the 1k/1k sweep at concurrency 1..256 (first wave spread over 2 s). Results (JSON + PNG) go to $RESULTS (default bench/results).
#   Env: SWEEP (concurrencies), WAVES (requests per point = waves x concurrency), ONLY_SWEEP=1 (skip the
#   solo and 64-stream runs), SKIP_SOLO=1 (skip the solo runs only), SOLO_ONLY=1 (the solo runs only, of
#   SOLO_WORKLOADS, default 1k/16,8k/256,32k/16: a served decode/TTFT figure from one server start).
# MULTITURN=1 runs issue 16's multi-turn workload instead (bench/serve_multiturn.py: 8 conversations x 7
#   turns over one 6k system prompt, prompts 8k..32k tokens, 256-token answers, 2 s between a conversation's
#   turns) against four fresh servers of CONFIG, written to $RESULTS/serve-LABEL-mt-{off,on,small,host}.yaml:
#   prefix cache off; on (prefill.prefix_cache: true); on with a KV pool too small to keep every
#   conversation (decode.kv_memory_fraction: $MT_SMALL_KV, default 0.1: ~11 GiB of an H200 next to 20b,
#   ~174k positions, where the 8 conversations' prefixes reach ~262k, so idle ones are evicted; a pool must
#   hold one whole request, so these two modes also cap model.max_context at $MT_SMALL_CTX, default 40960,
#   above the workload's 32k + answer); and that small pool with the
#   host tier (prefill.prefix_cache_host_gib: 16), which is what the tier is for. Each server captures decode
#   graphs up to batch 16 only (8 streams at most), which shortens its start-up. Expected on one H200 with
#   gpt-oss-20b: ~4 x 60 s of start-up + ~45 s of workload with the cache off, ~20-30 s with it: ~6-7 min.
#   MT_SOLO=WORKLOADS also runs the solo serve benchmark (concurrency 1, 2 requests each) on the cache-off
#   server after its multi-turn run (a decode-speed figure without a server start of its own).
#   MT_ARGS replaces the workload options (e.g. "--conversations 4 --turns 4 --user-len 7936": 8k..32k in
#   4 turns); MT_MODES the modes (default "off on small host").
# usage: bench/serve_h200.sh CONFIG LABEL [GPUS]     (run from the repo root, kvrelay importable)
set -uo pipefail
cfg=$1; label=$2; gpus=${3:-1}
out=${RESULTS:-bench/results}; mkdir -p "$out"
pid=
# A server left running (this script cut by a timeout) holds most of the GPU's memory: the next benchmark
# on the machine would size its KV pool around it. Stop the one running on any exit.
trap '[ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && { kill -TERM "$pid"; wait "$pid"; }' EXIT
trap 'exit 143' TERM INT

start() {  # CONFIG LOG: a fresh `kvrelay serve`; sets pid, url, ray
  kvrelay serve "$1" --dummy >"$2" 2>&1 &
  pid=$!
  for _ in $(seq 900); do
    grep -q '^kvrelay-ready' "$2" && break
    kill -0 $pid 2>/dev/null || { echo "serve died:"; tail -40 "$2"; return 1; }
    sleep 1
  done
  grep '^kvrelay-ready' "$2" || { echo "serve not ready"; tail -40 "$2"; kill $pid; return 1; }
  url=$(grep '^kvrelay-ready' "$2" | sed 's/^kvrelay-ready //' | python3 -c 'import json,sys; print(json.load(sys.stdin)["http"])')
  ray=$(grep '^kvrelay-ready' "$2" | sed 's/^kvrelay-ready //' | python3 -c 'import json,sys; print(json.load(sys.stdin)["ray"])')
}
stop() {  # LOG
  grep -E 'KV pool|error|Error' "$1" | head -20
  kill -TERM $pid; wait $pid
}
# Each worker's step-loop phases (launch / wait on the device / emit / ops, summed) and, with the prefix
# cache, its hit counters, after each run.
st() { kvrelay status "$1" --address "$ray" --json >"$out/serve-$label-$2-status.json" 2>/dev/null || true; }

if [ -n "${MULTITURN:-}" ]; then
  mt_args=${MT_ARGS:---conversations 8 --turns 7 --system-len 6k --first-user-len 2k --user-len 3840 --answer-len 256 --stagger-s 2 --think-s 2}
  rc=0
  for mode in ${MT_MODES:-off on small host}; do
    mcfg="$out/serve-$label-mt-$mode.yaml"
    python3 - "$cfg" "$mode" "$mcfg" "${MT_SMALL_KV:-0.1}" "${MT_SMALL_CTX:-40960}" <<'EOF'
import sys, yaml
src, mode, dst, small_kv, small_ctx = sys.argv[1:]
with open(src) as f:
    topo = yaml.safe_load(f)
prefill = topo.setdefault("prefill", {})
prefill["prefix_cache"] = mode != "off"
prefill.pop("prefix_cache_host_gib", None)
decode = topo.setdefault("decode", {})
decode["cuda_graph_batch_sizes"] = [b for b in decode.get("cuda_graph_batch_sizes") or [1, 2, 4, 8, 16] if b <= 16]
if mode in ("small", "host"):
    decode["kv_memory_fraction"] = float(small_kv)
    topo["model"]["max_context"] = int(small_ctx)
    prefill["max_prompt_tokens"] = min(int(small_ctx), prefill.get("max_prompt_tokens") or int(small_ctx))
if mode == "host":
    prefill["prefix_cache_host_gib"] = 16
with open(dst, "w") as f:
    yaml.safe_dump(topo, f, sort_keys=False)
EOF
    if ! check=$(kvrelay config check "$mcfg" --dummy 2>&1); then
      echo "multi-turn $mode: skipped, kvrelay config check refuses $mcfg: $(echo "$check" | tail -1)"
      [ "$mode" = host ] || rc=1
      continue
    fi
    log="$out/serve-$label-mt-$mode.log"
    start "$mcfg" "$log" || { rc=1; continue; }
    case $mode in host) pc=on+host ;; small) pc=on+small ;; *) pc=$mode ;; esac
    # shellcheck disable=SC2086  # mt_args is a list of options
    python3 -m kvrelay.bench.serve_multiturn --base-url "$url" --gpus "$gpus" --topology "$mcfg" --out-dir "$out" \
      --label "$label-mt-$mode" --prefix-cache "$pc" $mt_args || rc=1
    if [ "$mode" = off ] && [ -n "${MT_SOLO:-}" ]; then  # e.g. MT_SOLO=1k/16,8k/256: solo runs on this server too
      python3 -m kvrelay.bench.serve --base-url "$url" --gpus "$gpus" --topology "$mcfg" --out-dir "$out" \
        --label "$label-solo" --workloads "$MT_SOLO" --concurrency 1 --requests 2 || rc=1
    fi
    st "$mcfg" "mt-$mode"
    stop "$log"
  done
  exit $rc
fi

log="$out/serve-$label.log"
start "$cfg" "$log" || exit 1
b() { python3 -m kvrelay.bench.serve --base-url "$url" --gpus "$gpus" --topology "$cfg" --out-dir "$out" "$@"; }
if [ -z "${ONLY_SWEEP:-}" ]; then
  [ -z "${SKIP_SOLO:-}" ] && { b --label "$label-solo" --workloads "${SOLO_WORKLOADS:-1k/16,8k/256,32k/16}" --concurrency 1 --requests 2; st "$cfg" solo; }
  [ -z "${SOLO_ONLY:-}" ] && { b --label "$label-64x1k256" --workloads 1k/256 --concurrency 64 --waves 5 --stagger-s 3; st "$cfg" 64x1k256; }
fi
[ -z "${SOLO_ONLY:-}" ] && { b --label "$label-1k1k" --workloads 1k/1k --concurrency ${SWEEP:-1,4,16,64,128,256} --waves ${WAVES:-1} --stagger-s 2; st "$cfg" 1k1k; }
stop "$log"
