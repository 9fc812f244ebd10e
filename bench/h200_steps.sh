#!/usr/bin/env bash
# Named benchmark and test steps for one device call on the H200 machine, each under what is left of the
# call's time (a step that would start with under 30 s left is skipped, so the results so far come back).
# Results go to /tmp/r/<step>/ (WORK_DIR moves this scratch from /tmp) and, at the end, to $OUT/r.tgz (the
# device tool fetches what is under $OUT).
#
# usage, on the device machine from the repo root (the checkout travels without .git, so the commit of the
# measured tree is passed in; it must be a commit whose tree is what was carried, for RESULTS.md to table it):
#   KVRELAY_GIT_COMMIT=<sha> STEPS="pre20 pp20 tgpu" LIMIT=540 bash bench/h200_steps.sh
# Steps: prof20/prof120 (batch-1 decode profile, PDL off), dec20/dec120 (batch-1 decode at 8k, pipelined),
#   decsweep20/decsweep120 (decode curves at 8k and 32k, batch 1..256; LENGTHS/BATCHES override the lists), pp20/pp120 (prefill 8192 profile),
#   pre20/pre120 (prefill 8192; PRE_LENGTHS overrides), wall20/wall120 (prefill 8192's wall vs device time per layer,
#   back to back and with the host queued ahead, with the SM clock and power cap), serve1 (bench/serve_h200.sh SOLO_ONLY against $SERVE_CONFIG, default
#   configs/h200-1gpu-20b.yaml, labelled $SERVE_LABEL$TAG),
#   gemv1/gemv2 (bench.sweep_gemv: GEMM1 / GEMM2 alone at batch 1, SAMPLES random launches of 512, default all, on 120b's
#   experts; ~3 / ~6 s a launch, mostly its compile), gemvf (the same for both GEMVs in one launch against today's two,
#   SAMPLES default 40; KVRELAY_MOE_FUSED_GEMV=1 in ENV_SET is its in-model A/B), kmoe (bench.kernels --only moe: the MoE rows, the engine's decode layer too),
#   m1ab (batch-1 decode of both models once per KVRELAY_FP8_M1 value in M1_SET: the dense projections' backends A/B),
#   envab (the same once per item of ENV_SET: "+"-joined VAR=VALUE settings, "-" for none; e.g. the opt-in decode
#   fusions: ENV_SET="- KVRELAY_DECODE_MERGE_FUSE=1 KVRELAY_DECODE_MERGE_FUSE=1+KVRELAY_MOE_NORM_FUSE=1"),
#   tgpu (pytest $TESTS, default tests/gpu), aot (FlashInfer's JIT-built modules as $OUT/fi-aot.tgz),
#   tune (bench.tune_moe: the grouped expert GEMMs' configs; TUNE_TOKENS / TUNE_MODELS narrow it).
# QUANT (default fp8-block128) is the benchmarks' --quant; TAG (default empty) is appended to each step's result
#   folder, so one call can run the script several times with different settings (QUANT=... TAG=-lmhead).
# Environment it installs from when present: .dev/fi (FlashInfer wheels alone, for calls without the serving
#   stack), .dev/extra when EXTRA=1, and .fiaot/fi-aot.tgz (modules saved by `aot`, unpacked into
#   flashinfer/data/aot so the first FlashInfer call does not JIT for ~3 min).
# `aot` saves only what this machine built. The first step that builds a model with FlashInfer JITs its modules
#   (2026-12-03 at efee885: dec20 built batch_prefill_attention_sink_bf16_swa_{False,True}_fa3 and a
#   batch_prefill_with_kv_cache module, ~3.5 min; prof20 the same two sink modules on 2026-12-02), so on a
#   machine without .fiaot put `aot` right after the first such step, e.g. STEPS="dec20 aot ...", and carry
#   the returned fi-aot.tgz as .fiaot/ in the later calls (a fresh checkout does not have it).
set -uo pipefail
: "${KVRELAY_GIT_COMMIT:?set KVRELAY_GIT_COMMIT to the commit of the carried tree}"
T0=$(date +%s); LIMIT=${LIMIT:-540}
W=${WORK_DIR:-/tmp}  # scratch: results in $W/r, wheels in $W/site, the package links in $W/kvp
mkdir -p "$W/r" "$W/site"
if [ ! -d "$W/kvp/kvrelay" ]; then  # the checkout as the `kvrelay` package, as pyproject.toml maps it
  mkdir -p "$W/kvp/kvrelay"
  KVP_DIR="$W/kvp/kvrelay" python3 - <<'PY'
