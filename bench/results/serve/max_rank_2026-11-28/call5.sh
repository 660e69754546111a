#!/usr/bin/env bash
# Device call 5 (4 GPUs, a fresh machine; kernels only, no vLLM, so no staging): the one-token candidates at the
# default buffer ranks (64, 32: the H200's rows were last tuned on 2026-11-25, before the one-dot expand and the
# pipelined K loop), and four slots at a buffer rank of 48 (max_rank 152 at TP=4, rounded up to 16) beside 64.
# Writes OUT/call5.tar.gz (r/: every json and log).
set -u
out=$1
r=/tmp/r5 && mkdir -p $r
export PYTHONPATH=$PWD
K="python3 bench/kernels/bench_serving_kernels.py"
run() { gpu=$1 name=$2; shift 2; CUDA_VISIBLE_DEVICES=$gpu timeout 520 $K "$@" --out $r/$name.json > $r/$name.log 2>&1; echo "$name rc=$?" >> $r/rc.txt; }
run 0 k1_tp4 --no-check --shapes tp4 --loras 1 --tokens 1 --paths base,fold_gemm,fold_gemv --gemv-kinds one_token &
run 1 k1_tp8 --no-check --shapes tp8 --loras 1 --tokens 1 --paths base,fold_gemm,fold_gemv --gemv-kinds one_token &
(run 2 k4_tp4_r48 --shapes tp4 --loras 4 --tokens 16,32,64,128 --buffer-rank tp4=48 --paths base,fold_gemm
 run 2 k1_tp4_r48 --no-check --shapes tp4 --loras 1 --tokens 1 --buffer-rank tp4=48 --paths base,fold_gemm,fold_gemv \
   --gemv-kinds one_token) &
(run 3 k4_tp4_r64 --no-check --shapes tp4 --loras 4 --tokens 16,32,64,128 --paths base,fold_gemm
 run 3 k4_tp8_r32 --no-check --shapes tp8 --loras 4 --tokens 16,32,64,128 --paths base,fold_gemm) &
wait
nvidia-smi -L > $r/gpus.txt
tar czf $out/call5.tar.gz -C /tmp r5
cat $r/rc.txt
