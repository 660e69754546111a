"""Token-budget packing of samples from several jobs into micro-batches (first-fit decreasing, job by job).

A micro-batch is a (rows, L) block. Each job's samples fill rows of their own (jobs in a fixed order, a job's rows
adjacent): a row holds one or more samples one after another, each its own sequence (position ids restart, attention
is block-causal), and no row is longer than the bin's longest sample or ``MIN_ROW_TOKENS``, whichever is larger.
Every row is padded to L (a multiple of ``pad_multiple``) with a dummy sequence that has no targets. Flattened, each
job is one contiguous token segment (the grouped LoRA kernel's row segment; with ``pad_multiple`` a multiple of the
kernel tile, tiles never straddle two adapters). Rows never mix jobs, so attention never mixes them even
numerically: a diverging job's inf/NaN activations cannot reach the other jobs (0 * inf in a masked attention
product would). Rows are capped because attention over a packed row costs its length squared under a dense mask:
two 2048-token samples in one 4096-token row cost twice the attention of two rows, and a row of one sample that
needs no padding keeps the fused causal attention kernel. The cost of a micro-batch is ``rows * L`` (its padded
size), within the budget. Deterministic: the result depends only on the inputs.

Where attention runs example by example (train/attention.py: varlen flash attention, no mask, no work across
examples, so no job's values reach another's) neither reason for rows holds: ``one_row`` puts the whole micro-batch
in one row, each job's samples end to end and padded to a multiple of ``pad_multiple`` by a dummy sequence of its
own; its cost is the row's length (padding fell from ~25% to ~3% of the tokens at 8 x 30-250 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..attention import packed_sequence_kwargs


@dataclass(frozen=True)
class Item:
    job: int  # job slot index (defines the segment order inside a micro-batch)
    index: int  # sample index inside that job's dataset
    length: int


MIN_ROW_TOKENS = 512  # short samples share rows up to this length: little padding, attention still cheap


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def long_tensor(values) -> torch.Tensor:
    """An int64 tensor of a (nested) list of token ids or positions, through numpy: ~7x faster than
    ``torch.tensor`` on Python lists, which was most of a batch's collation on the host (4 x 2048 tokens: ~2.7 ms)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def row_cap(lengths: Sequence[int]) -> int:
    """The longest a row may be in a bin holding samples of these lengths."""
    return max(max(lengths, default=0), MIN_ROW_TOKENS)


def fill_rows(lengths: Sequence[int], cap: int) -> list[list[int]]:
    """Indices into ``lengths`` grouped into rows of at most ``cap`` tokens: first-fit decreasing (ties by index),
    each row's indices in their original order; a sample longer than ``cap`` gets a row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
        if r is None:
            rows.append([i])
            room.append(cap - lengths[i])
        else:
            rows[r].append(i)
            room[r] -= lengths[i]
    return [sorted(r) for r in rows]


def row_sums(lengths: Sequence[int], cap: int) -> list[int]:
    """The token counts of the rows :func:`fill_rows` makes of ``lengths``."""
    return [sum(lengths[i] for i in r) for r in fill_rows(lengths, cap)]


def bin_cost(job_lengths: dict[int, Sequence[int]], pad_multiple: int = 1, one_row: bool = False) -> int:
    """Padded size of a micro-batch holding, per job, samples of these lengths: its rows (:func:`fill_rows` under
    the bin's :func:`row_cap`) times the longest row, rounded up to ``pad_multiple``; ``one_row``: each job's
    samples end to end, rounded up to ``pad_multiple``, all jobs in one row."""
    if not job_lengths:
        return 0
    if one_row:
        return sum(round_up(sum(ls), pad_multiple) for ls in job_lengths.values())
    cap = row_cap([n for ls in job_lengths.values() for n in ls])
    rows = [t for ls in job_lengths.values() for t in row_sums(ls, cap)]
    return len(rows) * round_up(max(rows), pad_multiple)


class _Bin:
    """A bin being packed: its items and, per job, the sample lengths and row sums, so that a trial costs one job's
    rows only: a sample no longer than the job's others goes into its first row with room (what :func:`fill_rows`
    would do with it last), other trials refill that job's rows, and samples that raise the row cap recount every
    job. Its cost is always :func:`bin_cost` of its lengths."""

    def __init__(self, one_row: bool = False):
        self.one_row = one_row
        self.items: list[int] = []
        self.lengths: dict[int, list[int]] = {}
        self.rows: dict[int, list[int]] = {}  # job -> its rows' token counts
        self.cap = row_cap([])

    def _rows_of(self, job: int, new: list[int], cap: int, memo: dict) -> list[int]:
        old = self.lengths.get(job, [])
        if not old:  # the same samples fill the same rows in every bin of this cap: count them once per placement
            if cap not in memo:
                memo[cap] = row_sums(new, cap)
            return memo[cap]
        if cap == self.cap and len(new) == 1 and new[0] <= min(old):
            rows = list(self.rows[job])
            r = next((r for r, used in enumerate(rows) if used + new[0] <= cap), None)
            if r is None:
                rows.append(new[0])
            else:
                rows[r] += new[0]
            return rows
        return row_sums(old + new, cap)

    def add(self, job: int, idxs: list[int], new: list[int], budget, pad_multiple: int, memo: dict) -> bool:
        """Adds ``idxs`` (lengths ``new``) of ``job`` if the bin stays within ``budget`` (None: always); ``memo``:
        one placement's rows of ``new`` alone, by row cap."""
        if self.one_row:
            tokens = {j: sum(ls) for j, ls in self.lengths.items()}
            tokens[job] = tokens.get(job, 0) + sum(new)
            if budget is not None and sum(round_up(t, pad_multiple) for t in tokens.values()) > budget:
                return False
            self.items.extend(idxs)
            self.lengths[job] = self.lengths.get(job, []) + new
            return True
        cap = max(self.cap, row_cap(new))
        others = self.rows if cap == self.cap else {j: row_sums(ls, cap) for j, ls in self.lengths.items()}
        mine = self._rows_of(job, new, cap, memo)
        n_rows = len(mine) + sum(len(rs) for j, rs in others.items() if j != job)
        longest = max([max(mine)] + [max(rs) for j, rs in others.items() if j != job])
        if budget is not None and n_rows * round_up(longest, pad_multiple) > budget:
            return False
        self.items.extend(idxs)
        self.lengths[job] = self.lengths.get(job, []) + new
        self.rows = {**others, job: mine}
        self.cap = cap
        return True


