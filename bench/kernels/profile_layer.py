"""Per-kernel CUDA times of one BD-LoRA layer fwd+bwd (torch.profiler), ours next to PEFT's; a diagnosis aid for
bench_kernels' layer section.

    python bench/kernels/profile_layer.py [--backend cublas] [--out profile.txt]
    python bench/kernels/profile_layer.py --grid --out grid.json
    python bench/kernels/profile_layer.py --host-profile     # cProfile of the host side of each case
    python bench/kernels/profile_layer.py --dsdb --out dsdb.json

For each case (rank, layout, N, dropout) at 8192 x 4096 -> 4096 bf16: the top CUDA kernels of 5 iterations of
``fused_lora_linear`` (``--backend``) and of the PEFT-style layer (``bench_kernels.PeftBdLayer``), and the
wall time per iteration of each. ``--grid``: bench_kernels' layer grid (4096 -> 4096 and 4096 -> 14336, column and
row, r 16/64, N 1/4/8, dropout 0.1) with, per layer, the summed GPU kernel time of an iteration (what the layer
costs a GPU that never waits for the host, as in a training step whose host runs ahead) and the wall time per
iteration over back-to-back calls (which a slow host inflates) and the host time to issue one, for PEFT and
the cuBLAS layer; GPU time also for the cuBLAS layer with its dropout materialized (``KernelOptions(fused_dropout=
False)``) and with dS/dB as two GEMMs (``KernelOptions(fused_dsdb=False)``), and of the frozen GEMMs alone (forward and
dX; ``ceiling_x`` = PEFT / that: the speed-up of a layer whose LoRA path were free; ``lora_path_x`` = PEFT's LoRA
path over ours, each the layer minus the frozen GEMMs). ``--dsdb``: the one-read dS/dB kernel alone for a
block-diagonal B (8192 rows, d_out 1024 / 4096 / 14336, r 16 / 64, N 4 / 8), dB added straight into its packed
diagonal blocks (``dsdb_dense(..., db_blocks=N)``) against dB accumulated dense then packed
(``db_blocks=1`` + ``pack_block_diagonal``), GPU ms by CUDA events over back-to-back calls, after checking both
against an fp32 torch reference.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = [(16, "column", 1, 0.1), (16, "column", 4, 0.1), (64, "row", 4, 0.1), (16, "column", 1, 0.0)]


def profiled(fn, iters=5) -> tuple[str, float]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / 20 * 1000
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
    table = events.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
    table += "\n" + events.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=60)
    return table, ms, gpu_us / iters / 1000


def host_ms(fn, calls=5, samples=10) -> float:
    """Median host milliseconds to issue one fn() (``calls`` back-to-back, no synchronization inside a sample):
    the rate at which a host running ahead could keep the GPU fed."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1000)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


# The cuBLAS layer's options per grid variant: (KernelOptions.fused_dropout, KernelOptions.fused_dsdb)
VARIANTS = {"cublas": (None, None), "twogemm": (None, False), "maskdrop": (False, None)}


