"""Where the host time of one eager folded call goes (a prefill runs BD layers eagerly, and BD's prefill is
host-bound: BENCHMARKS.md, "Prefill host time"). On one GPU, for the per-GPU module shapes of the TP=4 / TP=8 shards
(``bench_serving_kernels.SHAPES``, one slot, every token on the adapter), host microseconds per call of successively
larger pieces of ``decode_lora_folded(kernel="gemm")``, each issued ``--calls`` times in a row without a sync (the
GPU keeps up: every piece here is host-bound at these sizes):

    linear           h = F.linear(x, [W; A])
    linear_empty     + y = h.new_empty(T, d_out)
    + raw_run        + the expand through the kept compiled kernel's ``run`` with prebuilt arguments (the floor of
                       a Triton launch from Python)
    + launch         + the expand through ``bdlora.kernels.launch`` (specialization key, then the kept kernel)
    + triton         + the expand through ``kernel[grid](...)`` (Triton's JITFunction.run)
    folded           decode_lora_folded(...) (a new ``FoldedLaunch`` per call)
    folded_op        the same behind a Python custom op (torch.library), as inductor's code calls the plugin's
                     ``bdlora::fold_linear``
    plan             a kept ``FoldedLaunch`` (what the plugin's fold_linear calls)
    plan_op          the same behind the custom op
    empty_op         a Python custom op that only returns x.new_empty: the dispatcher's share

plus a cProfile of ``folded`` (the top functions by own time). Results are JSON with machine and date.

    python bench/kernels/bench_host_overhead.py --out host_overhead.json [--shapes tp4] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_kernels import host_profile  # run as a script: its folder is on sys.path
from bench_serving_kernels import SHAPES, eager_us


def host_us(fn, calls: int) -> float:
    """Host microseconds per call of ``fn`` issued ``calls`` times in a row (``eager_us``'s host part)."""
    return round(eager_us(fn, calls)[0], 2)


def _register_ops():
    lib = torch.library.Library("bdlora_bench", "FRAGMENT")
    lib.define("folded(Tensor x, str layer) -> Tensor")
    lib.define("empty(Tensor x, int d_out) -> Tensor")
    lib.impl("empty", lambda x, d_out: x.new_empty(x.shape[0], d_out), "CompositeExplicitAutograd")
    return lib


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="host_overhead.json")
    ap.add_argument("--shapes", default="tp4,tp8")
    ap.add_argument("--modules", default="qkv,o,gate_up,down")
    ap.add_argument("--tokens", default="1024")
    ap.add_argument("--calls", type=int, default=400)
    a = ap.parse_args()
    from bdlora.kernels import decode_lora_folded, fold_weight
    from bdlora.kernels import dispatch
    from bdlora.kernels.decode import ExpandTiles, FoldedLaunch, _fold_expand_gemm_kernel
    from bdlora.kernels.launch import LAUNCHES, launch

    dev = torch.device("cuda")
    dt = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    lib = _register_ops()
    layers = {}  # the custom op's state by name (as the plugin's _FUSED_LAYERS)
    lib.impl("folded", lambda x, layer: layers[layer](), "CompositeExplicitAutograd")
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "rows": []}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass
    for shape in a.shapes.split(","):
        spec = SHAPES[shape]
        R = spec["rank"]
        for mod in a.modules.split(","):
            d_in, outs = spec[mod]
            n_s, d_out = len(outs), sum(outs)
            offs = [0]
            for o in outs:
                offs.append(offs[-1] + o)
            w = torch.randn(d_out, d_in, device=dev, dtype=dt, generator=gen) * 0.02
            f = fold_weight(w, n_s, 1, R)
            f.lora_a(n_s, 1, R).normal_(0, 0.02, generator=gen)
            b = torch.randn(1, d_out, R, device=dev, dtype=dt, generator=gen) * 0.02
            ranks = torch.tensor([R * 6 // 10], dtype=torch.int32, device=dev)
            scales = torch.ones(1, dtype=torch.float32, device=dev)
            slots = torch.zeros(8192, dtype=torch.int32, device=dev)
            for t in [int(v) for v in a.tokens.split(",")]:
                x = torch.randn(t, d_in, device=dev, dtype=dt, generator=gen)
                tiles = ExpandTiles(64, 64, 4) if t > 256 else ExpandTiles(16, 64, 4)
                widest = max(outs)
                grid = (-(-t // tiles.block_m), n_s, -(-widest // tiles.block_n))
                offs4 = list(offs[1:]) + [d_out] * (4 - n_s)
                kw = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_R=max(16, 1 << (R - 1).bit_length()),
                          ONE_SLOT=True, PREC=dispatch.dot_precision(dt), USE_GDC=True, num_warps=tiles.warps,
                          launch_pdl=True)

                def expand_args(y, h):
                    return (y, h, b, slots, ranks, scales, t, y.stride(0), h.stride(0), d_out, 1, R, *offs4)

                def call():
                    return decode_lora_folded(x, f, b, slots[:t], ranks, scales, offs, kernel="gemm", tiles=tiles,
                                              pdl=True).out

                plan = FoldedLaunch(f, b, slots, ranks, scales, offs, kernel="gemm", tiles=tiles, pdl=True)
                name = f"{shape}.{mod}.{t}"
                layers[name] = call
                layers[name + ".plan"] = lambda: plan(x)
                want = call()
                h0 = F.linear(x, f.w_ext)
                y0 = h0.new_empty(t, d_out)
                launch(_fold_expand_gemm_kernel, grid, *expand_args(y0, h0), **kw)
                launch(_fold_expand_gemm_kernel, grid, *expand_args(y0, h0), **kw)
                kept = [k for key, k in LAUNCHES._kept.items() if key[0] is _fold_expand_gemm_kernel]
                if not (torch.equal(y0, want) and torch.equal(plan(x), want) and torch.equal(plan(x), want)):
                    raise RuntimeError(f"{name}: the pieces do not reproduce decode_lora_folded")
                row = {"shape": shape, "module": mod, "tokens": t}
                row["linear"] = host_us(lambda: F.linear(x, f.w_ext), a.calls)

                def linear_empty():
                    h = F.linear(x, f.w_ext)
                    return h, h.new_empty(t, d_out)

                row["linear_empty"] = host_us(linear_empty, a.calls)
                if kept:
                    c, tail = kept[-1].compiled, kept[-1].tail
                    stream = torch.cuda.current_stream().cuda_stream

                    def raw_run():
                        h, y = linear_empty()
                        c.run(grid[0], grid[1], grid[2], stream, c.function, c.packed_metadata, None, None, None,
                              *expand_args(y, h), *tail)

                    row["raw_run"] = host_us(raw_run, a.calls)

                def via_launch():
                    h, y = linear_empty()
                    launch(_fold_expand_gemm_kernel, grid, *expand_args(y, h), **kw)

                def via_triton():
                    h, y = linear_empty()
                    _fold_expand_gemm_kernel[grid](*expand_args(y, h), **kw)

                row["launch"] = host_us(via_launch, a.calls)
                row["triton"] = host_us(via_triton, a.calls)
                row["folded"] = host_us(call, a.calls)
                row["folded_op"] = host_us(lambda: torch.ops.bdlora_bench.folded(x, name), a.calls)
                row["plan"] = host_us(lambda: plan(x), a.calls)
                row["plan_op"] = host_us(lambda: torch.ops.bdlora_bench.folded(x, name + ".plan"), a.calls)
                row["empty_op"] = host_us(lambda: torch.ops.bdlora_bench.empty(x, d_out), a.calls)
                row["cprofile_200_calls"] = host_profile(call, 200, 14).splitlines()[-22:]
                res["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "cprofile_200_calls"}), flush=True)
                Path(a.out).write_text(json.dumps(res, indent=1))
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
