"""Per-kernel CUDA times of one fused BD-LoRA layer fwd+bwd (torch.profiler); a diagnosis aid for bench_kernels."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main():
    if not torch.cuda.is_available():
        print("profile_layer: no CUDA GPU here")
        return
    import bdlora.kernels as K
    from torch.profiler import ProfilerActivity, profile

    t, d_in, d_out = 8192, 4096, 4096
    for r, layout, n, p in [(16, "column", 1, 0.1), (64, "row", 4, 0.1), (16, "column", 4, 0.0)]:
        na, nb = (n, 1) if layout == "row" else (1, n)
        dt = torch.bfloat16
        ad = K.LoraAdapter((torch.randn(r, d_in // na, device="cuda") / 64).to(dt).requires_grad_(),
                           (torch.randn(d_out, r // nb, device="cuda") / 8).to(dt).requires_grad_(), 2.0, layout, n, p)
        w = torch.randn(d_out, d_in, device="cuda", dtype=dt)
        x = torch.randn(t, d_in, device="cuda", dtype=dt, requires_grad=True)
        gy = torch.randn(t, d_out, device="cuda", dtype=dt)
        fn = lambda: torch.autograd.grad(K.fused_lora_linear(x, w, None, [0, t], [ad]), [x, ad.lora_a, ad.lora_b], gy)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"\n== r={r} layout={layout} N={n} dropout={p} (5 iterations)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    main()
