"""Token-budget packing of samples from several jobs into micro-batches (first-fit decreasing, job by job).

A micro-batch holds one row per job (jobs in a fixed order): a job's samples are packed one after another in its
row, each sample its own sequence (position ids restart, attention is block-causal), and every row is padded to the
micro-batch's row length (a multiple of ``pad_multiple``) with a dummy sequence that has no targets. Flattened, each
job is one contiguous token segment (the grouped LoRA kernel's row segment; with ``pad_multiple`` a multiple of the
kernel tile, tiles never straddle two adapters). Rows, not one long packed row, so that attention never mixes
jobs even numerically: a diverging job's inf/NaN activations cannot reach the other jobs (0 * inf in a masked
attention product would). The cost of a micro-batch is ``rows * row_length`` (its padded size), within the budget.
Deterministic: the result depends only on the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class Item:
    job: int  # job slot index (defines the segment order inside a micro-batch)
    index: int  # sample index inside that job's dataset
    length: int


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def bin_cost(job_tokens: dict[int, int], pad_multiple: int = 1) -> int:
    """Padded size of a micro-batch: one row per job, every row as long as the longest (rounded up)."""
    if not job_tokens:
        return 0
    return len(job_tokens) * _round_up(max(job_tokens.values()), pad_multiple)


def pack_ffd(items: Sequence[Item], budget: int, pad_multiple: int = 1) -> list[list[Item]]:
    """First-fit decreasing bin packing of ``items`` under ``budget`` padded tokens per bin, job by job:

    1. a job whose items together exceed one bin is packed alone first (its items by decreasing length into the
       first of its own bins with room), so it spans as few micro-batches as it can;
    2. every other job is one unit (one row, all its items): units by decreasing size into the first bin with room
       (the partly filled bins of step 1 included), else a new bin.

    Keeping a job in one micro-batch keeps the (job, micro-batch) segments near the number of jobs, and each
    segment costs a set of LoRA launches per layer, what bounds an 8B-shape step on the host (item-by-item FFD
    spread 8 jobs over 2 micro-batches as 16 segments).
    Returns bins whose items are ordered by (job, original order); every item appears exactly once. An item longer
    than the budget gets a bin of its own (callers truncate samples to at most the budget).
    """
    by_job: dict[int, list[int]] = {}
    for i, it in enumerate(items):
        by_job.setdefault(it.job, []).append(i)
    job_tokens = {j: sum(items[i].length for i in idxs) for j, idxs in by_job.items()}
    bins: list[list[int]] = []
    tokens: list[dict[int, int]] = []

    def place(idxs: list[int], job: int, n_tokens: int, among: range) -> None:
        """Into the first bin of ``among`` with room for ``n_tokens`` more of ``job``, else a new bin."""
        for b in among:
            trial = dict(tokens[b])
            trial[job] = trial.get(job, 0) + n_tokens
            if bin_cost(trial, pad_multiple) <= budget:
                bins[b].extend(idxs)
                tokens[b] = trial
                return
        bins.append(list(idxs))
        tokens.append({job: n_tokens})

    units = []
    for job in sorted(by_job, key=lambda j: (-job_tokens[j], j)):
        if bin_cost({job: job_tokens[job]}, pad_multiple) <= budget:
            units.append(job)
            continue
        own = len(bins)  # this job's bins start here
        for i in sorted(by_job[job], key=lambda i: (-items[i].length, i)):
            place([i], job, items[i].length, range(own, len(bins)))
    for job in units:  # already in decreasing size
        place(by_job[job], job, job_tokens[job], range(len(bins)))
    # micro-batch order: by the first (job, position) they hold; items inside by (job, original order)
    out = [sorted(b, key=lambda i: (items[i].job, i)) for b in bins]
    out.sort(key=lambda b: (items[b[0]].job, b[0]))
    return [[items[i] for i in b] for b in out]


@dataclass
class MicroBatch:
    """One micro-batch: a (rows, L) block, one row per job. ``segments``: (job, start, end) ranges of the
    flattened (rows*L) tokens, contiguous and in job order.

    ``targets[job]``: (positions, labels) — the flattened hidden state at ``positions`` predicts ``labels``.
    """

    input_ids: torch.Tensor  # (rows, L)
    position_ids: torch.Tensor  # (rows, L)
    segments: list[tuple[int, int, int]]
    targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    n_items: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def n_targets(self, job: int) -> int:
        t = self.targets.get(job)
        return 0 if t is None else int(t[1].numel())

    def to(self, device) -> "MicroBatch":
        return MicroBatch(self.input_ids.to(device), self.position_ids.to(device), self.segments,
                          {j: (p.to(device), l.to(device)) for j, (p, l) in self.targets.items()}, self.n_items)


def build_microbatch(bin_items: Sequence[Item], samples_of, pad_id: int = 0, pad_multiple: int = 1) -> MicroBatch:
    """Tensors of one bin. ``samples_of(job)`` returns that job's sample list (``Sample`` objects)."""
    rows: list[tuple[int, list[int], list[int], list[int], list[int]]] = []  # job, ids, pos, tpos, tlab
    i = 0
    while i < len(bin_items):
        job = bin_items[i].job
        ids: list[int] = []
        pos: list[int] = []
        tp: list[int] = []
        tl: list[int] = []
        while i < len(bin_items) and bin_items[i].job == job:
            s = samples_of(job)[bin_items[i].index]
            base = len(ids)
            ids.extend(s.input_ids)
            pos.extend(range(len(s.input_ids)))
            for t in range(1, len(s.input_ids)):
                if s.loss_mask[t]:
                    tp.append(base + t - 1)
                    tl.append(s.input_ids[t])
            i += 1
        rows.append((job, ids, pos, tp, tl))
    L = _round_up(max(len(r[1]) for r in rows), pad_multiple)
    all_ids, all_pos, segments, targets = [], [], [], {}
    for r, (job, ids, pos, tp, tl) in enumerate(rows):
        pad = L - len(ids)
        all_ids.append(ids + [pad_id] * pad)
        all_pos.append(pos + list(range(pad)))  # a separate dummy sequence: attends only to itself, no targets
        segments.append((job, r * L, (r + 1) * L))
        targets[job] = (torch.tensor([r * L + p for p in tp], dtype=torch.long), torch.tensor(tl, dtype=torch.long))
    return MicroBatch(torch.tensor(all_ids, dtype=torch.long), torch.tensor(all_pos, dtype=torch.long), segments,
                      targets, n_items=len(bin_items))


def plan_microbatches(requests: Sequence[tuple[int, Sequence[int]]], lengths_of, budget: int,
                      pad_multiple: int = 1) -> list[list[Item]]:
    """Packs ``[(job, [sample indices])]`` into bins; ``lengths_of(job)`` gives that job's sample lengths."""
    items = [Item(job, idx, int(lengths_of(job)[idx])) for job, idxs in requests for idx in idxs]
    return pack_ffd(items, budget, pad_multiple)


__all__ = ["Item", "MicroBatch", "bin_cost", "build_microbatch", "pack_ffd", "plan_microbatches"]
