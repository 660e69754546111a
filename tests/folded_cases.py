"""Random folded layers for the folded-kernel tests (test_kernels_lora.py, test_kernels_serving.py): a base weight with
per-(slice, slot) LoRA factors of ragged ranks folded under it, and the float64 oracle built from the separate
factors. Import after the test module has set TRITON_INTERPRET (this imports bdlora.kernels)."""
import torch

import bdlora.kernels as K


def folded_layer(gen, ranks, d_outs, d_in, a_div: float = 1.0):
    """w (sum d_outs, d_in), per-slice lists of (A / a_div, B) per slot (None for rank 0), the folded [W; A], the
    stacked B, the slot ranks and the slice offsets."""
    n_s, n_l, r_max = len(d_outs), len(ranks), max(ranks)
    w = torch.randn(sum(d_outs), d_in, generator=gen) / d_in ** 0.5
    per_slice = [[None if r == 0 else (torch.randn(r, d_in, generator=gen) / a_div, torch.randn(d, r, generator=gen))
                  for r in ranks] for d in d_outs]
    _, b, rk, offs = K.stack_decode_weights(per_slice, r_max)
    folded = K.fold_weight(w, n_s, n_l, r_max)
    a_view = folded.lora_a(n_s, n_l, r_max)
    for s, sl in enumerate(per_slice):
        for slot, pair in enumerate(sl):
            if pair is not None:
                a_view[s, slot, : pair[0].shape[0]] = pair[0]
    return w, per_slice, folded, b, rk, offs


def folded_oracle(x, w, per_slice, idx, ranks, scales, offs):
    """float64 y = x W^T + sum over slices of scales[a] (x A) B for the tokens with a slot a = idx[t] >= 0 of rank
    > 0."""
    want = x.double() @ w.double().t()
    for ti, ai in enumerate(idx):
        if ai < 0 or ranks[ai] == 0:
            continue
        for s, (lo, hi) in enumerate(zip(offs, offs[1:])):
            la, lb = per_slice[s][ai]
            want[ti, lo:hi] += float(scales[ai]) * (x[ti].double() @ la.double().t()) @ lb.double().t()
    return want
