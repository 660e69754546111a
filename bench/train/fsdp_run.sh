#!/bin/bash
# FSDP2 for bdlora train on 2 GPUs (one device call on a 2-GPU machine; results under $OUT):
#   1. tests/test_train_fsdp.py: the tiny model under examples/accelerate/fsdp2_1node.yaml equals one process;
#   2. the Llama-3.1-8B shape (random bf16, bench_trainer.py's model and job mix): one GPU, then FSDP2 on 2 GPUs
#      with the same global batch (8 = 2 x 4); each run prints its losses, tokens/s and every GPU's peak memory.
set -uo pipefail
O=${OUT:-/tmp/out}; mkdir -p "$O"; cd "$(dirname "$0")/../.." || exit 3
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pytest tests/test_train_fsdp.py -q -x -p no:cacheprovider > "$O/fsdp_test.log" 2>&1; tail -3 "$O/fsdp_test.log"
python3 - <<'PY'
import sys, yaml
sys.path.insert(0, "bench/train")
from pathlib import Path
from bench_trainer import build_data, build_model
m = build_model("llama8b", Path("/tmp/fsdp8b/model"))
d = build_data(Path("/tmp/fsdp8b/data.jsonl"), m, 8 * 40, 30, 250)
for name, bs in (("one", 8), ("fsdp", 4)):
    Path(f"/tmp/fsdp8b/{name}.yaml").write_text(yaml.safe_dump(dict(
        model=str(m), train_file=str(d), data_format="text", eval_fraction=0.0, nblocks=4, r=64, lora_alpha=16,
        precision="bf16", batch_size=bs, max_steps=20, lr=1e-4, scheduler="constant", warmup_steps=0,
        max_length=258, output_dir=f"/tmp/fsdp8b/out-{name}", progress=False, report_to=[], log_every=1)))
PY
python3 -m bdlora.train --config /tmp/fsdp8b/one.yaml 2>&1 | grep "^bdlora train" | tee "$O/fsdp8b_one.log"
python3 -m accelerate.commands.launch --config_file examples/accelerate/fsdp2_1node.yaml --num_processes 2 \
  -m bdlora.train --config /tmp/fsdp8b/fsdp.yaml 2>&1 | grep -E "^bdlora train|Error|error" | tail -8 | tee "$O/fsdp8b_fsdp.log"
for n in one fsdp; do cp /tmp/fsdp8b/out-$n/metrics.jsonl "$O/fsdp8b_${n}_metrics.jsonl" 2>/dev/null; done
