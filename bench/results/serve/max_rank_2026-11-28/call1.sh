#!/usr/bin/env bash
# Device call 1 (4 GPUs; also the first staging call: carry .vllm_bundle/p1): kernels at the buffer ranks bdlora.max_rank gives (TP=4: 40, TP=8:
# 24, for the proxy's rank-38 / rank-19 adapters) beside the buffer ranks of max_lora_rank (64, 32), GPU beside GPU.
# Writes OUT/call1.tar.gz (r/: every json and log).
set -u
out=$1
r=/tmp/r && mkdir -p $r /tmp/stage && cp .vllm_bundle/p*/part.* /tmp/stage/
export PYTHONPATH=$PWD
K="python3 bench/kernels/bench_serving_kernels.py"
run() { gpu=$1 name=$2; shift 2; CUDA_VISIBLE_DEVICES=$gpu timeout 500 $K "$@" --out $r/$name.json > $r/$name.log 2>&1; echo "$name rc=$?" >> $r/rc.txt; }
run 0 k4_tp4_r40 --shapes tp4 --loras 4 --tokens 16,32,64,128 --buffer-rank tp4=40 --paths base,fold_gemm &
run 1 k4_tp4_r64 --no-check --shapes tp4 --loras 4 --tokens 16,32,64,128 --paths base,fold_gemm &
(run 2 k4_tp8_r24 --no-check --shapes tp8 --loras 4 --tokens 16,64 --buffer-rank tp8=24 --paths base,fold_gemm
 run 2 k4_tp8_r32 --no-check --shapes tp8 --loras 4 --tokens 16,64 --paths base,fold_gemm) &
(run 3 k1_r40 --no-check --shapes tp4,tp8 --loras 1 --tokens 1 --buffer-rank tp4=40,tp8=24 \
   --paths base,fold_gemm,fold_gemv --gemv-kinds one_token
 run 3 rows_tp4 --no-check --shapes tp4 --loras 1 --tokens 1,16,64 --paths base,gemm_rows \
   --extra-rows 0,16,32,48,64,80,96,128,160,192,256,384,512) &
wait
tar czf $out/call1.tar.gz -C /tmp r
cat $r/rc.txt
