"""The quality benchmark's runs trained as one ``bdlora sweep`` per task (the multi-LoRA engine), then scored.

Every (method, N, rank, seed) run of a task is one job of one engine run over the frozen base: LoRA is the engine's
N = 1 job (one block: PEFT's rsLoRA adapter, same init and scale), BD-LoRA the N-block jobs at the matched rank.
A job's ``seed`` sets its init and data order, so LoRA and BD runs of one seed see the same batches (the paired
comparison). The engine writes one PEFT folder per job; each is then loaded onto the base with PEFT and scored by
:mod:`bench.quality.metrics`, exactly as the base row. One line per engine run goes to ``OUT/sweeps.jsonl``
(jobs, steps, tokens, wall-clock, device): the time the whole grid took on one GPU.

The engine trains ``active_jobs`` runs at a time in plan order, so runs finish in waves (whole seeds of the curve
first) and are scored as they finish (:func:`train_and_score`). Resumable at two levels: a scored run is in
``results.jsonl`` and is neither trained nor scored again; the engine run resumes from its own checkpoint
(``resume: auto``, written at the end of each invocation of ``chunk_rounds`` rounds) when a call ended inside it.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable, Optional

from .metrics import device_name, eval_loss, load_kbit_scoring_model, load_scoring_model, task_metrics
from .results import append_row

SWEEPS = "sweeps.jsonl"
QUALITY_RUN = "quality_run.json"  # an engine run's run file, beside its checkpoint


def sweep_dir(out: Path, task: str, names: list[str]) -> Path:
    """One folder per (task, set of jobs): a later call with other jobs left starts its own engine run."""
    digest = hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()[:10]
    return out / "sweeps" / f"{task}-{digest}"


def run_file(runs: list[tuple], names: list[str], p: dict, files: dict, model: str, folder: Path, device: str
             ) -> dict:
    """The ``bdlora sweep`` run file (as a dict) of a task's runs: shared keys at the top, one job per run. Runs on
    a 4-bit base (all of them or none) share one base quantized by the engine (``load_in_4bit``)."""
    from .run import is_bd, is_kbit

    jobs = [{"name": name, "nblocks": n if is_bd(method) else 1, "r": rank, "seed": seed}
            for name, (_, method, n, rank, seed) in zip(names, runs)]
    kbit = {is_kbit(run[1]) for run in runs}
    if len(kbit) > 1:
        raise ValueError("one engine run trains on one base: 4-bit and unquantized runs go to separate runs")
    return {**({"load_in_4bit": True} if kbit == {True} else {}),
        "model": model, "output_dir": str(folder), "train_file": str(files["train"]), "data_format": "alpaca",
        "eval_fraction": 0.0, "precision": p["precision"], "max_length": p["max_length"], "lr": p["lr"],
        "scheduler": "linear", "warmup_ratio": 0.05, "batch_size": p["batch_size"], "max_steps": p["max_steps"],
        "lora_alpha": 16.0, "lora_dropout": 0.0, "report_to": [], "progress": False, "save_plots": False,
        # the recorded rows ran on the base's own modules: every run of a table under one setting
        "use_liger_kernel": False,
        "resume": "auto", "save_every": 0, "max_rounds": p["chunk_rounds"], "device": device,
        "max_active_jobs": min(len(jobs), p["active_jobs"]),
        "token_budget": max(p["max_length"], p["token_budget"]), "jobs": jobs,
    }


def _engine_run(out: Path, task: str, runs: list[tuple], names: list[str], p: dict, files: dict, model: str,
                device: str) -> tuple[Path, dict]:
    """(folder, run file) of the engine run to continue: an earlier one of this task that holds every run still to
    record and has a checkpoint (a later call on the same machine, after some runs were recorded), else a new one
    for these runs (its run file kept beside it as ``quality_run.json``)."""
    from bdlora.train.engine.checkpoint import CHECKPOINT

    for found in sorted((out / "sweeps").glob(f"{task}-*/{QUALITY_RUN}")):
        raw = json.loads(found.read_text())
        if set(names) <= {j["name"] for j in raw["jobs"]} and (found.parent / CHECKPOINT).is_file():
            return found.parent, raw
    folder = sweep_dir(out, task, names)
    raw = run_file(runs, names, p, files, model, folder, device)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / QUALITY_RUN).write_text(json.dumps(raw, indent=1))
    return folder, raw


def adapter_params(adapter_dir: Path) -> int:
    """Trainable parameters of a saved adapter: the element count of its tensors (BD blocks are stored packed)."""
    from safetensors import safe_open

    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def train_and_score(task: str, runs: list[tuple], names: list[str], p: dict, files: dict, model: str, out: Path,
                    device: str, dev: str, record: Callable[[dict], None], deadline: Optional[float] = None,
                    log: Callable[[str], None] = print, clock: Callable[[], float] = time.time) -> int:
    """Trains the runs as one engine run, ``p["active_jobs"]`` at a time in plan order (the queue refills a
    finished job's slot), in invocations of ``p["chunk_rounds"]`` rounds that each end on the engine's checkpoint;
    after each, the jobs that finished are scored and recorded. With a ``deadline`` (unix seconds) no invocation
    starts that is expected (the slowest so far, x1.2) to end after it: what finished is recorded, the rest resumes
    from the checkpoint in a later call on this machine. Returns the number of runs recorded."""
    from bdlora.train.engine.config import parse_run
    from bdlora.train.engine.launch import run_engine

    folder, raw = _engine_run(out, task, runs, names, p, files, model, device)
    log(f"sweep {task}: {len(runs)} runs to record, {len(raw['jobs'])} jobs ({raw['max_active_jobs']} at a time) "
        f"in one engine run ({folder})")
    t0, slowest, scored, wanted = clock(), 0.0, set(), set(names)
    from .run import is_kbit

    scorer = Scorer(task, p, files, model, dev, record, kbit=is_kbit(runs[0][1]))
    while True:
        if deadline is not None and clock() + 1.2 * slowest > deadline:
            log(f"sweep {task}: deadline: {len(runs) - len(scored)} runs left for a later call (resumable)")
            break
        c0 = clock()
        rows = run_engine(parse_run(raw, f"quality sweep {task}"))
        rows = {r["job"]: r for r in (rows["jobs"] if isinstance(rows, dict) else rows)}
        slowest = max(slowest, clock() - c0)
        done = {n: r for n, r in rows.items()
                if n in wanted and n not in scored and r.get("status") == "done" and r.get("adapter")}
        scored |= set(done)
        if done:
            scorer.score(runs, names, done)
        if all(r.get("status") == "done" for r in rows.values()):
            append_row(out / SWEEPS, {"task": task, "jobs": len(runs), "folder": str(folder),
                                      "wall_s": round(clock() - t0, 1), "tokens": sum(r.get("tokens") or 0
                                                                                     for r in rows.values()),
                                      "device": device_name(), "steps": p["max_steps"],
                                      "token_budget": raw["token_budget"], "active_jobs": raw["max_active_jobs"]})
            log(f"sweep {task}: {len(runs)} jobs trained and scored in {clock() - t0:.0f} s")
            break
    return len(scored)


class Scorer:
    """Scores trained adapters of one task on one copy of the base: each is loaded onto it through PEFT, scored by
    :mod:`bench.quality.metrics` and removed again; the base is loaded once, at the first adapter. ``kbit``: the
    adapters were trained on a 4-bit base: scored on a 4-bit base, and again on the unquantized base (``bf16_*``)."""

    def __init__(self, task: str, p: dict, files: dict, model: str, dev: str, record: Callable[[dict], None],
                 kbit: bool = False):
        self.task, self.p, self.files, self.model, self.dev, self.record = task, p, files, model, dev, record
        self.kbit = kbit
        self.tokenizer = self.peft_model = None

    def _load(self, name: str, adapter: Path):
        from peft import PeftModel

        if self.peft_model is None:
            load = load_kbit_scoring_model if self.kbit else load_scoring_model
            base, self.tokenizer = load(self.model, self.p["precision"])
            self.peft_model = PeftModel.from_pretrained(base, str(adapter), adapter_name=name)
        else:
            self.peft_model.load_adapter(str(adapter), adapter_name=name)
        self.peft_model.set_adapter(name)
        return self.peft_model

    def score(self, runs: list[tuple], names: list[str], trained: dict[str, dict]) -> int:
        """Scores the runs whose engine row in ``trained`` is done, records their rows; returns how many."""
        from .run import is_bd, score_on_base

        p, files, n = self.p, self.files, 0
        for name, (_, method, nblocks, rank, seed) in zip(names, runs):
            res = trained.get(name)
            if res is None or res.get("status") != "done" or not res.get("adapter"):
                continue
            t0 = time.time()
            adapter = Path(res["adapter"])
            lm = self._load(name, adapter)
            row = {"run_id": name, "task": self.task, "method": method, "nblocks": nblocks if is_bd(method) else None,
                   "rank": rank, "seed": seed, "trainable_params": adapter_params(adapter), "steps": res["steps"],
                   "train_loss": res.get("final_train_loss"), "device": self.dev, "model": self.model,
                   "lr": p["lr"], "batch_size": p["batch_size"], "max_length": p["max_length"],
                   "trainer": "bdlora sweep", "train_time_s": res.get("time_s"),
                   **eval_loss(lm, self.tokenizer, files["eval"], p["max_length"], p["eval_batch_size"])}
            row.update(task_metrics(self.task, lm, self.tokenizer, p, files))
            lm.delete_adapter(name)
            if self.kbit:
                row.update({f"bf16_{k}": v for k, v in score_on_base(self.task, adapter, p, files, self.model).items()})
            row["score_s"] = round(time.time() - t0, 2)
            self.record(row)
            n += 1
        return n