def grid(out: str | None, rounds: int, variants: list[str]) -> None:
    import json

    import bdlora.kernels as K
    from bench_kernels import PeftBdLayer, make_adapter, timed

    t, dt, p, rows = 8192, torch.bfloat16, 0.1, []
    print("d_in d_out layout r N | GPU ms: base peft " + " ".join(variants) + " | wall ms: peft cublas | "
          "GPU x vs peft: " + " ".join(variants) + " ceiling | LoRA-path x | host ms: peft cublas", flush=True)
    for d_in, d_out in ((4096, 4096), (4096, 14336)):
        x = torch.randn(t, d_in, device="cuda", dtype=dt, requires_grad=True)
        gy = torch.randn(t, d_out, device="cuda", dtype=dt)
        base = torch.nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=dt).requires_grad_(False)
        for layout in ("column", "row"):
            for r in (16, 64):
                for n in (1, 4, 8):
                    ad = make_adapter(K, d_in, d_out, r, layout, n, dt, p)
                    peft = PeftBdLayer(base, ad, p)
                    def ours_with(fd, fs):
                        opts = K.KernelOptions(backend="cublas", fused_dropout=fd, fused_dsdb=fs)
                        return lambda: torch.autograd.grad(K.fused_lora_linear(
                            x, base.weight, None, [0, t], [ad], dropout_seed=1, options=opts).out,
                            [x, ad.lora_A, ad.lora_B], gy)
                    fns = {"base": lambda: torch.autograd.grad(base(x), [x], gy),  # the frozen GEMMs alone
                           "peft": lambda: torch.autograd.grad(peft(x), [x, peft.lora_a.weight,
                                                                         peft.lora_b.weight], gy)}
                    fns.update({name: ours_with(*VARIANTS.get(name, VARIANTS["cublas"])) for name in variants})
                    res = dict(d_in=d_in, d_out=d_out, layout=layout, r=r, N=n)
                    samples = {name: [] for name in fns}
                    for rnd in range(rounds):  # variants interleaved: GEMM clocks drift by ~10% over a run
                        for name, fn in fns.items():
                            samples[name].append(profiled(fn)[2])
                            if rnd == 0 and name in ("peft", "cublas"):
                                res[f"{name}_wall_ms"] = timed(fn, iters=10, batch=5)
                                res[f"{name}_host_ms"] = host_ms(fn)
                    for name, v in samples.items():
                        res[f"{name}_gpu_ms"] = sorted(v)[len(v) // 2]
                        res[f"{name}_gpu_ms_rounds"] = v
                    base_gpu_ms = res["base_gpu_ms"]
                    for name in variants:
                        res[f"{name}_gpu_x"] = res["peft_gpu_ms"] / res[f"{name}_gpu_ms"]
                    res["cublas_wall_x"] = res["peft_wall_ms"] / res["cublas_wall_ms"]
                    res["ceiling_x"] = res["peft_gpu_ms"] / base_gpu_ms
                    res["lora_path_x"] = (res["peft_gpu_ms"] - base_gpu_ms) / (res["cublas_gpu_ms"] - base_gpu_ms)
                    rows.append(res)
                    print(f"{d_in} {d_out} {layout} {r} {n} | {base_gpu_ms:.3f} {res['peft_gpu_ms']:.3f} "
                          + " ".join(f"{res[f'{v}_gpu_ms']:.3f}" for v in variants)
                          + f" | {res['peft_wall_ms']:.3f} {res['cublas_wall_ms']:.3f} | "
                          + " ".join(f"{res[f'{v}_gpu_x']:.2f}" for v in variants)
                          + f" {res['ceiling_x']:.2f} | {res['lora_path_x']:.2f} | "
                          f"{res['peft_host_ms']:.3f} {res['cublas_host_ms']:.3f}", flush=True)
                    if out:  # after every layer: a run cut short keeps what it measured
                        with open(out, "w") as f:
                            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows),
                                      f, indent=1)
    for d_out in (4096, 14336):
        sel = [r for r in rows if r["d_out"] == d_out]
        for key, what in ([(f"{v}_gpu_x", f"{v} vs PEFT, GPU time") for v in variants]
                          + [("ceiling_x", "ceiling (PEFT / frozen GEMMs alone)"),
                             ("lora_path_x", "LoRA path alone (layer minus frozen GEMMs) vs PEFT's")]):
            v = sorted(r[key] for r in sel)
            print(f"4096 -> {d_out}: {what}: min {v[0]:.2f} / median {(v[5] + v[6]) / 2:.2f} / max {v[-1]:.2f}x")


