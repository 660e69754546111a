#!/bin/bash
# Multi-LoRA engine benchmarks in one device call (bench/train/bench_engine.py; its docstring has the details).
#
#   Two GPUs (about 430 s of wall), each process pinned to its own half of the host's cores:
#     MODE=engine ENGINE_GPUS="0 1" bash bench/train/gpu_run.sh
#       GPU 0 (first id):  SmolLM2-135M shape (random weights), K=1,4,8,16 engine vs the sequential single-job
#                          trainer + the 16-config early-exit sweep, --time-limit 420
#                          -> $OUT/train_engine_smollm2.json  $OUT/train_engine_smollm2.log
#       GPU 1 (second id): Llama-3.1-8B shape (32 layers, random bf16 built on the GPU, no checkpoint), K=1,4,8
#                          engine vs sequential trainer, --time-limit 420 (about 260 s; K=16 alone needs ~280 s:
#                          LLAMA8B_ARGS="--ks 16")
#                          -> $OUT/train_engine_llama8b.json  $OUT/train_engine_llama8b.log
#       (one id only: both on that GPU one after the other, 8B first, the SmolLM2 run gets the time left)
#   Call 4, 2 GPUs (about 120-200 s):
#     MODE=pvd PVD_GPUS="0 1" bash bench/train/gpu_run.sh
#       the engine's 2-stage LoRAPP pipeline vs its 2-rank data parallel mode, K=1,2,4,8, NCCL, --time-limit 200
#                          -> $OUT/train_pipeline_vs_dp.json  $OUT/train_pipeline_vs_dp.log
#   One GPU, one call per column (about 300-550 s each; b8 with the peer about 580 s: keep CALL_LIMIT_S at 590 or
#   mLoRA's K=8 run is cut): the training table at the 8B shape, every row of a column side by side in one call:
#     MODE=table TABLE_COLUMN=b8|b32|s2048|s2048gc [MLORA_SRC=/path/to/mLoRA] bash bench/train/gpu_run.sh
#       the plain PEFT loop and `bdlora train` (bench_trainer.py, lora_backend auto with Liger), then the engine at
#       K = 1, 4, 8 (bench_engine.py --no-seq-trainer: its engine-at-one-job figure over the first 4 jobs beside),
#       then (b8, with MLORA_SRC) mLoRA on the same jobs as the engine (peer_mlora.py); the trainer and engine rows
#       train on the same records (bench_trainer's plain text; --trainer-data), the peer's on instructions
#                          -> $OUT/table_trainer_<col>.jsonl  $OUT/table_engine_<col>.json  $OUT/table_peer.json
#       b8: batches of 8 x 30-250 tokens; b32: 32 x 30-250; s2048: 4 x 2048 tokens; s2048gc: the same with
#       gradient checkpointing of every layer (TABLE_GC_EVERY=N: every N-th; the plain loop checkpoints every one)
#       TABLE_ENGINE_ARGS="--ks 1,4 --repeats 3": the engine rows measured three times in turn, the JSON's "paired"
#       giving each repeat's K=4 / one-job ratio (median, min, max) where one run's spread hides the effect;
#       TABLE_TRAINER_BACKENDS (default auto+liger,auto+liger+packing at b8 and b32: the trainer with padded and
#       with padding-free batches, the engine's rows being packed; auto+liger at s2048; e.g.
#       auto+liger,auto+liger+cudnn: sdpa without and with cuDNN attention; +masked: packed rows under transformers'
#       block-causal mask instead of varlen flash attention) and TABLE_TRAINER_ARGS (e.g. "--repeats 2") for the
#       trainer rows; TABLE_ENGINE_ARGS="--masked-attention" the same for the engine's rows
#   One GPU, one call per column (about 260-400 s each): the trainer compiled (training_args.torch_compile,
#   lora_backend cublas: the BD layer as a custom op inside the graph) beside the trainer uncompiled and the engine,
#   side by side:
#     MODE=compiled [COMPILED_COLUMN=b8|b32] bash bench/train/gpu_run.sh
#       (b8) the GPU test of the compiled layer against PEFT's, then bench_engine.py at one job (--ks 1
#       --engine-seq-jobs 1) and bench_trainer.py: the plain loop, auto+liger and cublas+regional (accelerate's
#       regional compilation); (b32) the same with packed batches (auto+liger+packing, cublas+regional+packing) and
#       the engine at K = 1 and 4. COMPILED_BACKENDS overrides the trainer rows (e.g. adding cublas+compile, the whole
#       model: its warm-up did not finish in the ~4 minutes left after the other rows at b8)
#                          -> $OUT/compiled_tests.log  $OUT/compiled_trainer_<col>.jsonl  $OUT/compiled_engine_<col>.json
#   One GPU, one call (about 400 s): packed attention (train/attention.py) against transformers' mask, side by side:
#     MODE=packed [PACKED_COLUMN=b32|b8] bash bench/train/gpu_run.sh
#       its GPU tests (the flash route against the reference route, a bf16 sweep against attn_implementation: sdpa),
#       then at the column's batches `bdlora train` with packing: true with varlen flash attention and with sdpa's
#       mask (+masked), then the engine at K = 1, 4 both ways (--masked-attention)
#                          -> $OUT/packed_tests.log  $OUT/packed_trainer_<col>.jsonl  $OUT/packed_engine_<col>.json
#                             $OUT/masked_engine_<col>.json  $OUT/packed_<col>.log
#
# Extra bench arguments: SMOLLM2_ARGS, LLAMA8B_ARGS, PVD_ARGS (e.g. LLAMA8B_ARGS="--num-layers 16").
# CALL_LIMIT_S (default 590): every python run is killed (timeout) before the device call's limit; the JSON files
# are written after each experiment ("partial": true until the run ends), so a killed run still returns numbers.
# Everything the call wrote is also packed into $OUT/results.tgz at its end.
# Needs python3 with torch, transformers, peft, accelerate and safetensors (the GPU image has them) and, for
# MODE=table and MODE=compiled, liger-kernel (`pip install liger-kernel`, or its wheel carried to the GPU machine);
# /tmp/site, the extracted vLLM bundle, is put first on PYTHONPATH when present; no network. Installs this checkout (pip -e, no deps) if bdlora.train.engine is not importable.
set -uo pipefail
T0=$(date +%s)
LIMIT=${CALL_LIMIT_S:-590}
MODE=${MODE:-${1:-}}
O=${OUT:-/tmp/out}; mkdir -p "$O"
cd "$(dirname "$0")/../.." || exit 3
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
kill_after() { local l=$(( $(left) - 5 )); [ "$l" -lt 10 ] && l=10; echo "$l"; }  # timeout for a python run

