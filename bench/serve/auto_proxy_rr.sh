#!/usr/bin/env bash
# Engines of bench/serve/auto_proxy.py side by side on one GPU: started together, measuring in turns (--rr).
#   bash bench/serve/auto_proxy_rr.sh SHAPE OUTDIR ROUNDS MEM ENGINE...
# ENGINE = label=only[=tuning JSON], e.g.  base=base  lora=lora  bd=bd  bd_nogemv=bd={"fold_gemv_max":0}
# Results: OUTDIR/rr_SHAPE_LABEL.json and .log. PROXY_ARGS="--batches 1,16 --ttft 1": more auto_proxy.py options.
# STAGGER_S (default 40): seconds between engine starts; engines profiling memory at the same moment can see each
# other's allocations and fail with "No available memory for the cache blocks".
set -u
shape=$1 out=$2 rounds=$3 mem=$4
shift 4
rr=$(mktemp -d)
mkdir -p "$out"
i=0
for spec in "$@"; do
  IFS='=' read -r label only tuning <<< "$spec"
  [ "$i" -gt 0 ] && sleep "${STAGGER_S:-40}"
  args=(--shape "$shape" --only "$only" --label "$label" --rr "$rr" --index "$i" --count "$#" --rounds "$rounds" ${PROXY_ARGS:-}
        --mem "$mem" --out "$out/rr_${shape}_${label}.json")
  [ -n "${tuning:-}" ] && args+=(--tuning "$tuning")
  python3 "$(dirname "$0")/auto_proxy.py" "${args[@]}" > "$out/rr_${shape}_${label}.log" 2>&1 &
  i=$((i + 1))
done
wait