import os, tomllib
for pkg, path in tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"].items():
    parts = pkg.split(".")[1:]
    if len(parts) == 1:
        os.symlink(os.path.abspath(path), os.path.join(os.environ["KVP_DIR"], parts[0]))
PY
fi
export PYTHONPATH="$W/site:$W/kvp" PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 KVRELAY_GIT_CLEAN=1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 UCX_NET_DEVICES=lo KVRELAY_GIT_COMMIT
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" "$@"; }
if [ -d .dev/fi ] && ! python3 -c "import flashinfer" 2>/dev/null; then pipi .dev/fi/*.whl; fi
if [ -d .dev/extra ] && [ -n "${EXTRA:-}" ]; then pipi .dev/extra/*.whl; fi
# `pip --target --upgrade` replaces $W/site/bin, where the bundles' setup.sh wrote the `kvrelay` command that
# serve1 runs (2026-12-03: an EXTRA install after .dev/gpu2's setup left "kvrelay: command not found")
mkdir -p "$W/site/bin" && printf '#!/bin/sh\nexec python3 -m kvrelay.cluster.cli "$@"\n' > "$W/site/bin/kvrelay" \
  && chmod +x "$W/site/bin/kvrelay" && export PATH="$W/site/bin:$PATH"
if [ -f .fiaot/fi-aot.tgz ]; then
  fi_dir=$(python3 -c "import flashinfer, os; print(os.path.dirname(flashinfer.__file__))" 2>/dev/null)
  [ -n "$fi_dir" ] && mkdir -p "$fi_dir/data/aot" && tar xzf .fiaot/fi-aot.tgz -C "$fi_dir/data/aot"
fi
M="--dummy --quant ${QUANT:-fp8-block128} --device cuda"  # QUANT=fp8-block128-lmhead: the FP8 head too
bench() { local name=$1${TAG:-}; shift; mkdir -p "$W/r/$name"; timeout "$left" python3 -m "$@" --out "$W/r/$name"; }
for s in ${STEPS:-}; do
  left=$(( LIMIT - ($(date +%s) - T0) ))
  [ "$left" -lt 30 ] && { echo "== skip $s ($left s left)"; continue; }
  echo "== $s ($(date +%T), $left s left)"
  case $s in
    prof20|prof120) KVRELAY_PDL=0 bench $s kvrelay.bench.profile_decode --model gpt-oss-${s#prof}b $M --batch 1 --context 8192 \
        --top 40 --graphs ;;
    dec20|dec120) bench $s kvrelay.bench.decode --model gpt-oss-${s#dec}b $M --lengths 8192 --batches 1 --mode pipelined ;;
    decsweep20|decsweep120) bench $s kvrelay.bench.decode --model gpt-oss-${s#decsweep}b $M --lengths "${LENGTHS:-8192,32768}" \
        --batches "${BATCHES:-1,8,32,64,128,256}" --mode pipelined --budget-s $(( left - 20 )) ;;
    pp20|pp120) mkdir -p "$W/r/$s${TAG:-}"; bench $s kvrelay.bench.profile_prefill --model gpt-oss-${s#pp}b $M --length 8192 \
        --top 30 --host-profile "$W/r/$s${TAG:-}/host.txt" ;;
    pre20|pre120) bench $s kvrelay.bench.prefill --model gpt-oss-${s#pre}b $M --lengths "${PRE_LENGTHS:-8192}" ;;
    wall20|wall120) bench $s kvrelay.bench.prefill_wall --model gpt-oss-${s#wall}b $M --length 8192 ;;
    gemv1|gemv2) bench $s kvrelay.bench.sweep_gemv --models gpt-oss-120b --tokens 1 --gemms w${s#gemv} --samples "${SAMPLES:-512}" \
        --budget-s $(( left - 20 )) ;;
    gemvf) bench $s kvrelay.bench.sweep_gemv --models gpt-oss-120b --tokens 1 --gemms fused --samples "${SAMPLES:-40}" \
        --budget-s $(( left - 20 )) ;;
    m1ab) # batch-1 FP8 backends per projection, in the model (kernels/fp8_gemm.py M1_PINNED): for the i-th
        # KVRELAY_FP8_M1 value of M1_SET (space-separated, e.g. "2880x4096=cublas 5120x2880=gemv-n8-k512-s4-w1-st2"),
        # dec20 and dec120 into dec20-m1ab<i>$TAG / dec120-m1ab<i>$TAG, back to back; $W/r/m1ab.txt maps i to the value
        i=0
        for pin in ${M1_SET:-}; do
          i=$((i + 1)); echo "m1ab$i $pin" >> "$W/r/m1ab.txt"
          for m in 20 120; do
            left=$(( LIMIT - ($(date +%s) - T0) )); [ "$left" -lt 30 ] && { echo "== skip m1ab$i dec$m ($left s left)"; break 2; }
            KVRELAY_FP8_M1=$pin TAG="-m1ab$i${TAG:-}" bench "dec$m" kvrelay.bench.decode --model "gpt-oss-${m}b" $M \
              --lengths 8192 --batches 1 --mode pipelined
          done
        done ;;
    envab) # the i-th item of ENV_SET (space-separated; each "+"-joined VAR=VALUE assignments, "-" for none) in the
        # environment of dec20 and dec120, into dec20-envab<i>$TAG / dec120-envab<i>$TAG; $W/r/envab.txt maps i to it
        i=0
        for item in ${ENV_SET:-}; do
          i=$((i + 1)); echo "envab$i $item" >> "$W/r/envab.txt"
          assigns=(); [ "$item" != "-" ] && IFS=+ read -ra assigns <<< "$item"
          for m in 20 120; do
            left=$(( LIMIT - ($(date +%s) - T0) )); [ "$left" -lt 30 ] && { echo "== skip envab$i dec$m ($left s left)"; break 2; }
            # a subshell: the settings and the tag end with the run
            ( [ ${#assigns[@]} -gt 0 ] && export "${assigns[@]}"; TAG="-envab$i${TAG:-}" bench "dec$m" kvrelay.bench.decode \
              --model "gpt-oss-${m}b" $M --lengths 8192 --batches 1 --mode pipelined )
          done
        done ;;
    kmoe) mkdir -p "$W/r/kmoe${TAG:-}"; timeout "$left" python3 -m kvrelay.bench.kernels --only moe --out "$W/r/kmoe${TAG:-}" ;;
    tune) # bench.tune_moe under what is left (TUNE_TOKENS, default its own list; TUNE_MODELS likewise): the sweep's
      # JSON and the config file it would track (kernels/configs/moe_<gpu>.json) both in r/tune
      mkdir -p "$W/r/tune${TAG:-}"; timeout "$left" python3 -m kvrelay.bench.tune_moe --budget-s $(( left - 20 )) \
        ${TUNE_TOKENS:+--tokens "$TUNE_TOKENS"} ${TUNE_MODELS:+--models "$TUNE_MODELS"} \
        --out "$W/r/tune${TAG:-}" --config-out "$W/r/tune${TAG:-}/" ;;
    serve1) SOLO_ONLY=1 SOLO_WORKLOADS=8k/256,1k/16 RESULTS="$W/r/serve" timeout "$left" \
        bash bench/serve_h200.sh "${SERVE_CONFIG:-configs/h200-1gpu-20b.yaml}" "${SERVE_LABEL:-h200-1gpu-20b}${TAG:-}" ;;
    tgpu) # SIGINT at the limit: pytest then stops as on Ctrl-C and still prints its summary (-rf names each
        # failure; 2026-12-03 a run cut by SIGTERM left only dots and an F); -v logs each test's name as it ends.
        # shellcheck disable=SC2086
        timeout -s INT -k 20 "$left" python3 -m pytest -v -p no:cacheprovider -rf ${TESTS:-tests/gpu} 2>&1 \
          | tee -a "$W/r/gpu-tests.txt" | grep -E "FAILED|ERROR|passed|failed" ;;
    aot) (cd ~/.cache/flashinfer/*/90a/cached_ops && tar czf "$OUT/fi-aot.tgz" -- */*.so) ;;
    *) echo "unknown step $s" ;;
  esac
  echo "== $s rc=$? ($(date +%T))"
done
tar czf "$OUT/r.tgz" -C "$W" r
