"""The pipeline's schedule: single-job micro-batches of each optimizer step, interleaved round-robin over the jobs
(:func:`build_stream`), and the unit-slot simulation every rank runs identically (:func:`simulate_schedule`)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from ..packing import MicroBatch


@dataclass
class PMB:
    """A pipeline micro-batch: one job's share of one optimizer step."""

    idx: int
    job: int
    step: int
    mb: MicroBatch


def simulate_schedule(mbs: list[PMB], stages: int, inflight: Optional[list[int]] = None
                      ) -> tuple[list[list[tuple[str, int]]], float]:
    """Per-stage op lists [("F"|"B", mb index)] and the bubble ratio of the unit-slot simulation."""
    P, M = stages, len(mbs)
    limit = inflight or [P - s for s in range(P)]
    steps_of: dict[tuple[int, int], list[int]] = defaultdict(list)
    for m in mbs:
        steps_of[(m.job, m.step)].append(m.idx)
    INF = math.inf
    fdone = [[INF] * M for _ in range(P)]
    bdone = [[INF] * M for _ in range(P)]
    ops: list[list[tuple[str, int]]] = [[] for _ in range(P)]
    fcount, bcount = [0] * P, [0] * P
    t, busy = 0, 0

    def job_ready(s, m):  # the job's previous step fully backpropagated on stage s
        prev = steps_of.get((mbs[m].job, mbs[m].step - 1), [])
        return all(bdone[s][i] < t for i in prev)

    while bcount[0] < M:
        chosen = []
        for s in range(P):
            f_cand = b_cand = None
            inflight_s = fcount[s] - bcount[s]
            if fcount[s] < M and inflight_s < limit[s]:
                if s == 0:
                    for m in range(M):
                        if fdone[0][m] == INF and job_ready(0, m):
                            f_cand = m
                            break
                else:
                    m = ops_f_order(ops[s - 1], fcount[s])
                    if m is not None and fdone[s - 1][m] < t and job_ready(s, m):
                        f_cand = m
            if bcount[s] < fcount[s]:
                if s == P - 1:
                    for _, m in ops_f_list(ops[s]):
                        if bdone[s][m] == INF and fdone[s][m] < t:
                            b_cand = m
                            break
                else:
                    m = ops_b_order(ops[s + 1], bcount[s])
                    if m is not None and bdone[s + 1][m] < t:
                        b_cand = m
            prefer_f = s == 0
            if prefer_f:
                pick = ("F", f_cand) if f_cand is not None else (("B", b_cand) if b_cand is not None else None)
            else:
                pick = ("B", b_cand) if b_cand is not None else (("F", f_cand) if f_cand is not None else None)
            chosen.append(pick)
        for s, pick in enumerate(chosen):
            if pick is None:
                continue
            kind, m = pick
            ops[s].append(pick)
            busy += 1
            if kind == "F":
                fdone[s][m] = t
                fcount[s] += 1
            else:
                bdone[s][m] = t
                bcount[s] += 1
        t += 1
        if t > 10 * (M + P) * 4:
            raise RuntimeError("pipeline schedule simulation did not terminate (dependency cycle)")
    bubble = 1.0 - busy / (P * t) if t else 0.0
    return ops, bubble


def ops_f_list(ops):
    return [(k, m) for k, m in ops if k == "F"]


def ops_f_order(ops, i):
    f = [m for k, m in ops if k == "F"]
    return f[i] if i < len(f) else None


def ops_b_order(ops, i):
    b = [m for k, m in ops if k == "B"]
    return b[i] if i < len(b) else None


def theory_bubble(stages: int, jobs: int) -> float:
    """mLoRA's LoRAPP bubble model max((D - L)/D, 0)."""
    return max((stages - jobs) / stages, 0.0)



def build_stream(engine, jobs: list, counts: dict[int, int]) -> tuple[list[PMB], dict, dict]:
    """One segment: ``counts[job.id]`` steps of each job of ``jobs`` (from its current step on), packed into
    single-job micro-batches and interleaved round-robin over the jobs."""
    from ..packing import build_microbatch, plan_microbatches

    run = engine.run_cfg
    stream: list[PMB] = []
    step_targets: dict[tuple[int, int], int] = {}
    mbs_in_step: dict[tuple[int, int], int] = {}
    for i in range(max(counts.values(), default=0)):
        for job in jobs:
            if i >= counts[job.id]:
                continue
            k = job.step + i
            idx = job.sampler.next_batch()
            bins = plan_microbatches([(job.id, idx)], lambda j: engine.lengths(j), engine.token_budget,
                                     engine.pad_multiple, engine.packed_attention)
            mbs = [build_microbatch(b, lambda j: engine.jobs[j].data.train, engine.pad_id, engine.pad_multiple,
                                    engine.packed_attention) for b in bins]
            step_targets[(job.id, k)] = sum(mb.n_targets(job.id) for mb in mbs)
            mbs_in_step[(job.id, k)] = len(mbs)
            job.tokens += sum(len(job.data.train[i]) for i in idx)
            for mb in mbs:
                stream.append(PMB(len(stream), job.id, k, mb))
    return stream, step_targets, mbs_in_step



__all__ = ["PMB", "build_stream", "ops_b_order", "ops_f_list", "ops_f_order", "simulate_schedule", "theory_bubble"]
