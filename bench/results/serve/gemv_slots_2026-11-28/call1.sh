#!/usr/bin/env bash
# Device call 7 of 2026-11-28 (2 H200s, kernels only, no vLLM): TP=8's shard with four slots of rank 32 (adapters
# of rank 19), tokens interleaved over the slots: the one-launch kernel's rows (fold_gemv, local and shared shrink)
# against the tiled folded kernel (fold_gemm, fold_sorted) at 4, 8 and 16 tokens, where the H200 entry serves o,
# gate_up and down with one-launch rows up to 128 slot rows (gemv_local_max_rows, gemv_shared_max_rows).
# GPU 0: 16 tokens; GPU 1: 4 and 8. Writes OUT/call1.tar.gz (r1/).
set -u
out=$1
r=/tmp/g1 && rm -rf $r && mkdir -p $r
export PYTHONPATH=$PWD
K="python3 bench/kernels/bench_serving_kernels.py"
run() { gpu=$1 name=$2; shift 2; CUDA_VISIBLE_DEVICES=$gpu timeout 230 $K "$@" --out $r/$name.json > $r/$name.log 2>&1; echo "$name rc=$?" >> $r/rc.txt; }
common="--no-check --shapes tp8 --loras 4 --paths base,fold_gemm,fold_sorted,fold_gemv --gemv-kinds local,shared"
run 0 k4_tp8_t16 $common --tokens 16 &
run 1 k4_tp8_t4_8 $common --tokens 4,8 &
wait
nvidia-smi -L > $r/gpus.txt
tar czf $out/call1.tar.gz -C /tmp g1
cat $r/rc.txt