env_report() {  # into the log given as $1
  {
    echo "== $(date -u +%FT%TZ) mode=$MODE host=$(hostname) CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-}"
    git log -1 --format='checkout %H %s' 2>/dev/null
    # the copy of a working tree may carry an older commit than its files
    echo "tracked files differing from it: $(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)"
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader 2>&1
    python3 - <<'EOF' 2>&1
import importlib.metadata as m, torch
print("python torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")
for p in ("transformers", "peft", "accelerate", "safetensors", "tokenizers", "triton"):
    try:
        print(" ", p, m.version(p))
    except Exception as e:
        print(" ", p, "MISSING", e)
EOF
  } >>"$1"
}

if ! python3 -c "import bdlora.train.engine, bdlora.train.trainer" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$O/train_pip.log" 2>&1 \
    || { echo "pip install -e . failed (see $O/train_pip.log)"; exit 5; }
  rm -f "$O/train_pip.log"
fi

# Two benchmark processes side by side each get their own half of the host's cores (and OMP_NUM_THREADS): unpinned,
# two 8B-shape runs took 4x longer to warm up and ran their K=1 rounds up to 3x slower (2026-11-22, 2x H200).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
half() {  # $1 = 0 or 1: "taskset -c <that half of the cores>" (nothing when taskset is missing)
  command -v taskset >/dev/null || return 0
  local h=$(( $(nproc) / 2 ))
  [ "$h" -ge 1 ] || return 0
  [ "$1" = 0 ] && echo "taskset -c 0-$(( h - 1 ))" || echo "taskset -c $h-$(( 2 * h - 1 ))"
}

run_smollm2() {  # $1 = GPU id, $2 = time limit (s), $3 = core half (0/1)
  local log="$O/train_engine_smollm2.log"
  CUDA_VISIBLE_DEVICES=$1 env_report "$log"
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(kill_after)" $(half "${3:-0}") python3 bench/train/bench_engine.py \
    --random-smollm2-shape --time-limit "$2" --out "$O/train_engine_smollm2.json" ${SMOLLM2_ARGS:-} >>"$log" 2>&1
  echo "smollm2 (GPU $1) rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
}

