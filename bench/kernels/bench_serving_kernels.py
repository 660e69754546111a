"""Per-module serving cost of every BD-LoRA serving path at each token count, on one GPU, in CUDA graphs: the data
behind ``vllm_plugin/fast_path/configs/` (one JSON file per GPU)` (cut-offs and tiles per GPU).

For the per-GPU module shapes of a Llama-3.1-8B shard at TP=4 and TP=8 (qkv, o, gate_up, down; bf16; one LoRA slot
of the per-GPU buffer rank, every token on the adapter) and T tokens, times one call of each path on
``--layers`` distinct layers' weights (so weights stream from HBM as in a model, not from L2), captured in one CUDA
graph and replayed (launch gaps as vLLM's graphs have them):

    base          F.linear(x, W)                                            (the floor: no LoRA)
    gemm_w_ext    F.linear(x, [W; A])                                       (the folded GEMM alone)
    gemm_rows     F.linear(x, W') with W' of d_out + E rows, E in ``--extra-rows`` (key gemm_rows_<E>): what E more
                  rows under W cost cuBLAS (its tile and wave quantization), against base (E = 0) and gemm_w_ext
    fold_decode   F.linear(x, [W; A]) + decode_lora_folded(kernel="decode")  (T <= 64)
    fold_gemm     F.linear(x, [W; A]) + decode_lora_folded(kernel="gemm") per tile candidate (block_m, block_n, warps)
    fold_sorted   fold_gemm with the tokens grouped by slot (``SlotSegments``, computed once before the graph, as a
                  served layer does once per slot map): each tile reads one slot's B (several slots only; key
                  fold_sorted_<bm>x<bn>w<warps>, the best under fold_sorted(_pdl), _tiles)
    fold_cublas   F.linear(x, [W; A]) + torch.addmm(h[:, :d_out], h[:, d_out:], B_bd) with the slot's B laid out
                  block-diagonally over the slices (S * R, d_out): one slot, cuBLAS only (no Triton launch)
    fold_gemv     decode_lora_folded(kernel="gemv") per tile candidate (block_n, block_k, warps, stages): base GEMM,
                  shrink and expand in one launch (T <= 64); candidates with local_shrink (the shrink per output
                  tile) are timed plain and with pdl, their best under fold_gemv_local(_pdl); at T=1 those with
                  one_token too (fp32 products summed over the input once, no tl.dot), under
                  fold_gemv_one_token(_pdl); ``--gemv-kinds`` times only some of the kinds (shared, local,
                  one_token); ``--nolora``: at T=1 each kind's best tiles again on a token without LoRA
    *_pdl         fold_decode, fold_gemm (best tiles), fold_gemv (best tiles) and two_launch again with pdl=True:
                  launched with programmatic dependent launch (Hopper+), the LoRA weights and slot ids read before
                  the wait on the kernel before
    two_launch    F.linear(x, W) + decode_lora                              (T <= 64)
    side_stream   F.linear(x, W) on the stream while a second stream computes the LoRA term delta = 0 +
                  decode_lora(x) from the same x; the stream then waits for it (an event: no kernel) and returns
                  y and delta apart, for the next kernel to add (a pointwise add fuses into vLLM's compiled
                  activation / norm kernels). ``side_stream_add`` also adds them (one more kernel, the unfused
                  bound). Both plain and with pdl (T <= 64)
    punica        F.linear(x, W) + vLLM's PunicaWrapperGPU.add_lora_linear  (vLLM's LoRA kernels at the same rank)

    python bench/kernels/bench_serving_kernels.py --out serving_kernels.json [--tokens 1,8,64] [--shapes tp4]
        [--paths base,fold_gemm,fold_gemv]   (a subset of the paths; default all)
        [--trace tp4:o:1,tp4:qkv:1 --tokens ""]   (kernel timelines of one layer's paths, under the torch profiler)
        [--eager]   (also each path's host time per call run eagerly, as a prefill runs: ``eager_us``; and
                     ``eager_fold_gemm_triton``: the same through Triton's launcher, bdlora.kernels.launch off)
        [--loras 4]   (4 LoRA slots per layer, as --max-loras 4 serves: token i on slot i mod 4, one token on the
                       last, punica's mapping too; the single-slot path fold_cublas is not timed)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

H = 4096
SHAPES = {  # per-GPU (d_in, slice widths) and the buffer rank: max_lora_rank 256 / TP
    "tp4": {"rank": 64, "qkv": (H, (1024, 256, 256)), "o": (1024, (H,)), "gate_up": (H, (3584, 3584)),
            "down": (3584, (H,))},
    "tp8": {"rank": 32, "qkv": (H, (512, 128, 128)), "o": (512, (H,)), "gate_up": (H, (1792, 1792)),
            "down": (1792, (H,))},
}
TILES = [(16, 64, 4), (16, 128, 4), (32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 4), (128, 128, 8), (16, 32, 1),
         (16, 64, 1), (16, 64, 2), (16, 128, 2), (32, 64, 2)]
GEMV_TILES = [  # (block_n, block_k, split_k, warps, stages[, local_shrink[, one_token]])
    (16, 256, 1, 2, 4), (16, 512, 1, 4, 3), (16, 128, 1, 2, 4), (16, 256, 1, 4, 4), (32, 256, 1, 4, 3),
    (16, 256, 1, 1, 4), (16, 512, 1, 2, 3), (16, 128, 4, 4, 3), (16, 256, 2, 2, 4), (32, 128, 4, 4, 3),
    (32, 128, 8, 4, 3), (64, 128, 4, 4, 3),
    (16, 256, 1, 2, 4, True), (32, 256, 1, 4, 3, True), (32, 128, 1, 4, 4, True), (64, 128, 1, 4, 3, True),
    (16, 512, 1, 2, 3, True), (32, 512, 1, 4, 2, True), (32, 512, 1, 8, 2, True), (64, 64, 1, 4, 4, True),
    (32, 64, 1, 4, 4, True), (32, 128, 1, 8, 4, True), (32, 128, 2, 4, 4, True), (16, 256, 2, 2, 4, True),
    (32, 256, 2, 4, 3, True), (64, 128, 2, 4, 3, True), (16, 128, 4, 2, 4, True), (32, 128, 4, 4, 3, True),
    (64, 128, 4, 4, 3, True), (32, 256, 4, 4, 3, True), (32, 512, 4, 4, 2, True), (64, 256, 4, 4, 3, True),
    (128, 128, 8, 4, 3, True),
    # one token, stages 1: the K loop not pipelined, as every one-token tile was until 2026-11-28 (results before
    # that date name these s3: stages did nothing there); then the tables' tiles pipelined, 2 to 4 stages
    *[(bn, bk, sk, w, 1, True, True) for bn, bk, sk, w in (
        (16, 128, 1, 2), (16, 256, 1, 4), (16, 512, 1, 4), (32, 64, 1, 2), (32, 128, 1, 4), (32, 256, 1, 4),
        (32, 256, 1, 8), (64, 64, 1, 4), (64, 128, 1, 8), (128, 64, 1, 8), (16, 256, 2, 2), (32, 128, 2, 4),
        (64, 64, 2, 4), (16, 128, 4, 2), (32, 128, 4, 4), (64, 128, 4, 8), (32, 64, 8, 2), (64, 64, 8, 4),
        (64, 64, 16, 4), (128, 64, 8, 8), (32, 64, 8, 4), (64, 128, 8, 8), (32, 128, 8, 4), (64, 32, 8, 4),
        (128, 32, 8, 4), (16, 256, 1, 8), (32, 128, 4, 8), (64, 64, 4, 4), (128, 64, 4, 8), (64, 128, 2, 8),
        (32, 256, 2, 8), (16, 256, 2, 4), (128, 128, 4, 8))],
    *[(bn, bk, sk, w, st, True, True) for bn, bk, sk, w in (
        (32, 128, 8, 4), (16, 256, 1, 8), (64, 64, 8, 4), (32, 256, 1, 8), (64, 64, 16, 4), (128, 128, 4, 8),
        (32, 128, 1, 4), (128, 64, 8, 8))
      for st in (2, 3, 4)],
    ]


def gemv_name(gt) -> str:
    """A GEMV_TILES row's key in the results: fold_gemv_<block_n>x<block_k>k<split_k>w<warps>s<stages>[L[1]]."""
    return "fold_gemv_{}x{}k{}w{}s{}".format(*gt[:5]) + "".join(f for f, v in zip("L1", gt[5:]) if v)


