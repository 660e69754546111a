"""What a sweep shows and leaves: a progress bar over every job's optimizer steps (``progress``) and one
tensorboard event folder per job (``report_to: [tensorboard]``, the trainer's default when tensorboard is
installed), fed from the jobs' loss histories after each round; the progress lines, the result rows
(``results.csv``), the final table and the loss plots. Only the main process reports."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path
from typing import Optional

RESULTS_CSV = "results.csv"
RESULT_FIELDS = ["job", "status", "stop_reason", "r", "lora_alpha", "nblocks", "lr", "batch_size", "steps",
                 "total_steps", "final_train_loss", "final_eval_loss", "best_eval_loss", "best_step", "tokens",
                 "time_s", "adapter"]


def wants_tensorboard(report_to: Optional[list[str]]) -> bool:
    """``report_to`` as the trainer reads it: None means tensorboard when it is installed."""
    if report_to is None:
        return importlib.util.find_spec("tensorboard") is not None
    return "tensorboard" in report_to


class RunReporter:
    """Progress bar and per-job tensorboard writers of one run; ``after_round`` after every round, ``close`` at
    the end (also on a stop after ``max_rounds``)."""

    def __init__(self, jobs, out: Path, progress: bool, main_process: bool):
        self.jobs = jobs
        self.bar = None
        self.writers = {}
        self.sent: dict[tuple[str, str], int] = {}  # (job, series) -> history points already written
        if not main_process:
            return
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=sum(j.total_steps for j in jobs), desc="bdlora sweep", unit="step",
                            initial=sum(j.step for j in jobs), dynamic_ncols=True)
        for j in jobs:
            if wants_tensorboard(j.cfg.report_to):
                from torch.utils.tensorboard import SummaryWriter

                self.writers[j.name] = SummaryWriter(log_dir=str(out / "runs" / j.name))

    def after_round(self) -> None:
        if self.bar is not None:
            self.bar.n = sum(min(j.step, j.total_steps) if j.status != "done" else j.total_steps for j in self.jobs)
            self.bar.refresh()
        for j in self.jobs:
            w = self.writers.get(j.name)
            if w is None:
                continue
            for series, tag in (("train", "train/loss"), ("val", "eval/loss")):
                points = j.history[series]
                start = self.sent.get((j.name, series), 0)
                for step, value in points[start:]:
                    w.add_scalar(tag, value, step)
                self.sent[(j.name, series)] = len(points)
            w.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for w in self.writers.values():
            w.close()
        self.writers = {}


def result_row(job) -> dict:
    """The job's row of ``results.csv``: its settings, how far it got, its losses and its adapter folder."""
    c = job.cfg
    vals = [v for _, v in job.history["val"]]
    best = min(vals) if vals else None
    best_step = job.history["val"][vals.index(best)][0] if vals else None
    return {
        "job": job.name, "status": job.status, "stop_reason": job.reason, "r": c.r, "lora_alpha": c.lora_alpha,
        "nblocks": c.nblocks, "lr": c.lr, "batch_size": c.step_samples, "steps": job.step,
        "total_steps": job.total_steps,
        "final_train_loss": job.history["train"][-1][1] if job.history["train"] else None,
        "final_eval_loss": vals[-1] if vals else None, "best_eval_loss": best, "best_step": best_step,
        "tokens": job.tokens, "time_s": round(job.time_s, 3), "adapter": job.adapter_path,
    }


def result_rows(jobs) -> list[dict]:
    """Every job's row: its final row where it finished, its row so far otherwise."""
    return [j.result if j.result is not None else result_row(j) for j in jobs]


def write_results_csv(out: Path, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / RESULTS_CSV, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in RESULT_FIELDS})


def progress_text(round_no: int, round_log: list[dict], active: list, info: dict) -> str:
    """One header line for the round (its tokens/s over its training time, from ``round_log``), then one line
    per active job: step, last train and validation loss, the job's tokens/s over its time in the engine
    (rounds it shared, evaluations included), status."""
    last = round_log[-1] if round_log else {}
    rate = f", {info['tokens'] / last['train_s']:,.0f} tok/s" if last.get("train_s") else ""
    lines = [f"round {round_no}: {len(active)} active, {info['microbatches']} micro-batches, "
             f"{info['tokens']} tokens{rate}"]
    for j in active:
        val = f"{j.history['val'][-1][1]:.4f}" if j.history["val"] else "-"
        tr = j.history["train"][-1][1] if j.history["train"] else float("nan")
        tps = f"{j.tokens / j.time_s:,.0f}" if j.time_s > 0 else "-"
        status = j.status if j.status != "done" else f"done:{j.reason}"
        lines.append(f"  {j.name[:40]:40s} {j.step:5d}/{j.total_steps:<5d} train {tr:8.4f} val {val:>8s} "
                     f"{tps:>8s} tok/s {status}")
    return "\n".join(lines)


def plot_job(job, path: Path) -> Optional[Path]:
    """Loss curves (train, its EMA, validation) as PNG; returns None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    h = job.history
    if h["train"]:
        ax.plot(*zip(*h["train"]), label="train", alpha=0.5)
    if h["ema"]:
        ax.plot(*zip(*h["ema"]), label="train (EMA)")
    if h["val"]:
        ax.plot(*zip(*h["val"]), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{job.name} ({job.reason})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def format_table(rows: list[dict]) -> str:
    cols = ["job", "stop_reason", "r", "nblocks", "lr", "steps", "final_eval_loss", "best_eval_loss", "tokens",
            "time_s"]

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    table = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    widths[1] = min(widths[1], 40)
    line = lambda cells: "  ".join(str(c)[:w].ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(t) for t in table])
