#!/usr/bin/env bash
# Device call 5 of 2026-11-28 (2 H200s, restaged with p1-p3): batch 1 in many short turns, so that a paired
# comparison sees the same host state: no LoRA and bd (--enable-bdlora alone, one adapter), 10 rounds of
# (144 - 16 generate, reps 1) + step_ms over 256 steps, 128-token prompts; TP=8's shard on GPU 0, TP=4's on GPU 1,
# one turn folder. Writes OUT/call5.tar.gz (r5/) and prints report --rr.
#   bash call5.sh OUT                 (call 5: 128-token prompts, 10 rounds)
#   bash call5.sh OUT 6 1024 6        (call 6: 1024-token prompts, IT/OT 1024/128's context, 6 rounds, writes r6/)
set -u
out=$1 n=${2:-5} plen=${3:-128} rounds=${4:-10}
source bench/serve/gpu_env.sh || exit 1
r=/tmp/r$n && rm -rf $r && mkdir -p $r
PROXY_ARGS="--batches 1 --ttft= --step-tokens 256 --reps 1 --prompt-len $plen" timeout 500 \
  bash bench/serve/auto_proxy_gpus.sh $r $rounds 0.4 \
  "tp8 base=base bd=bd" "tp4 base=base bd=bd"
echo "rc=$?"
nvidia-smi -L > $r/gpus.txt
tar czf $out/call$n.tar.gz -C /tmp r$n
python3 -m bench.serve.report --rr $r 2>&1 | tail -30