run_llama8b() {  # $1 = GPU id, $2 = time limit (s), $3 = core half (0/1)
  local log="$O/train_engine_llama8b.log"
  CUDA_VISIBLE_DEVICES=$1 env_report "$log"
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$(kill_after)" $(half "${3:-1}") python3 bench/train/bench_engine.py \
    --shape llama8b --time-limit "$2" --out "$O/train_engine_llama8b.json" ${LLAMA8B_ARGS:-} >>"$log" 2>&1
  echo "llama8b (GPU $1) rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
}

case "$MODE" in
  engine)
    read -r -a G <<<"${ENGINE_GPUS:-2 3}"
    if [ "${#G[@]}" -ge 2 ]; then
      run_smollm2 "${G[0]}" 420 0 &
      P1=$!
      run_llama8b "${G[1]}" 420 1 &
      P2=$!
      wait "$P1" "$P2"
    else
      run_llama8b "${G[0]}" 280 0
      run_smollm2 "${G[0]}" $(( $(left) - 40 )) 0
    fi
    ;;
  pvd)
    read -r -a G <<<"${PVD_GPUS:-0 1}"
    [ "${#G[@]}" -ge 2 ] || { echo "PVD_GPUS needs 2 GPU ids"; exit 2; }
    log="$O/train_pipeline_vs_dp.log"
    export CUDA_VISIBLE_DEVICES="${G[0]},${G[1]}"
    env_report "$log"
    timeout -k 10 "$(kill_after)" python3 bench/train/bench_engine.py --pipeline-vs-dp \
      --out "$O/train_pipeline_vs_dp.json" ${PVD_ARGS:-} >>"$log" 2>&1
    echo "pipeline-vs-dp (GPUs ${G[0]},${G[1]}) rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
    ;;
  table)
    col=${TABLE_COLUMN:-b8}
    case "$col" in
      # batches of 30-250 tokens: new shapes bring Triton specializations (compiles of ~0.5 s) for many steps
      b8) targs=(--batch 8 --steps 16 --warmup 10); eargs=(--batch-size 8 --trainer-data --warmup-steps 8)
          tback=auto+liger,auto+liger+packing ;;
      # b32: the trainer rows twice in one process, the second on a warm Triton cache (first-run compiles cost
      # 9% of the packing row's rate), as the engine's rows run after its own warm-up jobs
      b32) targs=(--batch 32 --steps 12 --warmup 10 --repeats 2); eargs=(--batch-size 32 --trainer-data --warmup-steps 8)
           tback=auto+liger,auto+liger+packing ;;
      s2048) targs=(--seq 2048 --batch 4 --steps 8 --warmup 3); eargs=(--seq 2048 --batch-size 4); tback=auto+liger ;;
      s2048gc) targs=(--seq 2048 --batch 4 --steps 8 --warmup 3 --grad-ckpt --grad-ckpt-every "${TABLE_GC_EVERY:-1}")
               eargs=(--seq 2048 --batch-size 4 --grad-ckpt-every "${TABLE_GC_EVERY:-1}"); tback=auto+liger ;;
      *) echo "TABLE_COLUMN must be b8, b32, s2048 or s2048gc"; exit 2 ;;
    esac
    log="$O/table_$col.log"
    env_report "$log"
    timeout -k 10 "$(kill_after)" python3 bench/train/bench_trainer.py --shape llama8b "${targs[@]}" \
      --lora-backends "${TABLE_TRAINER_BACKENDS:-$tback}" --out "$O/table_trainer_$col.jsonl" --tag "$col" \
      ${TABLE_TRAINER_ARGS:-} >>"$log" 2>&1
    echo "trainer rows ($col) rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
    peer=0; [ "$col" = b8 ] && [ -n "${MLORA_SRC:-}" ] && peer=150  # seconds kept for the peer
    timeout -k 10 "$(kill_after)" python3 bench/train/bench_engine.py --shape llama8b --ks 1,4,8 --no-sweep \
      --no-seq-trainer --steps 10 "${eargs[@]}" --time-limit $(( $(left) - peer - 30 )) \
      --out "$O/table_engine_$col.json" ${TABLE_ENGINE_ARGS:-} >>"$log" 2>&1
    echo "engine rows ($col) rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
    if [ "$peer" -gt 0 ]; then
      timeout -k 10 "$(kill_after)" python3 -m bench.train.peer_mlora --mlora-src "$MLORA_SRC" \
        --out "$O/table_peer.json" >>"$log" 2>&1
      echo "peer rows rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
    fi
    ;;
  compiled)
    col=${COMPILED_COLUMN:-b8}
    case "$col" in
      b8) targs=(--batch 8 --steps 16 --warmup 10); eargs=(--batch-size 8 --ks 1 --engine-seq-jobs 1)
          tback=auto+liger,cublas+regional ;;
      # packed: what the engine runs, and the trainer's fastest rows at this batch
      b32) targs=(--batch 32 --steps 12 --warmup 10); eargs=(--batch-size 32 --ks 1,4)
           tback=auto+liger+packing,cublas+regional+packing ;;
      *) echo "COMPILED_COLUMN must be b8 or b32"; exit 2 ;;
    esac
    log="$O/compiled_$col.log"
    env_report "$log"
    if [ "$col" = b8 ]; then  # b32's rows need the time
      timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider -p no:logging tests/test_peft_kernel_variant.py \
        -k on_gpu >"$O/compiled_tests.log" 2>&1
      echo "compiled layer GPU tests rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
    fi
    # the engine first: the compiled row takes what is left
    timeout -k 10 "$(kill_after)" python3 bench/train/bench_engine.py --shape llama8b \
      --no-sweep --no-seq-trainer --steps 10 --trainer-data --warmup-steps 8 "${eargs[@]}" --time-limit 150 \
      --out "$O/compiled_engine_$col.json" >>"$log" 2>&1
    echo "engine rows ($col) rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
    # recompilations named in the log: what a compiled row's warm-up spends its time on
    TORCH_LOGS=recompiles timeout -k 10 "$(kill_after)" python3 bench/train/bench_trainer.py --shape llama8b \
      "${targs[@]}" --lora-backends "${COMPILED_BACKENDS:-$tback}" \
      --out "$O/compiled_trainer_$col.jsonl" --tag "compiled-$col" >>"$log" 2>&1
    echo "trainer rows ($col) rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
    ;;
  packed)
    col=${PACKED_COLUMN:-b32}
    case "$col" in
      b8) targs=(--batch 8 --steps 16 --warmup 10); eargs=(--batch-size 8) ;;
      b32) targs=(--batch 32 --steps 12 --warmup 10); eargs=(--batch-size 32) ;;
      *) echo "PACKED_COLUMN must be b8 or b32"; exit 2 ;;
    esac
    log="$O/packed_$col.log"
    env_report "$log"
    timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider tests/test_packed_attention.py -k "gpu" \
      >"$O/packed_tests.log" 2>&1
    echo "packed attention GPU tests rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
    timeout -k 10 "$(kill_after)" python3 bench/train/bench_trainer.py --shape llama8b --side trainer "${targs[@]}" \
      --lora-backends auto+liger+packing,auto+liger+packing+masked --out "$O/packed_trainer_$col.jsonl" \
      --tag "packed-$col" >>"$log" 2>&1
    echo "trainer rows ($col) rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
    for variant in packed masked; do
      extra=(); [ "$variant" = masked ] && extra=(--masked-attention)
      timeout -k 10 "$(kill_after)" python3 bench/train/bench_engine.py --shape llama8b --ks 1,4 --no-sweep \
        --no-seq-trainer --steps 10 --trainer-data --warmup-steps 8 "${eargs[@]}" "${extra[@]}" \
        --time-limit $(( ($(left) - 30) / 2 )) --out "$O/${variant}_engine_$col.json" >>"$log" 2>&1
      echo "engine rows ($variant, $col) rc=$? after $(( $(date +%s) - T0 )) s" | tee -a "$log"
    done
    ;;
  *)
    sed -n '2,/^set -uo/{/^set -uo/!p}' "$0"
    echo "MODE must be engine, pvd, table, compiled or packed"; exit 2 ;;
esac
tail -n 12 "$O"/train_*.log "$O"/table_*.log "$O"/compiled_*.log "$O"/packed_*.log 2>/dev/null
ls -l "$O"/train_* "$O"/table_* "$O"/compiled_* "$O"/packed_* "$O"/masked_* 2>/dev/null
# everything in one archive as well: the device tool brings back a limited number of files per call
( cd "$O" && tar czf results.tgz --exclude=results.tgz -- * 2>/dev/null ) && echo "archive $O/results.tgz"
echo "call wall $(( $(date +%s) - T0 )) s"
