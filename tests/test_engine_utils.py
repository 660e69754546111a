"""Helpers of the engine tests: a small alpaca dataset, a run config, and a PEFT single-job reference trainer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F

WORDS = "the a one two three four five red blue green cat dog bird fish tree moon sun star".split()


def write_alpaca(path: Path, n: int = 40, seed: int = 0, chat: bool = False) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ws = [rng.choice(WORDS) for _ in range(rng.randint(2, 9))]
            if chat:
                rec = {"messages": [{"role": "user", "content": "reverse: " + " ".join(ws)},
                                    {"role": "assistant", "content": " ".join(ws[::-1])}]}
            else:
                rec = {"instruction": "reverse the words", "input": " ".join(ws), "output": " ".join(ws[::-1])}
            f.write(json.dumps(rec) + "\n")
    return path


def run_dict(model_dir, data, out, jobs, defaults=None, **kw) -> dict:
    """A run file's mapping: ``defaults`` (job keys, default: 3 steps of 4 examples at lr 1e-3, max_length 64) and
    ``kw`` at the top level. nblocks 1 and a constant schedule without warm-up: the jobs these tests were written
    for (TrainConfig's defaults are nblocks 2 and a linear schedule with a 5% warm-up)."""
    d = {"model": str(model_dir), "output_dir": str(out), "token_budget": 256, "eval_every": 2,
         "train_file": str(data), "eval_fraction": 0.2, "log_every": 10**6, "save_plots": False,
         "nblocks": 1, "scheduler": "constant", "warmup_ratio": 0.0,
         **(defaults if defaults is not None else {"max_steps": 3, "batch_size": 4, "lr": 1e-3, "max_length": 64}),
         "jobs": jobs}
    d.update(kw)
    return d


def peft_train_alone(model_dir, init_adapter_dir, job, samples, total_steps: int, sampler, step_seed=None):
    """Trains one job alone with PEFT (padded batches, attention mask): the reference of BatchLoRA equality.

    ``step_seed(step)``: LoRA dropout on (PEFT's lora_dropout modules in train mode), torch's RNG seeded with it
    for each step's forwards (the engine's per-micro-batch seed, for a step of one micro-batch)."""
    import contextlib

    from peft import PeftModel

    from bdlora.train.engine.multilora import dropout_rng
    from transformers import AutoModelForCausalLM, get_scheduler

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.eval()
    model = PeftModel.from_pretrained(base, init_adapter_dir, is_trainable=True)
    model.eval()
    if step_seed is not None:
        for name, m in model.named_modules():
            if "lora_dropout" in name:
                m.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=job.lr, betas=tuple(job.adam_betas), eps=job.adam_eps,
                            weight_decay=job.weight_decay)
    sched = get_scheduler(job.scheduler, opt, num_warmup_steps=job.warmup_for(total_steps),
                          num_training_steps=total_steps)
    losses = []
    for step in range(total_steps):
        rng = dropout_rng(step_seed(step)) if step_seed is not None else contextlib.nullcontext()
        rng.__enter__()
        idx = sampler.next_batch()
        chunks = [idx[i:i + job.batch_size] for i in range(0, len(idx), job.batch_size)]
        n_targets = sum(samples[i].n_targets for i in idx)
        total = 0.0
        for ch in chunks:
            batch = [samples[i] for i in ch]
            L = max(len(s) for s in batch)
            ids = torch.zeros(len(batch), L, dtype=torch.long)
            att = torch.zeros(len(batch), L, dtype=torch.long)
            lab = torch.full((len(batch), L), -100, dtype=torch.long)
            for r, s in enumerate(batch):
                ids[r, :len(s)] = torch.tensor(s.input_ids)
                att[r, :len(s)] = 1
                for t in range(len(s)):
                    if s.loss_mask[t]:
                        lab[r, t] = s.input_ids[t]
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1), ignore_index=-100,
                                   reduction="sum") / n_targets
            loss.backward()
            total += float(loss.detach())
        rng.__exit__(None, None, None)
        if job.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, job.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses
