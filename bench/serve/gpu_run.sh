#!/bin/bash
# One device call of the serving sweep on the GPU machine (vLLM 0.26 bundle, see shared/device/README.md).
#
#   bash bench/serve/gpu_run.sh PRESET [extra bench.serve.sweep args ...]
#
# Needs, on this machine: the vLLM bundle extracted in /tmp/site, or /tmp/stage/part.00 (staged by the previous call)
# plus .vllm_bundle/p2 carried in this one (then it is extracted here). Writes into $OUT (at most 8 files come back):
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
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
       NVSHMEM_DISABLE_NVLS=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
       PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ ! -d /tmp/site/vllm ]; then
  test -f /tmp/stage/part.00 || { echo "no /tmp/stage/part.00: run the staging call (carry .vllm_bundle/p1) first"; exit 3; }
  test -f .vllm_bundle/p2/part.01 || { echo "carry .vllm_bundle/p2 in this call"; exit 3; }
  cat /tmp/stage/part.00 .vllm_bundle/p2/part.01 > /tmp/bundle.tar.xz && sha256sum -c .vllm_bundle/p2/SHA256SUM \
    && mkdir -p /tmp/site && tar -xJf /tmp/bundle.tar.xz -C /tmp/site && rm -f /tmp/bundle.tar.xz || exit 4
  echo "vLLM bundle extracted in $(( $(date +%s) - T0 )) s"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 5; }
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