def dsdb_packed(out: str | None) -> None:
    import json

    from bench_kernels import timed

    from bdlora.kernels.cublas import dsdb_dense
    from bdlora.layout import pack_block_diagonal, unpack_block_diagonal

    t, dt, rows = 8192, torch.bfloat16, []
    print("d_out r N | GPU ms: packed  dense+pack | x", flush=True)
    for d_out in (1024, 4096, 14336):
        for r in (16, 64):
            for n in (4, 8):
                dy = torch.randn(t, d_out, device="cuda", dtype=dt)
                s = torch.randn(t, r, device="cuda", dtype=dt)
                b = unpack_block_diagonal(torch.randn(d_out, r // n, device="cuda", dtype=dt) / 8, n)
                ref_ds, ref_db = dy.float() @ b.float(), pack_block_diagonal(dy.float().t() @ s.float(), n)
                def packed():
                    return dsdb_dense(dy, s, b, n)

                def dense():
                    ds, db = dsdb_dense(dy, s, b, 1)
                    return ds, pack_block_diagonal(db, n)

                for fn in (packed, dense):  # both against the reference before any timing
                    ds, db = fn()
                    for got, want in ((ds, ref_ds), (db, ref_db)):
                        err = (got - want).abs().max().item() / want.abs().max().item()
                        assert err < 2e-2, f"dsdb d_out={d_out} r={r} N={n}: relative error {err:.3g}"
                res = dict(d_out=d_out, r=r, N=n, rows=t, packed_ms=timed(packed, iters=20, batch=10),
                           dense_pack_ms=timed(dense, iters=20, batch=10))
                res["x"] = res["dense_pack_ms"] / res["packed_ms"]
                rows.append(res)
                print(f"{d_out} {r} {n} | {res['packed_ms']:.4f} {res['dense_pack_ms']:.4f} | {res['x']:.2f}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cublas")
    ap.add_argument("--grid", action="store_true", help="GPU and wall time over the layer grid (JSON to --out)")
    ap.add_argument("--d-out", type=int, default=4096, help="output width of the cases (14336: the MLP shape)")
    ap.add_argument("--rounds", type=int, default=3, help="grid: GPU-time samples per layer (median kept)")
    ap.add_argument("--variants", default="cublas,twogemm,maskdrop",
                    help="grid: the cuBLAS-layer variants to time beside PEFT (of %s)" % ",".join(VARIANTS))
    ap.add_argument("--host-profile", action="store_true", help="cProfile the host side of each case instead")
    ap.add_argument("--dsdb", action="store_true", help="the dS/dB kernel alone, packed dB against dense + pack")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_layer: no CUDA GPU here")
        return
    if args.dsdb:
        return dsdb_packed(args.out)
    if args.grid:
        return grid(args.out, args.rounds, args.variants.split(","))
    import bdlora.kernels as K
    from bench_kernels import PeftBdLayer, make_adapter

    t, d_in, d_out, dt = 8192, 4096, args.d_out, torch.bfloat16
    lines = []
    if not args.host_profile:  # the frozen GEMMs alone (forward, dX), for the kernels both layers share
        w = torch.randn(d_out, d_in, device="cuda", dtype=dt) / 64  # the cases' weights, data alike
        x = torch.randn(t, d_in, device="cuda", dtype=dt, requires_grad=True)
        gy = torch.randn(t, d_out, device="cuda", dtype=dt)
        tab, ms, gpu_ms = profiled(lambda: torch.autograd.grad(torch.nn.functional.linear(x, w), [x], gy))
        lines.append(f"\n== frozen base alone {d_in}->{d_out}: {ms:.3f} ms/iter wall, {gpu_ms:.3f} ms/iter of GPU "
                     f"kernels\n{tab}")
        print(lines[-1], flush=True)
    for r, layout, n, p in CASES:
        ad = make_adapter(K, d_in, d_out, r, layout, n, dt, p)
        w = torch.randn(d_out, d_in, device="cuda", dtype=dt) / 64
        x = torch.randn(t, d_in, device="cuda", dtype=dt, requires_grad=True)
        gy = torch.randn(t, d_out, device="cuda", dtype=dt)
        base = torch.nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=dt).requires_grad_(False)
        base.weight.copy_(w)
        peft = PeftBdLayer(base, ad, p)
        ours = lambda: torch.autograd.grad(
            K.fused_lora_linear(x, w, None, [0, t], [ad], dropout_seed=1 if p else None,
                                options=K.KernelOptions(backend=args.backend)).out,
            [x, ad.lora_A, ad.lora_B], gy)
        theirs = lambda: torch.autograd.grad(peft(x), [x, peft.lora_a.weight, peft.lora_b.weight], gy)
        for name, fn in (("ours[%s]" % args.backend, ours), ("peft", theirs)):
            if args.host_profile:  # Python-level host time (cProfile) instead of kernels
                from bench_kernels import host_profile

                table = host_profile(fn, 50, 22)
                lines.append(f"\n== host {name} r={r} layout={layout} N={n} dropout={p} (50 calls)\n{table}")
                print(lines[-1], flush=True)
                continue
            tab, ms, gpu_ms = profiled(fn)
            lines.append(f"\n== {name} {d_in}->{d_out} r={r} layout={layout} N={n} dropout={p}: {ms:.3f} ms/iter wall, "
                         f"{gpu_ms:.3f} ms/iter of GPU kernels (5 iterations profiled)\n{tab}")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("".join(lines))


if __name__ == "__main__":
    main()
