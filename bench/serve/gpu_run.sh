#!/bin/bash
# One device call of the serving sweep on the GPU machine (vLLM 0.26 bundle, see shared/device/README.md).
#
#   bash bench/serve/gpu_run.sh PRESET [extra bench.serve.sweep args ...]
#
# Needs, on this machine: the vLLM bundle extracted in /tmp/site, or its first parts staged by the previous calls plus
# its last carried in this one (then it is extracted here; bench/serve/gpu_env.sh). Writes into $OUT (at most 8 files come back):
#   serve_PRESET.tar.gz  all results (LLMPerf JSON per server x load, server.json with errors/log tails, results.csv);
#                        unpack with: mkdir -p bench/results/serve/PRESET && tar xzf serve_PRESET.tar.gz -C bench/results/serve/PRESET
#   sweep_PRESET.log     the sweep's log;  table_PRESET.md  the markdown table;  results_PRESET.csv
# Resumes from bench/results/serve/PRESET (results of earlier calls, travelling with the checkout) and from
# /tmp/bench-serve/PRESET (a warm machine's earlier call). Stops starting servers in time for the 10-minute limit.
set -uo pipefail
T0=$(date +%s)
LIMIT=${CALL_LIMIT_S:-590}       # the device call's timeout_s minus a little
PRESET=${1:?usage: gpu_run.sh PRESET [sweep args]}; shift
O=${OUT:-/tmp/out}; mkdir -p "$O"
source "$(dirname "$0")/gpu_env.sh" || exit $?
python3 -c "import importlib.metadata as m; print('vllm', m.version('vllm'), 'plugins', [e.value for e in m.entry_points(group='vllm.general_plugins')])"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
BUDGET=$(( LIMIT - ($(date +%s) - T0) - 30 ))
RES=/tmp/bench-serve/$PRESET
echo "sweep budget ${BUDGET} s"
python3 -m bench.serve.sweep --preset "$PRESET" --out "$RES" --done-dir "bench/results/serve/$PRESET" \
  --time-budget-s "$BUDGET" --pack "$O/serve_$PRESET.tar.gz" "$@" 2>&1 | tee "$O/sweep_$PRESET.log"
python3 -m bench.serve.report "$RES" --markdown "$O/table_$PRESET.md" >/dev/null 2>&1 || true
cp "$RES/results.csv" "$O/results_$PRESET.csv" 2>/dev/null || true
cat "$O/table_$PRESET.md" 2>/dev/null
echo "call wall $(( $(date +%s) - T0 )) s"