def gemv_kind(g) -> str:
    """A GemvTiles' kind for ``--gemv-kinds``: shared, local or one_token."""
    return "one_token" if g.one_token else "local" if g.local_shrink else "shared"


PATHS = ("base", "gemm_w_ext", "gemm_rows", "fold_decode", "two_launch", "side_stream", "fold_gemm", "fold_sorted",
         "fold_cublas", "fold_gemv", "punica")


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of ``fn`` (which runs every layer once), replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1000 / reps


def eager_us(fn, calls: int = 50) -> tuple[float, float]:
    """(host us, wall us) per call of ``fn`` (every layer once) run eagerly, not from a graph, as vLLM runs a prefill
    above its largest captured size: host = the time to issue the calls (Python, dispatch, kernel launches), wall =
    until the GPU is done. host ~ wall: the call is host-bound, and the GPU waits for its launches."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6 / calls, (t2 - t0) * 1e6 / calls


def kernel_timeline(fn, reps: int = 3) -> list:
    """The GPU kernels of one call of ``fn`` replayed from a CUDA graph, under the torch profiler: [name, start us
    (from the call's first kernel), duration us] in start order, from the last of ``reps`` replays. Shows how many
    kernels a path launches and the gap between them (e.g. a GEMM's split-K reduce kernel, or what programmatic
    dependent launch overlaps)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    per_call = len(kernels) // reps
    last = kernels[-per_call:] if per_call else []
    t0 = last[0].time_range.start if last else 0
    return [[e.name[:120], round(e.time_range.start - t0, 2), round(e.time_range.elapsed_us(), 2)] for e in last]


def make_punica(max_tokens: int, dev, max_loras: int = 1):
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    cfg = SimpleNamespace(max_loras=max_loras, specialize_active_lora=False, max_lora_rank=64,
                          fully_sharded_loras=False)
    return PunicaWrapperGPU(max_tokens, 256, dev, lora_config=cfg, max_loras=max_loras)


def set_mapping(punica, slots: list, n_slots: int, prefill: bool):
    """punica's metadata for tokens on these slots (0 .. n_slots - 1; adapter id = slot + 1)."""
    from vllm.lora.layers import LoRAMapping

    ids = tuple(s + 1 for s in slots)
    m = LoRAMapping(ids, ids, is_prefill=prefill)
    index_to_id = list(range(1, n_slots + 1))
    try:
        punica.update_metadata(m, index_to_id, n_slots, 32000)
    except TypeError:
        punica.update_metadata(m, index_to_id, n_slots, 32000, 0)


def check(dev) -> dict:
    """The folded kernels (plain and ``pdl=True`` launches) against the float64 reference in bf16: 3 slots of ragged
    ranks, tokens of every slot and without LoRA in random order, and one slot (the ONE_SLOT code path, which reads B
    before it waits): the largest error relative to the largest LoRA term. Every relaunch of a kept kernel (a second
    call, and a prepared ``FoldedLaunch`` called three times) must give the same bits."""
    from bdlora.kernels import (GemvTiles, GemvWorkspace, decode_lora, decode_lora_folded, decode_lora_folded_ref,
                                fold_weight)
    from bdlora.kernels.decode import ExpandTiles, FoldedLaunch

    gen = torch.Generator(device=dev).manual_seed(1)
    out = {}
    for outs, d_in, ranks in (((1024, 256, 256), H, [64, 19, 0]), ((3584, 3584), H, [64, 19, 0]),
                              ((H,), 1792, [64, 19, 0]), ((1024, 256, 256), H, [38]), ((H,), 3584, [38])):
        n_s, d_out, R, n_l = len(outs), sum(outs), 64, len(ranks)
        offs = [0]
        for o in outs:
            offs.append(offs[-1] + o)
        w = torch.randn(d_out, d_in, device=dev, generator=gen).bfloat16() * 0.02
        f = fold_weight(w, n_s, n_l, R)
        b = torch.zeros(n_l, d_out, R, device=dev, dtype=torch.bfloat16)
        for slot, r in enumerate(ranks):
            f.lora_a(n_s, n_l, R)[:, slot, :r] = torch.randn(n_s, r, d_in, device=dev, generator=gen).bfloat16() * .05
            b[slot, :, :r] = torch.randn(d_out, r, device=dev, generator=gen).bfloat16() * 0.05
        rk = torch.tensor(ranks, dtype=torch.int32, device=dev)
        sc = torch.tensor([1.0, 0.5, 2.0][:n_l], device=dev)
        for t in (1, 5, 40, 300, 2048):
            x = torch.randn(t, d_in, device=dev, generator=gen).bfloat16()
            idx = torch.randint(-1, n_l, (t,), device=dev, generator=gen, dtype=torch.int32)
            ref = decode_lora_folded_ref(x.double(), f.w_ext.double(), d_out, b.double(), idx, rk, sc.double(), offs)
            # relative to the largest LoRA term (to the output where the one token has no LoRA)
            lora = (ref - F.linear(x.double(), w.double())).abs().max().item()
            lora = max(lora, ref.abs().max().item() if t == 1 else 0.0)
            for kern in (("decode", "gemm") if t <= 64 else ("gemm",)):
                cands = (ExpandTiles(),) if kern == "decode" else (ExpandTiles(16, 64, 4), ExpandTiles(64, 128, 4))
                for tiles in cands:
                    for pdl in (False, True):
                        y = decode_lora_folded(x, f, b, idx, rk, sc, offs, kernel=kern, tiles=tiles, pdl=pdl).out
                        again = decode_lora_folded(x, f, b, idx, rk, sc, offs, kernel=kern, tiles=tiles, pdl=pdl).out
                        if not torch.equal(y, again):  # the second call is a direct launch (bdlora.kernels.launch)
                            raise RuntimeError(f"direct launch differs: {d_out}x{d_in} T={t} {kern} {tiles} pdl={pdl}")
                        plan = FoldedLaunch(f, b, idx, rk, sc, offs, kernel=kern, tiles=tiles, pdl=pdl)
                        if not all(torch.equal(y, plan(x)) for _ in range(3)):  # the plan's own kept kernel
                            raise RuntimeError(f"prepared launch differs: {d_out}x{d_in} T={t} {kern} {tiles} "
                                               f"pdl={pdl}")
                        err = (y.double() - ref).abs().max().item()
                        key = f"{d_out}x{d_in} L={n_l} T={t} {kern} {tiles.block_m}x{tiles.block_n}{' pdl' * pdl}"
                        out[key] = round(err / lora, 5)
                        if kern == "gemm" and n_l > 1:  # the tokens grouped by slot (fold_sorted)
                            ys = decode_lora_folded(x, f, b, idx, rk, sc, offs, kernel=kern, tiles=tiles, pdl=pdl,
                                                    sort_tokens=True).out
                            out[key.replace(" gemm ", " sorted ")] = round((ys.double() - ref).abs().max().item()
                                                                          / lora, 5)
            if t <= 64:  # the two-launch kernel (layers that cannot fold), plain and pdl launches
                soff = torch.tensor(offs, dtype=torch.int32, device=dev)
                for pdl in (False, True):
                    y, again = (decode_lora(F.linear(x, w), x, f.lora_a(n_s, n_l, R), b, idx, rk, sc, offs,
                                            soff=soff, pdl=pdl).out for _ in range(2))
                    if not torch.equal(y, again):
                        raise RuntimeError(f"direct launch differs: two_launch {d_out}x{d_in} T={t} pdl={pdl}")
                    out[f"{d_out}x{d_in} L={n_l} T={t} two_launch{' pdl' * pdl}"] = round(
                        (y.double() - ref).abs().max().item() / lora, 5)
            if t <= 64:  # the one-launch kernel: the same check, and 200 calls in a row bit-identical (its A -> W
                ws = GemvWorkspace(dev, x.dtype)  # programs' hand-offs through the workspace never read stale data)
                for g, pdl in ((GemvTiles(), False), (GemvTiles(64, 128, 1, 4, 3), False),
                               (GemvTiles(16, 64, 16, 2, 4), False), (GemvTiles(), True),
                               (GemvTiles(16, 64, 4, 2, 2, True), False), (GemvTiles(32, 64, 1, 4, 2, True), True),
                               (GemvTiles(32, 64, 2, 4, 2, True, True), True),
                               (GemvTiles(16, 128, 1, 4, 3, True, True), False)):
                    if not g.fits_slices(offs) or (g.one_token and t > 1 and g.block_k > 64):
                        continue  # (one_token tiles serve one token: at T > 1 this one's A tile would not fit)
                    ws.reserve(f, t, g)
                    y = decode_lora_folded(x, f, b, idx, rk, sc, offs, kernel="gemv", gemv_tiles=g, workspace=ws,
                                           pdl=pdl).out
                    out[f"{d_out}x{d_in} L={n_l} T={t} gemv {g.block_n}x{g.block_k}k{g.split_k}{'L' * g.local_shrink}"
                        f"{'1' * g.one_token}{' pdl' * pdl}"] = round(
                        (y.double() - ref).abs().max().item() / lora, 5)
                    ys = [decode_lora_folded(x, f, b, idx, rk, sc, offs, kernel="gemv", gemv_tiles=g,
                                             workspace=ws, pdl=pdl).out for _ in range(200)]
                    if any(not torch.equal(y, yi) for yi in ys) or ws.counters.any():
                        raise RuntimeError(f"gemv kernel not repeatable at {d_out}x{d_in} T={t} {g}")
    out["max_rel"] = max(out.values())
    from bdlora.kernels.launch import LAUNCHES

    out["launches"] = {"direct": LAUNCHES.direct, "triton": LAUNCHES.triton}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="serving_kernels.json")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,1024,4096,8192")
    ap.add_argument("--shapes", default="tp4,tp8")
    ap.add_argument("--modules", default="qkv,o,gate_up,down", help="comma-separated subset of qkv, o, gate_up, down")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--adapter-rank", type=float, default=0.6, help="adapter rank as a fraction of the buffer rank")
    ap.add_argument("--buffer-rank", default="", help="SHAPE=R,...: that shape's buffer rank R instead of "
                    "max_lora_rank 256 / TP (additional_config bdlora.max_rank: 152 gives tp4=48, tp8 keeps 32); "
                    "the adapter keeps the rank --adapter-rank gives at the default buffer, at most R")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    ap.add_argument("--fold-tiles", default="all", help="fold_gemm tiles: all (TILES) or one 'bm,bn,warps'")
    ap.add_argument("--gemv-kinds", default="shared,local,one_token",
                    help="fold_gemv candidates timed: comma-separated subset of shared, local, one_token")
    ap.add_argument("--loras", type=int, default=1, help="LoRA slots per layer (--max-loras): token i uses slot "
                    "i mod L, one token the last slot")
    ap.add_argument("--extra-rows", default="0,32,64,128,192,256,384,512",
                    help="gemm_rows: the row counts E added under W (comma-separated)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--nolora", action="store_true", help="at T=1 also time each fold_gemv family's best tiles on a "
                    "token without LoRA (keys <family>_nolora): the kernel's GEMV alone, against base (cuBLAS)")
    ap.add_argument("--eager", action="store_true", help="also time every path eagerly: host and wall us per call "
                    "(eager_us; keys eager_<path> = [host, wall])")
    ap.add_argument("--trace", default="", help="comma-separated SHAPE:MODULE:T (e.g. tp4:o:1,tp4:qkv:1): the "
                    "kernel timeline (kernel_timeline) of base, fold_gemm and two_launch, plain and pdl, on one layer, "
                    "into the output's 'traces'")
    a = ap.parse_args()
    paths = set(a.paths.split(","))
    if paths - set(PATHS):
        ap.error(f"--paths: unknown {sorted(paths - set(PATHS))}; known: {PATHS}")
    if a.loras < 1:
        ap.error("--loras: at least 1 slot")
    try:
        buffer_rank = {k: int(v) for k, v in (kv.split("=") for kv in a.buffer_rank.split(",") if kv)}
    except ValueError:
        ap.error(f"--buffer-rank: SHAPE=R pairs (e.g. tp4=40,tp8=24), got {a.buffer_rank!r}")
    if set(buffer_rank) - set(SHAPES) or any(r < 1 for r in buffer_rank.values()):
        ap.error(f"--buffer-rank: shapes of {sorted(SHAPES)} and ranks >= 1, got {a.buffer_rank!r}")
    if a.loras > 1:  # this one times one slot's factors only
        paths -= {"fold_cublas"}
    fold_tiles = TILES if a.fold_tiles == "all" else [tuple(int(v) for v in a.fold_tiles.split(","))]
    from bdlora.kernels import DecodeWorkspace, GemvTiles, GemvWorkspace, decode_lora, decode_lora_folded, fold_weight
    from bdlora.kernels.launch import LAUNCHES
    from bdlora.kernels.decode import ExpandTiles, FoldedLaunch, decode_grid, decode_tiles, slot_segments

    dev = torch.device("cuda")
    dt = torch.bfloat16
    toks = [int(t) for t in a.tokens.split(",") if t]
    try:
        extra_rows = [int(e) for e in a.extra_rows.split(",") if e]
    except ValueError:
        ap.error(f"--extra-rows: comma-separated row counts (e.g. 0,64,128), got {a.extra_rows!r}")
    if any(e < 0 for e in extra_rows):
        ap.error(f"--extra-rows: row counts >= 0, got {a.extra_rows!r}")
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "loras": a.loras, "rows": []}
    try:
        import vllm

        res["vllm"] = vllm.__version__
        punica = make_punica(max(toks, default=64), dev, a.loras)
    except Exception as e:  # noqa: BLE001 - recorded, the rest still runs
        punica, res["punica_error"] = None, repr(e)
    gen = torch.Generator(device=dev).manual_seed(0)
    n_l = a.loras

    def slot_ids(t: int) -> torch.Tensor:  # token i on slot i mod L; one token on the last slot
        return (torch.arange(t, device=dev, dtype=torch.int32) + (n_l - 1 if t == 1 else 0)) % n_l

    if not a.no_check:
        res["check"] = check(dev)
        print(json.dumps(res["check"]), flush=True)
    for shape in a.shapes.split(","):
        spec = SHAPES[shape]
        R = buffer_rank.get(shape, spec["rank"])
        r_used = min(R, max(1, int(spec["rank"] * a.adapter_rank)))
        for mod in [m for m in ("qkv", "o", "gate_up", "down") if m in a.modules.split(",")]:
            d_in, outs = spec[mod]
            n_s, d_out = len(outs), sum(outs)
            offs = [0]
            for o in outs:
                offs.append(offs[-1] + o)
            layers = []
            for _ in range(a.layers):
                w = torch.randn(d_out, d_in, device=dev, dtype=dt, generator=gen) * 0.02
                f = fold_weight(w, n_s, n_l, R)
                av = f.lora_a(n_s, n_l, R)
                av[:, :, :r_used] = torch.randn(n_s, n_l, r_used, d_in, device=dev, dtype=dt, generator=gen) * 0.02
                b = torch.zeros(n_l, d_out, R, device=dev, dtype=dt)
                b[:, :, :r_used] = torch.randn(n_l, d_out, r_used, device=dev, dtype=dt, generator=gen) * 0.02
                b_bd = torch.zeros(n_s * R, d_out, device=dev, dtype=dt)  # fold_cublas: slice s's B^T at rows s*R
                for i in range(n_s):
                    b_bd[i * R:(i + 1) * R, offs[i]:offs[i + 1]] = b[0, offs[i]:offs[i + 1]].t()
                a_st = tuple(av[i].unsqueeze(1).contiguous() for i in range(n_s))  # punica: (L, 1, R, d_in)
                b_st = tuple(b[:, offs[i]:offs[i + 1]].unsqueeze(1).contiguous() for i in range(n_s))
                layers.append(SimpleNamespace(w=w, f=f, a=av, b=b, a_st=a_st, b_st=b_st, b_bd=b_bd))
            ranks = torch.full((n_l,), r_used, dtype=torch.int32, device=dev)
            scales = torch.ones(n_l, dtype=torch.float32, device=dev)
            soff = torch.tensor(offs, dtype=torch.int32, device=dev)
            # gemm_rows: W with E more rows, one per layer (each call streams its weight from HBM), built once per
            # module for every token count
            tall_weights = {extra: [torch.randn(d_out + extra, d_in, device=dev, dtype=dt, generator=gen) * 0.02
                                    for _ in layers] for extra in (extra_rows if "gemm_rows" in paths else ())}
            ws = DecodeWorkspace(dev)
            gemv_ws = GemvWorkspace(dev, dt)
            for gt in GEMV_TILES:
                gemv_ws.reserve(layers[0].f, 64, GemvTiles(*gt))
            side_ws = DecodeWorkspace(dev)  # the side stream's own: its kernels run beside the main stream's
            for t in range(1, 65):
                grid = decode_grid(t, n_s, n_l, max(outs), d_in, R, decode_tiles(dev))
                ws.reserve(grid)
                if "side_stream" in paths:
                    side_ws.reserve(grid)
            for trace in [v for v in a.trace.split(",") if v.startswith(f"{shape}:{mod}:")]:
                t = int(trace.split(":")[2])
                x = torch.randn(t, d_in, device=dev, dtype=dt, generator=gen)
                idx = slot_ids(t)
                L = layers[0]
                fns = {"base": lambda: F.linear(x, L.w)}
                for pdl in (False, True):
                    fns["fold_gemm" + "_pdl" * pdl] = (lambda p: lambda: decode_lora_folded(
                        x, L.f, L.b, idx, ranks, scales, offs, kernel="gemm", tiles=ExpandTiles(16, 64, 4), pdl=p))(pdl)
                    fns["two_launch" + "_pdl" * pdl] = (lambda p: lambda: decode_lora(
                        F.linear(x, L.w), x, L.a, L.b, idx, ranks, scales, offs, soff=soff, workspace=ws, pdl=p))(pdl)
                res.setdefault("traces", {})[trace] = {k: kernel_timeline(f) for k, f in fns.items()}
                print(json.dumps({trace: res["traces"][trace]}), flush=True)
                Path(a.out).write_text(json.dumps(res, indent=1))
            for t in toks:
                x = torch.randn(t, d_in, device=dev, dtype=dt, generator=gen)
                idx = slot_ids(t)
                row = {"shape": shape, "module": mod, "tokens": t, "rank_buffer": R, "rank_used": r_used}

                def run_base():
                    for L in layers:
                        F.linear(x, L.w)

                timers = {}  # path -> fn, for --eager

                if "base" in paths:
                    row["base"] = graph_us(run_base)
                    timers["base"] = run_base

                def run_wext():  # the folded GEMM alone: what the A rows add to the base GEMM
                    for L in layers:
                        F.linear(x, L.f.w_ext)

                if "gemm_w_ext" in paths:
                    row["gemm_w_ext"] = graph_us(run_wext)
                    timers["gemm_w_ext"] = run_wext

                for extra, tall in tall_weights.items():

                    def run_rows(ws=tall):
                        for w in ws:
                            F.linear(x, w)

                    row[f"gemm_rows_{extra}"] = graph_us(run_rows)

                def run_cublas():
                    for L in layers:
                        h = F.linear(x, L.f.w_ext)
                        torch.addmm(h[:, :L.f.d_out], h[:, L.f.d_out:], L.b_bd)

                if "fold_cublas" in paths:
                    row["fold_cublas"] = graph_us(run_cublas)
                    timers["fold_cublas"] = run_cublas

                def folded_run(**kw):  # one decode_lora_folded call per layer, with these options
                    def run():
                        for L in layers:
                            decode_lora_folded(x, L.f, L.b, idx, ranks, scales, offs, **kw)

                    return run

                def folded_us(**kw):
                    return graph_us(folded_run(**kw))

                for pdl in ((False, True) if t <= 64 and "fold_decode" in paths else ()):
                    row["fold_decode" + "_pdl" * pdl] = folded_us(kernel="decode", pdl=pdl)
                for pdl in ((False, True) if t <= 64 and "two_launch" in paths else ()):
                    def run_two():
                        for L in layers:
                            y = F.linear(x, L.w)
                            decode_lora(y, x, L.a, L.b, idx, ranks, scales, offs, soff=soff, workspace=ws, pdl=pdl)

                    row["two_launch" + "_pdl" * pdl] = graph_us(run_two)
                if t <= 64 and "side_stream" in paths:
                    side = torch.cuda.Stream()
                    deltas = [torch.empty(t, d_out, device=dev, dtype=dt) for _ in layers]
                for add in ((False, True) if t <= 64 and "side_stream" in paths else ()):
                    for pdl in (False, True):
                        def run_side():
                            main = torch.cuda.current_stream()
                            for L, delta in zip(layers, deltas):
                                side.wait_stream(main)  # x is ready: the LoRA term starts beside the base GEMM
                                with torch.cuda.stream(side):
                                    delta.zero_()
                                    decode_lora(delta, x, L.a, L.b, idx, ranks, scales, offs, soff=soff,
                                                workspace=side_ws, pdl=pdl)
                                y = F.linear(x, L.w)
                                main.wait_stream(side)  # the next kernel (here: the add) reads both
                                if add:
                                    y += delta

                        row["side_stream" + "_add" * add + "_pdl" * pdl] = graph_us(run_side)
                if t <= 64 and "side_stream" in paths:  # y + delta against two_launch's y on layer 0 (bf16 roundings)
                    L = layers[0]
                    want = decode_lora(F.linear(x, L.w), x, L.a, L.b, idx, ranks, scales, offs, soff=soff,
                                       workspace=ws).out.float()
                    got = F.linear(x, L.w).float() + decode_lora(torch.zeros_like(deltas[0]), x, L.a, L.b, idx, ranks,
                                                                 scales, offs, soff=soff, workspace=ws).out.float()
                    row["side_stream_check"] = {"max_rel": round(float((got - want).abs().max() / want.abs().max()), 5)}
                best = None
                for bm, bn, nw in (fold_tiles if "fold_gemm" in paths else ()):
                    if bm > 16 and bm > 2 * t:
                        continue
                    us = folded_us(kernel="gemm", tiles=ExpandTiles(bm, bn, nw))
                    row[f"fold_gemm_{bm}x{bn}w{nw}"] = us
                    if best is None or us < best[0]:
                        best = (us, [bm, bn, nw])
                if best is not None:
                    row["fold_gemm"], row["fold_gemm_tiles"] = best
                    row["fold_gemm_pdl"] = folded_us(kernel="gemm", tiles=ExpandTiles(*best[1]), pdl=True)
                    timers["fold_gemm"] = folded_run(kernel="gemm", tiles=ExpandTiles(*best[1]))
                if "fold_sorted" in paths and n_l > 1:  # one SlotSegments for the slot map, as served
                    seg = slot_segments(idx, n_l)

                    def sorted_us(tiles, pdl=False):
                        plans = [FoldedLaunch(L.f, L.b, idx, ranks, scales, offs, kernel="gemm", tiles=tiles,
                                              pdl=pdl, segments=seg) for L in layers]

                        def run():
                            for plan in plans:
                                plan(x)

                        return graph_us(run)

                    best = None
                    for bm, bn, nw in fold_tiles:
                        if bm > 16 and bm > 2 * t:
                            continue
                        us = sorted_us(ExpandTiles(bm, bn, nw))
                        row[f"fold_sorted_{bm}x{bn}w{nw}"] = us
                        if best is None or us < best[0]:
                            best = (us, [bm, bn, nw])
                    row["fold_sorted"], row["fold_sorted_tiles"] = best
                    row["fold_sorted_pdl"] = sorted_us(ExpandTiles(*best[1]), pdl=True)
                best = {}  # per kernel of the family (shared / local shrink): (us, tiles), and pdl
                for gt in (GEMV_TILES if t <= 64 and "fold_gemv" in paths else ()):
                    g = GemvTiles(*gt)
                    if not g.fits_slices(offs):
                        continue
                    if g.one_token and t > 1:
                        continue  # the same kernel as without one_token
                    if gemv_kind(g) not in a.gemv_kinds.split(","):
                        continue
                    fam = "fold_gemv" if gemv_kind(g) == "shared" else "fold_gemv_" + gemv_kind(g)
                    try:  # local shrink or one token: every candidate plain and pdl (as served)
                        for pdl in ((False, True) if g.local_shrink or g.one_token else (False,)):
                            us = folded_us(kernel="gemv", gemv_tiles=g, workspace=gemv_ws, pdl=pdl)
                            row[gemv_name(gt) + "_pdl" * pdl] = us
                            if best.get(fam + "_pdl" * pdl) is None or us < best[fam + "_pdl" * pdl][0]:
                                best[fam + "_pdl" * pdl] = (us, list(gt))
                    except Exception as e:  # noqa: BLE001 - a tile that does not fit this GPU (shared memory)
                        row[gemv_name(gt)] = repr(e)[:120]
                for fam, (us, tiles) in best.items():
                    row[fam], row[fam + "_tiles"] = us, tiles
                if "fold_gemv" in best:  # the shared kernel's best tiles, launched with pdl
                    row["fold_gemv_pdl"] = folded_us(kernel="gemv", gemv_tiles=GemvTiles(*best["fold_gemv"][1]),
                                                     workspace=gemv_ws, pdl=True)
                if t == 1 and a.nolora:  # each family's best tiles on a token without LoRA: A and B are not read,
                    idx.fill_(-1)        # so this is the kernel's own GEMV against cuBLAS's (base)
                    for fam, (_, tiles) in list(best.items()):
                        row[fam + "_nolora"] = folded_us(kernel="gemv", gemv_tiles=GemvTiles(*tiles),
                                                         workspace=gemv_ws, pdl=fam.endswith("_pdl"))
                    idx.copy_(slot_ids(t))
                if punica is not None and "punica" in paths:
                    try:
                        set_mapping(punica, slot_ids(t).tolist(), n_l, prefill=t > 64)

                        def run_pu():
                            for L in layers:
                                y = F.linear(x, L.w)
                                punica.add_lora_linear(y, x, L.a_st, L.b_st, 1.0, tuple(outs))

                        row["punica"] = graph_us(run_pu)
                        timers["punica"] = run_pu
                    except Exception as e:  # noqa: BLE001
                        row["punica_error"] = repr(e)[:300]
                for k in list(row):
                    if isinstance(row[k], float):
                        row[k] = round(row[k] / a.layers, 2)  # per module call
                for name, fn in (timers.items() if a.eager else ()):
                    row["eager_" + name] = [round(v / a.layers, 2) for v in eager_us(fn)]
                    if name == "fold_gemm":  # the same through Triton's launcher (no direct launch)
                        LAUNCHES.enabled = False
                        try:
                            row["eager_fold_gemm_triton"] = [round(v / a.layers, 2) for v in eager_us(fn)]
                        finally:
                            LAUNCHES.enabled = True
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                Path(a.out).write_text(json.dumps(res, indent=1))
    print("done", flush=True)


if __name__ == "__main__":
    main()
