#!/usr/bin/env bash
# Issue 10's measured sequence against a fresh `kvrelay serve` (dummy full-size weights), one topology:
#   solo TTFT at 1k / 8k / 32k prompts and solo decode at 8k context (8k/256), 64 staggered streams of
#   1k in / 256 out, and the 1k/1k sweep at concurrency 1..256 (first wave spread over 2 s). Results (JSON + PNG) go to $RESULTS (default bench/results).
#   Env: SWEEP (concurrencies), WAVES (requests per point = waves x concurrency), ONLY_SWEEP=1 (skip the
#   solo and 64-stream runs), SKIP_SOLO=1 (skip the solo runs only).
# usage: bench/serve_h200.sh CONFIG LABEL [GPUS]     (run from the repo root, kvrelay importable)
set -uo pipefail
cfg=$1; label=$2; gpus=${3:-1}
out=${RESULTS:-bench/results}; mkdir -p "$out"
log="$out/serve-$label.log"
kvrelay serve "$cfg" --dummy >"$log" 2>&1 &
pid=$!
for _ in $(seq 900); do
  grep -q '^kvrelay-ready' "$log" && break
  kill -0 $pid 2>/dev/null || { echo "serve died:"; tail -40 "$log"; exit 1; }
  sleep 1
done
grep '^kvrelay-ready' "$log" || { echo "serve not ready"; tail -40 "$log"; kill $pid; exit 1; }
url=$(grep '^kvrelay-ready' "$log" | sed 's/^kvrelay-ready //' | python3 -c 'import json,sys; print(json.load(sys.stdin)["http"])')
ray=$(grep '^kvrelay-ready' "$log" | sed 's/^kvrelay-ready //' | python3 -c 'import json,sys; print(json.load(sys.stdin)["ray"])')
# Each worker's step-loop phases (launch / wait on the device / emit / ops, summed) after each run: where
# a served step's time goes besides the GPU.
st() { kvrelay status "$cfg" --address "$ray" --json >"$out/serve-$label-$1-status.json" 2>/dev/null || true; }
b() { python3 -m kvrelay.bench.serve --base-url "$url" --gpus "$gpus" --topology "$cfg" --out-dir "$out" "$@"; }
if [ -z "${ONLY_SWEEP:-}" ]; then
  [ -z "${SKIP_SOLO:-}" ] && { b --label "$label-solo" --workloads 1k/16,8k/256,32k/16 --concurrency 1 --requests 2; st solo; }
  b --label "$label-64x1k256" --workloads 1k/256 --concurrency 64 --waves 5 --stagger-s 3; st 64x1k256
fi
b --label "$label-1k1k" --workloads 1k/1k --concurrency ${SWEEP:-1,4,16,64,128,256} --waves ${WAVES:-1} --stagger-s 2; st 1k1k
grep -E 'KV pool|error|Error' "$log" | head -20
kill -TERM $pid; wait $pid
