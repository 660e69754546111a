"""Where a trainer-like step goes at the 8B shape: wall vs GPU kernel time, top CPU ops."""
import sys, time, torch
from transformers import AutoModelForCausalLM
from peft import get_peft_model
from bdlora import BDLoraSpec, prepare_bd_model

model_dir, batch, seqlen, backend = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
spec = BDLoraSpec.from_preset("llama", nblocks=4, r=64, lora_alpha=16)
model = prepare_bd_model(get_peft_model(base, spec.to_peft_config(task_type="CAUSAL_LM")), spec, lora_backend=backend)
for p in model.parameters():
    if p.requires_grad:
        p.data = p.data.float()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
ids = torch.randint(0, 32000, (batch, seqlen), device="cuda")
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(3):
    step()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(5):
    step()
torch.cuda.synchronize()
wall = (time.perf_counter() - t) / 5
# host time alone: launch without waiting
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
ka = prof.key_averages()
gpu = sum(e.self_device_time_total for e in ka) / 1e6
print(f"backend={backend} batch={batch} seq={seqlen} wall/step={wall:.4f}s tok/s={batch*seqlen/wall:.0f} gpu_kernel_s={gpu:.4f} peak={torch.cuda.max_memory_allocated()/2**30:.1f}GiB")
print(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
print(ka.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
