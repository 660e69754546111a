#!/usr/bin/env bash
# Device call 1 (2 H200s: no 4-GPU machine was lent; carries .vllm_bundle/p1 and stages it): kernels only (no vLLM). Four slots, tokens
# interleaved over them (token i on slot i mod 4, as requests cycling over 4 adapters are batched): the tiled
# folded kernel as it is (fold_gemm) against the same on tokens grouped by slot (fold_sorted), every tile
# candidate, plain and pdl, at the TP=4 and TP=8 shard shapes; the float64 check (sorted included) on GPU 0.
# Writes OUT/call1.tar.gz (r1/: every json and log).
set -u
out=$1
mkdir -p /tmp/stage && cp .vllm_bundle/p*/part.* /tmp/stage/
r=/tmp/r1 && mkdir -p $r
export PYTHONPATH=$PWD
K="python3 bench/kernels/bench_serving_kernels.py"
run() { gpu=$1 name=$2; shift 2; CUDA_VISIBLE_DEVICES=$gpu timeout 540 $K "$@" --out $r/$name.json > $r/$name.log 2>&1; echo "$name rc=$?" >> $r/rc.txt; }
run 0 k4_tp4_r64 --shapes tp4 --loras 4 --tokens 16,32,64,128 --paths base,fold_gemm,fold_sorted &
run 1 k4_tp8_r32 --no-check --shapes tp8 --loras 4 --tokens 16,32,64,128 --paths base,fold_gemm,fold_sorted &
wait
nvidia-smi -L > $r/gpus.txt
tar czf $out/call1.tar.gz -C /tmp r1
cat $r/rc.txt
