#!/usr/bin/env bash
# Device call 3 (the same 2 H200s, warm; carries .vllm_bundle/p3): the wall-clock A/B of tokens grouped by slot.
# auto_proxy.py's decode ms per step ((144-token generate - 16-token generate) / 128, unprofiled, min of 2 per round),
# four adapters (requests cycling over them), 128-token prompts, batch 16 and 64: no LoRA, bd (the H200 entry as
# committed: gemm_sorted on) and unsorted (the same with gemm_sorted off). TP=4 on GPU 0, TP=8 on GPU 1; the six
# engines share one turn folder, so none measures while another measures or compiles. 3 rounds.
# Writes OUT/call3.tar.gz (r3/: every json and log); `call3.sh OUT N` writes callN.tar.gz (rN/) instead (call 4).
set -u
out=$1 n=${2:-3}
source bench/serve/gpu_env.sh || exit 1
r=/tmp/r$n && mkdir -p $r && turns=$(mktemp -d)
export PROXY_ARGS="--adapters 4 --batches 16,64 --ttft="
U='unsorted=bd={"gemm_sorted":false}'
CUDA_VISIBLE_DEVICES=0 RR_DIR=$turns RR_FIRST=0 RR_TOTAL=6 timeout 570 bash bench/serve/auto_proxy_rr.sh tp4 $r 3 0.28 \
  base=base bd=bd "$U" > $r/gpu0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 RR_DIR=$turns RR_FIRST=3 RR_TOTAL=6 timeout 570 bash bench/serve/auto_proxy_rr.sh tp8 $r 3 0.28 \
  base=base bd=bd "$U" > $r/gpu1.txt 2>&1 &
wait
nvidia-smi -L > $r/gpus.txt
tar czf $out/call$n.tar.gz -C /tmp r$n
python3 -m bench.serve.report --rr $r 2>&1 | tail -30