def pack_ffd(items: Sequence[Item], budget: int, pad_multiple: int = 1, one_row: bool = False) -> list[list[Item]]:
    """First-fit decreasing bin packing of ``items`` under ``budget`` padded tokens per bin, job by job:

    1. a job whose items together exceed one bin is packed alone first (its items by decreasing length into the
       first of its own bins with room), so it spans as few micro-batches as it can;
    2. every other job is one unit (all its items, in its rows): units by decreasing size into the first bin with
       room (the partly filled bins of step 1 included), else a new bin.

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
    bins: list[_Bin] = []

    def place(idxs: list[int], job: int, among: range) -> None:
        """Into the first bin of ``among`` with room for ``idxs`` of ``job``, else a new bin."""
        new, memo = [items[i].length for i in idxs], {}
        for b in among:
            if bins[b].add(job, idxs, new, budget, pad_multiple, memo):
                return
        bins.append(_Bin(one_row))
        bins[-1].add(job, idxs, new, None, pad_multiple, memo)

    units = []
    for job in sorted(by_job, key=lambda j: (-job_tokens[j], j)):
        if bin_cost({job: [items[i].length for i in by_job[job]]}, pad_multiple, one_row) <= budget:
            units.append(job)
            continue
        own = len(bins)  # this job's bins start here
        for i in sorted(by_job[job], key=lambda i: (-items[i].length, i)):
            place([i], job, range(own, len(bins)))
    for job in units:  # already in decreasing size
        place(by_job[job], job, range(len(bins)))
    # micro-batch order: by the first (job, position) they hold; items inside by (job, original order)
    out = [sorted(b.items, key=lambda i: (items[i].job, i)) for b in bins]
    out.sort(key=lambda b: (items[b[0]].job, b[0]))
    return [[items[i] for i in b] for b in out]


@dataclass
class MicroBatch:
    """One micro-batch: a (rows, L) block, each job's rows adjacent. ``segments``: (job, start, end) ranges of the
    flattened (rows*L) tokens, one per job, contiguous and in job order.

    ``targets[job]``: (positions, labels) — the flattened hidden state at ``positions`` predicts ``labels``.
    """

    input_ids: torch.Tensor  # (rows, L)
    position_ids: torch.Tensor  # (rows, L)
    segments: list[tuple[int, int, int]]
    targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    n_items: int = 0
    #: where the packed examples are, for the forward (train/attention.py ``packed_sequence_kwargs``)
    attention_kwargs: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def n_targets(self, job: int) -> int:
        t = self.targets.get(job)
        return 0 if t is None else int(t[1].numel())

    def to(self, device) -> "MicroBatch":
        """The tensors on ``device``. To a GPU they go through pinned memory without waiting for it: a copy from
        pageable memory synchronises the stream, so each micro-batch after a round's first would wait for the
        previous one's backward to end and start its forward on an idle GPU (the caching host allocator keeps each
        pinned copy until its transfer is done)."""
        device = torch.device(device)

        def move(t: torch.Tensor) -> torch.Tensor:
            if device.type != "cuda" or t.device.type != "cpu":
                return t.to(device)
            return t.pin_memory().to(device, non_blocking=True)

        attention, moved = {}, {}  # cu_seq_lens_q and _k are one tensor: copied once, still one after
        for k, v in self.attention_kwargs.items():
            if torch.is_tensor(v) and id(v) not in moved:
                moved[id(v)] = move(v)
            attention[k] = moved[id(v)] if torch.is_tensor(v) else v
        return MicroBatch(move(self.input_ids), move(self.position_ids), self.segments,
                          {j: (move(p), move(l)) for j, (p, l) in self.targets.items()}, self.n_items, attention)


def build_microbatch(bin_items: Sequence[Item], samples_of, pad_id: int = 0, pad_multiple: int = 1,
                     one_row: bool = False) -> MicroBatch:
    """Tensors of one bin (items ordered by job, as :func:`pack_ffd` returns them), in the rows :func:`bin_cost`
    counted (``one_row``: one row, each job's samples end to end and padded to ``pad_multiple``). ``samples_of(job)``
    returns that job's sample list (``Sample`` objects)."""
    by_job: dict[int, list[Item]] = {}
    for it in bin_items:
        by_job.setdefault(it.job, []).append(it)
    cap = sum(it.length for it in bin_items) if one_row else row_cap([it.length for it in bin_items])
    # per row, as int64 arrays (numpy: a Python loop over the tokens cost ~2 ms per 8,192-token micro-batch on the
    # host): ids, positions, target positions in the row, labels
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    job_rows: list[tuple[int, int, int]] = []  # job, first row, end row
    for job, its in by_job.items():
        first = len(rows)
        for row in fill_rows([it.length for it in its], cap):
            ids, pos, tp, tl = [], [], [], []
            base = 0
            for k in row:
                s = samples_of(job)[its[k].index]
                sid = np.asarray(s.input_ids, dtype=np.int64)
                # token t (t >= 1) is a target when its mask is set, predicted from position t - 1
                t = np.flatnonzero(np.asarray(s.loss_mask[1:], dtype=bool)) + 1
                ids.append(sid)
                pos.append(np.arange(len(sid), dtype=np.int64))
                tp.append(base + t - 1)
                tl.append(sid[t])
                base += len(sid)
            rows.append(tuple(np.concatenate(parts) for parts in (ids, pos, tp, tl)))
        job_rows.append((job, first, len(rows)))
    if one_row:
        return _one_row(rows, job_rows, pad_id, pad_multiple, len(bin_items))
    L = round_up(max(len(r[0]) for r in rows), pad_multiple)
    all_ids = np.full((len(rows), L), pad_id, dtype=np.int64)
    all_pos = np.empty((len(rows), L), dtype=np.int64)
    for r, (ids, pos, _, _) in enumerate(rows):
        all_ids[r, :len(ids)] = ids
        all_pos[r, :len(pos)] = pos
        # the padding: a separate dummy sequence, attending only to itself, without targets
        all_pos[r, len(pos):] = np.arange(L - len(pos))
    segments, targets = [], {}
    for job, r0, r1 in job_rows:
        segments.append((job, r0 * L, r1 * L))
        tp = np.concatenate([r * L + rows[r][2] for r in range(r0, r1)])
        tl = np.concatenate([rows[r][3] for r in range(r0, r1)])
        targets[job] = (torch.from_numpy(tp), torch.from_numpy(tl))
    positions = torch.from_numpy(all_pos)
    return MicroBatch(torch.from_numpy(all_ids), positions, segments, targets, n_items=len(bin_items),
                      attention_kwargs=packed_sequence_kwargs(positions))


def _one_row(rows: list, job_rows: list, pad_id: int, pad_multiple: int, n_items: int) -> MicroBatch:
    """The one-row micro-batch of :func:`build_microbatch`: each job's row (one per job) padded to a multiple of
    ``pad_multiple`` with a dummy sequence of its own, without targets, and the jobs' rows end to end."""
    ids, pos, segments, targets, start = [], [], [], {}, 0
    for job, r0, r1 in job_rows:
        if r1 != r0 + 1:
            raise AssertionError("one_row: each job's samples fill one row")
        j_ids, j_pos, j_tp, j_tl = rows[r0]
        n = round_up(len(j_ids), pad_multiple)
        ids += [j_ids, np.full(n - len(j_ids), pad_id, dtype=np.int64)]
        pos += [j_pos, np.arange(n - len(j_ids), dtype=np.int64)]
        segments.append((job, start, start + n))
        targets[job] = (torch.from_numpy(start + j_tp), torch.from_numpy(j_tl))
        start += n
    positions = torch.from_numpy(np.concatenate(pos))[None]
    return MicroBatch(torch.from_numpy(np.concatenate(ids))[None], positions, segments, targets, n_items=n_items,
                      attention_kwargs=packed_sequence_kwargs(positions))


def plan_microbatches(requests: Sequence[tuple[int, Sequence[int]]], lengths_of, budget: int,
                      pad_multiple: int = 1, one_row: bool = False) -> list[list[Item]]:
    """Packs ``[(job, [sample indices])]`` into bins; ``lengths_of(job)`` gives that job's sample lengths."""
    items = [Item(job, idx, int(lengths_of(job)[idx])) for job, idxs in requests for idx in idxs]
    return pack_ffd(items, budget, pad_multiple, one_row)


__all__ = ["Item", "MIN_ROW_TOKENS", "MicroBatch", "bin_cost", "build_microbatch", "fill_rows", "long_tensor",
           "pack_ffd", "plan_microbatches", "round_up", "row_cap", "row_sums"]
