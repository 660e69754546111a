#!/bin/bash
# FSDP2 for bdlora train across GPUs (one call on a machine with 2 or 4 GPUs; results under $OUT):
#   1. tests/test_train_fsdp.py: the tiny model under examples/accelerate/fsdp2_1node.yaml equals one process on 2 (and
#      4) GPUs; kill -9 of the whole launch then resume is bit-identical;
#   2. the Llama-3.1-8B shape (random bf16, bench_trainer.py's model and job mix): one GPU, then FSDP2 on each process
#      count in NPROCS (default: every GPU count of 2 and 4 the machine has) with the same global batch of 8; each run
#      prints its losses, tokens/s and every GPU's peak memory, and its metrics.jsonl is kept.
set -uo pipefail
O=${OUT:-/tmp/out}; mkdir -p "$O"; cd "$(dirname "$0")/../.." || exit 3
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
gpus=$(nvidia-smi -L | wc -l)
NPROCS=${NPROCS:-$(for n in 2 4; do [ "$n" -le "$gpus" ] && echo -n "$n "; done)}
if [ "${FSDP_TEST:-1}" != 0 ]; then  # FSDP_TEST=0: the 8B runs only
  python3 -m pytest tests/test_train_fsdp.py -q -p no:cacheprovider > "$O/fsdp_test.log" 2>&1; tail -3 "$O/fsdp_test.log"
fi
NPROCS="$NPROCS" python3 - <<'PY'
import os, sys, yaml
sys.path.insert(0, "bench/train")
from pathlib import Path
from bench_trainer import build_data, build_model
m = build_model("llama8b", Path("/tmp/fsdp8b/model"))
d = build_data(Path("/tmp/fsdp8b/data.jsonl"), m, 8 * 40, 30, 250)
for name, bs in [("one", 8)] + [(f"fsdp{n}", 8 // int(n)) for n in os.environ["NPROCS"].split()]:
    Path(f"/tmp/fsdp8b/{name}.yaml").write_text(yaml.safe_dump(dict(
        model=str(m), train_file=str(d), data_format="text", eval_fraction=0.0, nblocks=4, r=64, lora_alpha=16,
        precision="bf16", batch_size=bs, max_steps=20, lr=1e-4, scheduler="constant", warmup_steps=0,
        max_length=258, output_dir=f"/tmp/fsdp8b/out-{name}", progress=False, report_to=[], log_every=1)))
PY
python3 -m bdlora.train --config /tmp/fsdp8b/one.yaml 2>&1 | grep "^bdlora train" | tee "$O/fsdp8b_one.log"
for n in $NPROCS; do
  python3 -m accelerate.commands.launch --config_file examples/accelerate/fsdp2_1node.yaml --num_processes "$n" \
    -m bdlora.train --config "/tmp/fsdp8b/fsdp$n.yaml" 2>&1 | grep -E "^bdlora train|Error|error" | tail -8 \
    | tee "$O/fsdp8b_fsdp$n.log"
done
for n in one $(for n in $NPROCS; do echo -n "fsdp$n "; done); do
  cp "/tmp/fsdp8b/out-$n/metrics.jsonl" "$O/fsdp8b_${n}_metrics.jsonl" 2>/dev/null
done
