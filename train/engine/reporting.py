"""What a sweep shows while it runs: a progress bar over every job's optimizer steps (``progress``) and one
tensorboard event folder per job (``report_to: [tensorboard]``, the trainer's default when tensorboard is
installed), fed from the jobs' loss histories after each round. Only the main process reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional


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
