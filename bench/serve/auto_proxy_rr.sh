#!/usr/bin/env bash
# Engines of bench/serve/auto_proxy.py side by side on one GPU: started together, measuring in turns (--rr).
#   bash bench/serve/auto_proxy_rr.sh SHAPE OUTDIR ROUNDS MEM ENGINE...
# ENGINE = label=only[=tuning JSON], e.g.  base=base  lora=lora  bd=bd  bd_nogemv=bd={"fold_gemv_max":0}
# Results: OUTDIR/rr_SHAPE_LABEL.json and .log. PROXY_ARGS="--batches 1,16 --ttft 1": more auto_proxy.py options.
# Engines start one at a time: each after the one before reports "engine up" (engines profiling memory at the same
# moment see each other's allocations and fail). If an engine exits with an error, the others are stopped and this
# script exits 1 at once (they would otherwise wait for its turn).
# Several GPUs measuring in turns with each other: one call per GPU
# (CUDA_VISIBLE_DEVICES), all with RR_DIR (a turn folder they share, kept) and RR_TOTAL (engines over all calls),
# each with RR_FIRST (the index of its first engine); none measures until all are up (no compile beside a measurement).
set -u
shape=$1 out=$2 rounds=$3 mem=$4
shift 4
first=${RR_FIRST:-0} total=${RR_TOTAL:-$#}
if [ -n "${RR_DIR:-}" ]; then
  rr=$RR_DIR
else
  rr=$(mktemp -d)
  trap 'rm -rf "$rr"' EXIT  # the turn files
fi
mkdir -p "$out" "$rr"
pids=()
labels=()

stop_all() {
  echo "auto_proxy_rr: engine '$1' failed (see $out/rr_${shape}_$1.log); stopping the others" >&2
  [ -e "$rr/failed" ] || echo "$shape $1" > "$rr/failed"  # the other GPUs' engines stop waiting for a turn
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait
  exit 1
}

i=$first
for spec in "$@"; do
  IFS='=' read -r label only tuning <<< "$spec"
  log="$out/rr_${shape}_${label}.log"
  args=(--shape "$shape" --only "$only" --label "$label" --rr "$rr" --index "$i" --count "$total" --rounds "$rounds"
        ${PROXY_ARGS:-} --mem "$mem" --out "$out/rr_${shape}_${label}.json")
  [ -n "${tuning:-}" ] && args+=(--tuning "$tuning")
  python3 "$(dirname "$0")/auto_proxy.py" "${args[@]}" > "$log" 2>&1 &
  pids+=($!)
  labels+=("$label")
  until grep -q "engine up in" "$log" 2>/dev/null; do
    kill -0 "${pids[-1]}" 2>/dev/null || stop_all "$label"
    sleep 1
  done
  i=$((i + 1))
done
# measuring: the first engine to exit with an error stops the rest. Each wait names only the engines still
# running: bash reaps a finished one, and naming it again prints "no such job".
declare -A running=()
for k in "${!pids[@]}"; do running[${pids[$k]}]=${labels[$k]}; done
while [ "${#running[@]}" -gt 0 ]; do
  done_pid=
  wait -n -p done_pid "${!running[@]}"
  rc=$?
  [ -n "$done_pid" ] || stop_all "unknown"
  label=${running[$done_pid]}
  unset "running[$done_pid]"
  [ "$rc" -eq 0 ] || stop_all "$label"
done
