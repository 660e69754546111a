"""The serving kernels of ``--enable-bdlora`` (``decode_lora_folded``: one GEMM with [W; A], then the per-token or the
tiled expand kernel; or the one-launch kernel doing all three) against a float64 oracle built from the separate factors, on fresh random ragged inputs (slots
of different ranks, an empty slot, tokens without LoRA, in any order), on CPU through the Triton interpreter; and the
per-GPU tuning table (``bdlora.vllm_plugin.fast_path.tuning``). No timing here: speed is measured by
bench/kernels/bench_serving_kernels.py on a GPU.
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and bdlora.kernels) is imported
for _m in [m for m in sys.modules if m.startswith("bdlora.kernels")]:
    del sys.modules[_m]  # a module imported earlier without the interpreter would freeze the torch path

import pytest  # noqa: E402
import torch  # noqa: E402

import bdlora.kernels as K  # noqa: E402
from bdlora.kernels.decode import GEMV_MAX_TOKENS, ExpandTiles, GemvTiles, GemvWorkspace  # noqa: E402
from bdlora.vllm_plugin.fast_path.tuning import (CONFIG_DIR, UNLIMITED, ServingTuning, read_config,  # noqa: E402
                                                 serving_tuning)

GPU_FILES = ("NVIDIA H200", "NVIDIA H100 80GB HBM3")
from folded_cases import folded_layer, folded_oracle  # noqa: E402


def _oracle_case(seed: int, ranks, d_outs, t: int, d_in: int, p_none: float = 0.2):
    """Random base weight, per-(slice, slot) factors of ragged ranks folded under it, random token -> slot map
    (-1 with probability p_none); the float64 oracle y = x W^T + sum over slices of scales[a] (x A) B."""
    gen = torch.Generator().manual_seed(seed)
    n_l = len(ranks)
    w, per_slice, folded, b, rk, offs = folded_layer(gen, ranks, d_outs, d_in, a_div=d_in ** 0.5)
    x = torch.randn(t, d_in, generator=gen)
    scales = torch.rand(n_l, generator=gen) + 0.5
    idx = torch.randint(0, n_l, (t,), generator=gen, dtype=torch.int32)
    idx[torch.rand(t, generator=gen) < p_none] = -1
    return folded, x, b, idx, rk, scales, offs, folded_oracle(x, w, per_slice, idx.tolist(), ranks, scales, offs)


CASES = [  # (ranks per slot, slice widths, tokens, d_in)
    ([12], [64, 16, 16], 1, 64),  # one slot (ONE_SLOT speculative loads), qkv-like
    ([12], [96], 37, 48),  # one slot, one slice, ragged token tiles
    ([12], [40, 24], 3, 32),  # one slot, tiles straddling two slices (B is loaded per tile, masked per slice)
    ([8, 16, 0, 32, 5], [64, 32, 32], 9, 64),  # several slots, an empty one, ragged ranks
    ([8, 16, 0, 32, 5], [40, 72], 50, 32),  # two slices of widths that are no tile multiple
    ([4, 24], [48, 16, 16, 24], 23, 40),  # four slices (the most the kernels take)
    ([38, 0, 40, 19], [48, 16, 16], 6, 48),  # a buffer rank of 40 (bdlora.max_rank 152 at TP=4: 38 in 40 rows)
]


@pytest.mark.parametrize("kernel", ["decode", "gemm", "gemv"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_folded_kernels_match_float64_oracle(kernel, case):
    ranks, d_outs, t, d_in = CASES[case]
    folded, x, b, idx, rk, scales, offs, want = _oracle_case(100 + case, ranks, d_outs, t, d_in)
    tiles = ExpandTiles(16, 32, 1)
    gemv_tiles = GemvTiles(16, 16, split_k=3, warps=1, stages=1)  # tiles straddling slices, split-K hand-offs
    y, d = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel=kernel, tiles=tiles,
                                gemv_tiles=gemv_tiles, options=K.KernelOptions(backend="triton"))
    assert d.backend == "triton" and y.shape == (t, sum(d_outs))
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)
    y_t, d = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel=kernel,
                                  options=K.KernelOptions(backend="torch"))
    assert d.backend == "torch"
    torch.testing.assert_close(y_t.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["decode", "gemm", "gemv"])
def test_pdl_request_is_ignored_where_the_device_has_none(kernel):
    """``pdl=True`` asks for programmatic dependent launch; on a device without it (CPU, the interpreter, pre-Hopper)
    the call is the plain launch, bit for bit. (On Hopper, bench/kernels/bench_serving_kernels.py checks the pdl
    launches against float64 and bench/serve/gpu_parity.py serves through them.)"""
    from bdlora.kernels.dispatch import pdl_ok

    assert not pdl_ok(torch.device("cpu"))
    folded, x, b, idx, rk, scales, offs, want = _oracle_case(5, [8, 16], [40, 24], 6, 32)
    ys = [K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel=kernel, pdl=pdl,
                               gemv_tiles=GemvTiles(16, 16, 2, 1, 1), options=K.KernelOptions(backend="triton")).out
          for pdl in (False, True)]
    assert torch.equal(ys[0], ys[1])
    torch.testing.assert_close(ys[1].double(), want, rtol=1e-4, atol=1e-4)
    if kernel == "decode":  # and the two-launch kernel (decode_lora), on the same factors
        w = folded.w_ext[:folded.d_out]
        soff = torch.tensor(offs, dtype=torch.int32)
        a = folded.lora_a(len(offs) - 1, b.shape[0], b.shape[2])
        two = [K.decode_lora(x @ w.T, x, a, b, idx, rk, scales, offs, soff=soff, pdl=pdl,
                             options=K.KernelOptions(backend="triton")).out for pdl in (False, True)]
        assert torch.equal(two[0], two[1])
        torch.testing.assert_close(two[1].double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tiles", [ExpandTiles(16, 16, 1), ExpandTiles(32, 64, 2), ExpandTiles(64, 16, 4)])
def test_gemm_kernel_any_tiles_and_mixed_tiles(tiles):
    """Token tiles mixing several slots and rows without LoRA, and every tile shape: the same result."""
    folded, x, b, idx, rk, scales, offs, want = _oracle_case(7, [8, 16, 0, 32], [40, 24], 70, 32, p_none=0.3)
    y = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemm", tiles=tiles).out
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tiles", [ExpandTiles(16, 16, 1), ExpandTiles(32, 64, 2), ExpandTiles(64, 16, 4)])
@pytest.mark.parametrize("case", [3, 4, 5, 6, 7])
def test_gemm_kernel_on_tokens_grouped_by_slot(tiles, case):
    """``sort_tokens``: the tiled kernel on the tokens grouped by slot (each tile one slot's rows, SGMV's segments),
    for several slots of ragged ranks, an empty one, tokens without LoRA in any order, and fewer tokens than slots
    (the grid is then one tile per token): the float64 oracle."""
    ranks, d_outs, t, d_in = (CASES + [([8, 16, 0, 32, 5, 12, 3, 7], [40, 24], 3, 32)])[case]
    folded, x, b, idx, rk, scales, offs, want = _oracle_case(700 + case, ranks, d_outs, t, d_in, p_none=0.3)
    y, d = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemm", tiles=tiles, sort_tokens=True,
                                options=K.KernelOptions(backend="triton"))
    assert d.backend == "triton"
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)


# no slot, one slot, four interleaved (requests cycling over adapters), ids past the slots (counted as none)
SORTED_MAPS = [[-1] * 7, [2] * 19, [0, 1, 2, 3] * 9, [3, -1, 0, 0, 9, -1, 1] * 5]


def test_sorted_plan_follows_its_slot_map_and_masks_the_padding():
    """A prepared launch (as a served layer keeps one) on a slot map longer than the call's tokens (a CUDA graph's
    padding, and the rest of the buffer: -1 past the batch, here with a stale id too), its ``SlotSegments``
    regrouped in place after each new map: every call equals the oracle of the map it ran under (the tokens past T
    are grouped but masked), and the groups are the stable order with the tokens without a slot (or an id past the
    slots) last."""
    from bdlora.kernels.decode import FoldedLaunch

    ranks = [8, 16, 0, 12]
    folded, x, b, _, rk, scales, offs, _ = _oracle_case(730, ranks, [32, 16, 16], 40, 32)
    gen = torch.Generator().manual_seed(731)
    w = folded.w_ext[:folded.d_out]
    per_slice = [[None if r == 0 else (folded.lora_a(3, 4, b.shape[2])[s, slot, :r], b[slot, lo:hi, :r])
                  for slot, r in enumerate(ranks)] for s, (lo, hi) in enumerate(zip(offs, offs[1:]))]
    buf = torch.full((64,), -1, dtype=torch.int32)
    seg = K.slot_segments(buf, len(ranks))
    plan = FoldedLaunch(folded, b, buf, rk, scales, offs, kernel="gemm", tiles=ExpandTiles(16, 16, 1), segments=seg)
    for m in SORTED_MAPS:
        t = len(m)
        buf.fill_(-1)
        buf[:t] = torch.tensor(m, dtype=torch.int32)
        buf[t + 3] = 1  # a stale id past the call's tokens: grouped, never read (the kernel masks tokens >= T)
        seg.update(buf)
        key = torch.where((buf >= 0) & (buf < 4), buf.long(), 4)
        assert torch.equal(seg.order.long(), torch.sort(key, stable=True).indices)
        assert seg.starts.tolist() == [0] + torch.bincount(key, minlength=5).cumsum(0).tolist()
        xt = torch.randn(t, x.shape[1], generator=gen)
        ids = [v if 0 <= v < 4 else -1 for v in m]
        want = folded_oracle(xt, w, per_slice, ids, ranks, scales, offs)
        torch.testing.assert_close(plan(xt).double(), want, rtol=1e-4, atol=1e-4)


def test_sorted_segments_refusals():
    from bdlora.kernels.decode import FoldedLaunch

    folded, x, b, idx, rk, scales, offs, _ = _oracle_case(740, [8, 16], [32], 5, 32)
    for seg, kernel in ((K.slot_segments(idx, 3), "gemm"), (K.slot_segments(idx[:4], 2), "gemm"),
                        (K.slot_segments(idx, 2), "decode")):
        with pytest.raises(ValueError, match="segments"):
            FoldedLaunch(folded, b, idx, rk, scales, offs, kernel=kernel, segments=seg)
    with pytest.raises(ValueError, match="slot ids for buffers"):
        K.slot_segments(idx, 2).update(idx[:3])


@pytest.mark.parametrize("tiles", [GemvTiles(16, 16, 1, 1, 1), GemvTiles(32, 32, 2, 2, 2), GemvTiles(16, 64, 4, 1, 1)])
def test_gemv_kernel_tiles_and_shared_workspace(tiles):
    """The one-launch kernel on one workspace shared by two folds of different shapes, called again and again: every
    call equals the oracle bit for bit the same, and its counters are back to zero after each call (the next call,
    or a CUDA graph's next replay, starts clean)."""
    ws = GemvWorkspace("cpu", torch.float32)
    cases = [_oracle_case(21, [8, 16, 0, 32], [40, 24], 13, 32, p_none=0.3), _oracle_case(22, [12], [64, 16, 16], 1, 48)]
    for folded, x, *_ in cases:
        ws.reserve(folded, x.shape[0], tiles)
    for _ in range(2):
        for folded, x, b, idx, rk, scales, offs, want in cases:
            y = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemv", gemv_tiles=tiles,
                                     workspace=ws).out
            torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)
            assert not ws.counters.any(), ws.counters
    folded, x, b, idx, rk, scales, offs, _ = cases[0]
    runs = [K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemv", gemv_tiles=tiles,
                                 workspace=ws).out for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


SLOT_MAPS = [[3], [3, -1, 3, 3, -1], [2], [1, 3, -1, 1], [-1, -1]]  # one slot of several (rank 0 too), two, none


@pytest.mark.parametrize("kernel", ["gemm", "gemv"])
@pytest.mark.parametrize("slots", range(len(SLOT_MAPS)))
def test_folded_tile_of_one_slot_of_several(kernel, slots):
    """Several slots, and every token with a slot on the same one (or on two, or none): the expand takes that slot's
    B loaded before the wait (``_tile_slot``) and the shared-shrink kernel computes only the shrink rows the expand
    reads (used slots, below their rank). Garbage in the A rows past each slot's rank changes nothing; the shrink
    the A tiles leave in the workspace is zero outside the used rows and x @ A inside them."""
    idx = torch.tensor(SLOT_MAPS[slots], dtype=torch.int32)
    ranks = [8, 16, 0, 12]
    folded, x, b, _, rk, scales, offs, _ = _oracle_case(440 + slots, ranks, [32, 16, 16], len(idx), 32)
    n_s, n_l, r = len(offs) - 1, len(ranks), b.shape[2]
    a_view = folded.lora_a(n_s, n_l, r)
    for slot, rank in enumerate(ranks):
        a_view[:, slot, rank:] = 1e4  # past the slot's rank: never part of its term
    want = K.decode_lora_folded_ref(x.double(), folded.w_ext.double(), folded.d_out, b.double(), idx, rk,
                                    scales.double(), offs)
    tiles = GemvTiles(16, 16, 2, 1, 1)
    ws = GemvWorkspace("cpu", torch.float32).reserve(folded, len(idx), tiles)
    ws.shrink.fill_(float("nan"))
    y = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel=kernel, tiles=ExpandTiles(16, 16, 1),
                             gemv_tiles=tiles, workspace=ws).out
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)
    if kernel == "gemv":
        a_rows = folded.w_ext.shape[0] - folded.d_out
        shrink = ws.shrink[:len(idx) * a_rows].view(len(idx), a_rows)
        j = torch.arange(a_rows)
        slot_j, r_j = (j // r) % n_l, j % r
        used = torch.isin(slot_j, idx) & (r_j < rk.long()[slot_j])
        assert torch.equal(shrink[:, ~used], torch.zeros_like(shrink[:, ~used]))
        torch.testing.assert_close(shrink[:, used], (x @ folded.w_ext[folded.d_out:].T)[:, used])


@pytest.mark.parametrize("kernel", ["gemm", "gemv"])
def test_folded_expand_of_many_slots_one_dot_and_slot_loop(kernel):
    """Tiles of tokens on many slots: where every slot's rank rows fit one tile (``all_slots_block`` > 0) the expand
    is ONE tl.dot over all of them, B read at once; where they do not (8 slots of rank 64 by 64 columns) it loops
    over the slots. Both equal the float64 oracle, with ragged ranks, an empty slot and tokens without LoRA, and with
    garbage in the A rows past each slot's rank."""
    from bdlora.kernels.decode import _expand_warps, all_slots_block

    ranks = [64, 3, 0, 40, 17, 64, 9, 33]
    folded, x, b, idx, rk, scales, offs, _ = _oracle_case(460, ranks, [64, 64], 21, 32, p_none=0.2)
    a_view = folded.lora_a(2, len(ranks), 64)
    for slot, rank in enumerate(ranks):
        a_view[:, slot, rank:] = 1e4
    want = K.decode_lora_folded_ref(x.double(), folded.w_ext.double(), folded.d_out, b.double(), idx, rk,
                                    scales.double(), offs)
    # 64 B elements per thread: 4 slots of rank 64 by 64 columns need 8 warps (the expand kernel takes them), 8 by
    # 16 columns 4 (the one-launch kernel keeps its tiles' warps: with fewer it loops); one slot never
    assert all_slots_block(1, 64, 16, 8) == 0 and all_slots_block(4, 64, 64, 8) == 256
    assert all_slots_block(4, 64, 64, 4) == 0 and _expand_warps(4, 64, 64, 4) == 8 and _expand_warps(4, 64, 16, 4) == 4
    assert all_slots_block(8, 64, 16, 4) == 512 and all_slots_block(8, 64, 64, 8) == 0
    # the H100's 16 x 32 one-warp rows (4 slots of rank 64): one dot, on 4 warps
    assert all_slots_block(4, 64, 32, 8) == 256 and _expand_warps(4, 64, 32, 1) == 4
    for block_n in (16, 32, 64):  # 512 rank rows x 16 or 32 columns: one dot; x 64: past 8 warps' registers: loop
        y = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel=kernel,
                                 tiles=ExpandTiles(16, block_n, 1), gemv_tiles=GemvTiles(block_n, 16, 2, 4, 1),
                                 options=K.KernelOptions(backend="triton")).out
        torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4, msg=f"block_n {block_n}")


LOCAL_CASES = [case for case in CASES if all(w % 16 == 0 for w in case[1][:-1])]  # slice offsets fit block_n 16


@pytest.mark.parametrize("tiles", [GemvTiles(16, 16, 1, 1, 1, True), GemvTiles(16, 16, 3, 1, 1, True),
                                   GemvTiles(16, 32, 2, 2, 2, True), GemvTiles(16, 16, 3, 1, 1, True, True)])
@pytest.mark.parametrize("case", range(len(LOCAL_CASES)))
def test_gemv_local_shrink_matches_float64_oracle(tiles, case):
    """The one-launch kernel with the shrink computed per tile (``local_shrink``): every tile reads its own slice's
    A rows, so several slots, empty slots, ragged ranks, tokens without LoRA and split-K hand-offs all go through
    it without any wait on other programs. Equal to the oracle, bit-identical when called again, counters back to
    zero; 8 tokens of one slot (BLOCK_M 16 padding) too."""
    ranks, d_outs, t, d_in = LOCAL_CASES[case]
    folded, x, b, idx, rk, scales, offs, want = _oracle_case(300 + case, ranks, d_outs, t, d_in)
    ws = GemvWorkspace("cpu", torch.float32).reserve(folded, t, tiles)
    ys = [K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemv", gemv_tiles=tiles, workspace=ws,
                               options=K.KernelOptions(backend="triton")).out for _ in range(2)]
    torch.testing.assert_close(ys[0].double(), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(ys[0], ys[1]) and not ws.counters.any(), ws.counters


@pytest.mark.parametrize("seed", range(6))
def test_gemv_one_token_matches_float64_oracle(seed):
    """``one_token``: a one-token call of the per-tile kernel accumulates fp32 products through its K loop and sums
    them once (BLOCK_M = 1, no tl.dot; 48 inputs in 3 steps of 16), and reads only its own slot's A rows (BLOCK_J =
    the rank, not slots x rank): a token of any of 5 slots (ragged ranks, an empty one) or without LoRA, split-K or
    not, its K loop pipelined or not, equals the oracle, and equals the tl.dot kernel's result to fp32 rounding;
    more than one token runs the tl.dot kernel, bit for bit the same as without the flag."""
    for ranks in ([8, 16, 0, 32, 5], [16], [38, 40, 0]):  # buffer ranks 32, 16 and 40 (no power of 2)
        folded, x, b, idx, rk, scales, offs, want = _oracle_case(400 + seed, ranks, [64, 32, 32], 1, 48,
                                                                 p_none=0.3)
        for split_k, stages in ((1, 1), (3, 3)):  # stages > 1: the K loop pipelined on a GPU (same sums)
            one = GemvTiles(16, 16, split_k, 1, stages, True, True)
            assert one.shrink_rows(1, 5, 32) == 32 and one.shrink_rows(2, 5, 32) == 256  # 1 token: its slot's
            y = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemv", gemv_tiles=one).out
            torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)
            y_dot = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemv",
                                         gemv_tiles=GemvTiles(16, 16, split_k, 1, 1, True)).out
            torch.testing.assert_close(y, y_dot, rtol=1e-5, atol=1e-5)
    folded, x, b, idx, rk, scales, offs, _ = _oracle_case(410 + seed, [8, 16], [64, 32, 32], 3, 48)
    ys = [K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemv",
                               gemv_tiles=GemvTiles(16, 16, 2, 1, 1, True, flag)).out
          for flag in (False, True)]
    assert torch.equal(ys[0], ys[1])


def test_gemv_one_token_every_slot_of_many():
    """One token on each of 6 slots in turn (and on none): only that slot's rows are read, at their place among
    the others' (slot a's rows start at a * R of its slice), and the result is the oracle's."""
    ranks = [4, 16, 9, 0, 16, 12]
    folded, x, b, _, rk, scales, offs, _ = _oracle_case(420, ranks, [32, 32], 1, 32)
    one = GemvTiles(16, 16, 2, 1, 1, True, True)
    for a in range(-1, len(ranks)):
        idx = torch.tensor([a], dtype=torch.int32)
        want = K.decode_lora_folded_ref(x.double(), folded.w_ext.double(), folded.d_out, b.double(), idx, rk,
                                        scales.double(), offs)
        y = K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemv", gemv_tiles=one).out
        torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4, msg=f"slot {a}")


def test_gemv_local_shrink_refuses_tiles_straddling_slices():
    """A tile of the local-shrink kernel reads one slice's A rows: slice offsets that are no multiple of block_n are
    refused with the fix named, and the tuning table skips such a row for that layer."""
    folded, x, b, idx, rk, scales, offs, _ = _oracle_case(4, [8], [40, 24], 3, 32)
    with pytest.raises(ValueError, match=r"multiple of block_n=16; got offsets \[0, 40, 64\].*local_shrink=False"):
        K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemv",
                             gemv_tiles=GemvTiles(16, 16, 1, 1, 1, True))
    g, _ = serving_tuning("cpu", override={"fold_gemv_max": 4, "gemv_shapes": [[0, 0, 16, 16, 2, 1, 1, 1]]})
    assert g.gemv_tiles_for(32, 64, (0, 40, 64)) is None
    assert g.gemv_tiles_for(32, 64, (0, 48, 64)) == GemvTiles(16, 16, 2, 1, 1, local_shrink=True)


def test_gemv_kernel_refusals():
    folded, x, b, idx, rk, scales, offs, _ = _oracle_case(5, [8], [32], 2, 16)
    with pytest.raises(ValueError, match=f"at most {GEMV_MAX_TOKENS} tokens"):
        big = torch.zeros(GEMV_MAX_TOKENS + 1, 16)
        K.decode_lora_folded(big, folded, b, torch.zeros(GEMV_MAX_TOKENS + 1, dtype=torch.int32), rk, scales, offs,
                             kernel="gemv")
    small = GemvWorkspace("cpu", torch.float32)  # never reserved
    with pytest.raises(ValueError, match="reserve it for the largest call first"):
        K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="gemv", workspace=small)
    with pytest.raises(ValueError, match="split_k must be 1-64"):
        GemvTiles(16, 64, 0)
    with pytest.raises(ValueError, match="power of two >= 16"):
        GemvTiles(24, 64)
    with pytest.raises(ValueError, match="one_token needs local_shrink=True"):
        GemvTiles(16, 64, 1, 4, 3, False, True)


@pytest.mark.parametrize("dtype,kernels", [(torch.float16, ("decode", "gemm", "gemv", "gemv_local")),
                                           (torch.bfloat16, ("decode",))])
def test_folded_kernels_16bit_close_to_oracle(dtype, kernels):
    """16-bit inputs (serving): within 16-bit rounding of the float64 oracle. (bf16 tl.dot is wrong under the CPU
    interpreter, not on GPUs: the bf16 tiled kernel is checked on the GPU by bench_serving_kernels.py's check.)"""
    folded, x, b, idx, rk, scales, offs, want = _oracle_case(11, [16, 8], [64, 32, 32], 20, 64)
    fb = K.fold_weight(folded.base.to(dtype), 3, 2, 16)
    fb.w_ext[fb.d_out:].copy_(folded.w_ext[folded.d_out:].to(dtype))
    for kernel in kernels:
        local = kernel == "gemv_local"
        y = K.decode_lora_folded(x.to(dtype), fb, b.to(dtype), idx, rk, scales, offs, kernel=kernel[:4] if local
                                 else kernel, gemv_tiles=GemvTiles(16, 32, 2, 1, 1, True) if local else None).out
        err = (y.double() - want).abs().max() / want.abs().max()
        assert y.dtype == dtype and err < 2e-2, (kernel, float(err))


def test_folded_refuses_bad_kernel_and_too_many_slices():
    folded, x, b, idx, rk, scales, offs, _ = _oracle_case(3, [8], [32], 2, 16)
    with pytest.raises(ValueError, match="kernel must be one of"):
        K.decode_lora_folded(x, folded, b, idx, rk, scales, offs, kernel="bgmv")
    f5 = K.fold_weight(torch.zeros(40, 16), 5, 1, 8)
    with pytest.raises(ValueError, match="5 slices; 1 to 4"):
        K.decode_lora_folded(x, f5, torch.zeros(1, 40, 8), idx, rk, scales, [0, 8, 16, 24, 32, 40])
    with pytest.raises(ValueError, match="power of two >= 16"):
        ExpandTiles(8, 64, 4)


def test_tuning_table_lookup_and_overrides():
    t, src = serving_tuning("cuda", "NVIDIA H200")
    assert src == "NVIDIA_H200.json" and t.fold and t.fold_gemm_max == UNLIMITED
    assert t == ServingTuning.from_dict(read_config(CONFIG_DIR / "NVIDIA_H200.json"))
    table = t.gemm_rows()  # gemm_tiles alone: no layer shape
    assert table.tiles_for(1) == ExpandTiles(*t.gemm_tiles[0][1:])
    assert table.tiles_for(10 ** 6) == ExpandTiles(*t.gemm_tiles[-1][1:])
    u, src = serving_tuning("cuda", "Some Future GPU")
    assert src == "default_cuda.json" and u.fold and u.fold_gemm_max == 256  # conservative: vLLM's kernels above
    c, src = serving_tuning("cpu")
    assert src == "cpu.json" and not c.fold and c.fold_gemm_max == 0 and c.two_launch_max == 0
    o, src = serving_tuning("cpu", override={"fold": True, "fold_decode_max": 2, "fold_gemm_max": 16,
                                             "gemm_tiles": [[16, 16, 32, 1]]})
    assert src == "cpu.json + override" and o.fold and o.fold_decode_max == 2
    assert o.gemm_rows().tiles_for(5).block_n == 32
    # the one-launch kernel: only on the shapes measured for it (Hopper), any shape with a 0, 0 row; PDL on Hopper
    assert t.fold_gemv_max == 16 and t.gemv_tiles_for(3584, 4096) == GemvTiles(*t.gemv_shapes[0][2:])
    assert t.gemv_tiles_for(4096, 1536) is None
    h100, _ = serving_tuning("cuda", "NVIDIA H100 80GB HBM3")
    assert h100.gemv_tiles_for(4096, 3584) == t.gemv_tiles_for(4096, 3584) and h100.pdl and t.pdl
    assert t.gemv_tiles_for(512, 4096).local_shrink and not t.gemv_tiles_for(3584, 4096).local_shrink  # TP=8's o
    # a shared-shrink row while the slots' rank rows per slice are at most gemv_shared_max_rows (128 on Hopper):
    # TP=4's down with 4 slots of rank 64 (256) takes the tiled path, TP=8's gate_up with 4 of rank 32 keeps it
    for tab in (t, h100):
        assert tab.gemv_tiles_for(3584, 4096, None, 1, 64) is not None and tab.gemv_tiles_for(3584, 4096, None, 2, 64)
        assert tab.gemv_tiles_for(3584, 4096, None, 4, 64) is None
        assert tab.gemv_tiles_for(4096, 3584, None, 4, 32) == tab.gemv_tiles_for(4096, 3584)
    assert u.gemv_shared_max_rows == UNLIMITED
    assert not u.pdl and not c.pdl  # unmeasured GPUs and CPU: plain launches
    assert not u.gemm_sorted and not c.gemm_sorted  # the tiled kernel on unsorted tokens unless measured
    assert serving_tuning("cpu", override={"gemm_sorted": True})[0].gemm_sorted
    with pytest.raises(ValueError, match="gemm_sorted must be true or false"):
        serving_tuning("cpu", override={"gemm_sorted": 1})
    assert h100.fold_gemm_max == t.fold_gemm_max and h100.gemm_tiles == t.gemm_tiles
    # the tiles a layer compiles before serving: every row whose token range meets its forwards' range
    rows = [ExpandTiles(*r[1:]) for r in t.gemm_tiles]
    assert table.tiles_between(1, UNLIMITED) == tuple(rows) and table.tiles_between(9, 128) == (rows[0],)
    assert table.tiles_between(129, 300) == tuple(rows[1:3]) and table.tiles_between(3000, UNLIMITED) == (rows[3],)
    unknown = u.gemm_rows()
    assert unknown.tiles_between(17, 256) == (ExpandTiles(32, 64, 4),) and unknown.tiles_between(300, 400) == ()
    g, _ = serving_tuning("cpu", override={"fold_gemv_max": 4, "gemv_shapes": [[0, 0, 16, 16, 2, 1, 1]]})
    assert g.gemv_tiles_for(7, 9) == GemvTiles(16, 16, 2, 1, 1)
    # one token: its own rows (the per-tile kernel with one_token), whatever fold_gemv_max is; TP=8's four modules
    one = t.gemv_one_token_tiles_for(512, 4096, (0, 4096))
    assert one.local_shrink and one.one_token and one == GemvTiles(*t.gemv_one_token_shapes[1][2:], True, True)
    assert t.gemv_one_token_tiles_for(4096, 768, (0, 512, 640, 768)) is not None
    assert t.gemv_one_token_tiles_for(4096, 7168) is None and g.gemv_one_token_tiles_for(7, 9) is None
    # measured per GPU: TP=8's gate_up pipelined (3 stages) on both, with other tiles; TP=4's qkv pipelined on the
    # H200 only; TP=4's down on both (one token), its gate_up on neither
    assert t.gemv_one_token_tiles_for(4096, 3584) == GemvTiles(64, 64, 8, 4, 3, True, True)
    assert h100.gemv_one_token_tiles_for(4096, 3584) == GemvTiles(128, 128, 4, 8, 3, True, True)
    assert t.gemv_one_token_tiles_for(4096, 1536).stages == 3 and h100.gemv_one_token_tiles_for(4096, 1536).stages == 1
    assert t.gemv_one_token_tiles_for(3584, 4096) == h100.gemv_one_token_tiles_for(3584, 4096) is not None
    o1, _ = serving_tuning("cpu", override={"gemv_one_token_shapes": [[0, 0, 32, 16, 2, 1, 1]]})
    assert o1.fold_gemv_max == 0 and o1.gemv_one_token_tiles_for(7, 64) == GemvTiles(32, 16, 2, 1, 1, True, True)
    assert o1.gemv_one_token_tiles_for(7, 64, (0, 48, 64)) is None  # a tile would straddle the slices at 48
    assert ServingTuning.from_dict({"fold_gemv_max": 0}, g).gemv_tiles_for(7, 9) is None
    # the per-tile shrink reads every slot's A rows at T > 1 (max_loras x rank), its own slot's at T == 1: rows of
    # more than gemv_local_max_rows (the H200's 128, measured; 64 unmeasured) skip it, on to the next row of the
    # shape or the tiled path
    assert t.gemv_local_max_rows == 128 and ServingTuning().gemv_local_max_rows == 64
    assert t.gemv_tiles_for(512, 4096, (0, 4096), 4, 32).local_shrink  # TP=8's o at 128 rows
    assert t.gemv_tiles_for(1792, 4096, (0, 4096), 8, 32) is None  # 256: down's tiles no longer fit
    # a shape's own limit (gemv_shape_max_rows): TP=8's down keeps its row to 64 rows (2 slots of rank 32) and runs
    # the tiled path with 4 (measured, H200); the H100 inherits it; other shapes keep the global limits
    for tab in (t, h100):
        assert tab.gemv_tiles_for(1792, 4096, (0, 4096), 2, 32).local_shrink
        assert tab.gemv_tiles_for(1792, 4096, (0, 4096), 4, 32) is None
        assert tab.gemv_one_token_tiles_for(1792, 4096, (0, 4096), 4, 32) is not None  # one token: its own 32 rows
    lim, _ = serving_tuning("cpu", override={"fold_gemv_max": 4, "gemv_shape_max_rows": [[7, 64, 256]],
                                             "gemv_shapes": [[0, 0, 16, 16, 2, 1, 1, 1], [0, 0, 32, 16, 2, 1, 1]]})
    assert lim.gemv_tiles_for(7, 64, None, 8, 32).local_shrink  # 256 rows: its own limit, above the global 64
    assert lim.gemv_tiles_for(8, 64, None, 8, 32) == GemvTiles(32, 16, 2, 1, 1)  # another shape: the global limit
    assert ServingTuning.from_dict({"gemv_shape_max_rows": [[7, 64, 0]]}, lim).gemv_tiles_for(7, 64, None, 1, 16) \
        is None  # 0: no row of the shape applies
    assert t.gemv_tiles_for(3584, 4096, (0, 4096), 8, 64) is None  # shared shrink: gemv_shared_max_rows (above)
    assert t.gemv_one_token_tiles_for(1792, 4096, (0, 4096), 8, 32) is not None  # one token: 32 rows, its own
    assert t.gemv_one_token_tiles_for(1024, 4096, (0, 4096), 1, 256) is None
    two, _ = serving_tuning("cpu", override={"fold_gemv_max": 4, "gemv_local_max_rows": 16, "gemv_shapes": [
        [0, 0, 16, 16, 2, 1, 1, 1], [0, 0, 32, 16, 2, 1, 1]]})
    assert two.gemv_tiles_for(7, 64, None, 1, 16) == GemvTiles(16, 16, 2, 1, 1, True)
    assert two.gemv_tiles_for(7, 64, None, 2, 16) == GemvTiles(32, 16, 2, 1, 1)  # the next row of the shape
    # the side stream: off in every entry until measured in serving; a shape row (0, 0: any) and a token limit
    assert all(serving_tuning("cuda", name)[0].side_max == 0 for name in GPU_FILES)
    side, _ = serving_tuning("cpu", override={"side_max": 8, "side_shapes": [[4096, 1536]]})
    assert side.side_for(4096, 1536) == (8, False) and side.side_for(1024, 4096) == (0, False)
    assert ServingTuning.from_dict({"side_shapes": [[0, 0]]}, side).side_for(7, 9) == (8, False)
    assert ServingTuning(side_shapes=((0, 0),)).side_for(7, 9) == (0, False)  # side_max 0: never
    # a third entry 1 defers the add to the next compiled kernel; the shape's own row wins over a (0, 0) row
    defer = ServingTuning.from_dict({"side_shapes": [[0, 0, 1], [4096, 1536, 0], [1024, 4096]]}, side)
    assert defer.side_shapes == ((0, 0, True), (4096, 1536, False), (1024, 4096))
    assert defer.side_for(7, 9) == (8, True) and defer.side_for(4096, 1536) == (8, False)
    assert defer.side_for(1024, 4096) == (8, False)
    for bad, msg in (({"fold_gemm_max": -1}, "token count"), ({"foo": 1}, "unknown keys"),
                     ({"side_max": -1}, "side_max must be"), ({"side_shapes": [[1, 2, 3]]}, "side_shapes must be"),
                     ({"side_shapes": [[1, 2, 0, 1]]}, "optional 0/1 \\(defer"),
                     ({"gemv_local_max_rows": -1}, "gemv_local_max_rows must be"),
                     ({"gemv_shared_max_rows": -1}, "gemv_shared_max_rows must be a row count"),
                     ({"gemv_shape_max_rows": [[1792, 4096]]}, "gemv_shape_max_rows must be rows of 3 ints"),
                     ({"gemv_shape_max_rows": [[1792, 4096, -1]]}, "gemv_shape_max_rows must be rows of 3"),
                     ({"fold_gemm_max": 64, "gemm_tiles": [[16, 16, 64, 4]]}, "covers fold_gemm_max"),
                     ({"wide_fold_max": 64}, "unknown keys"),
                     ({"gemm_tiles": [[UNLIMITED, 24, 64, 4]]}, "power of two"),
                     ({"fold_gemv_max": GEMV_MAX_TOKENS + 1}, "at most"),
                     ({"gemv_shapes": [[0, 0, 16, 16, 2]]}, "rows of 7 ints"),
                     ({"gemv_shapes": [[0, 0, 16, 16, 2, 1, 1, 2]]}, "optional 0/1"),
                     ({"gemv_shapes": [[0, 0, 16, 16, 2, 3, 1]]}, "warps"), ({"pdl": 1}, "true or false"),
                     ({"gemv_one_token_shapes": [[0, 0, 16, 16, 2, 1, 1, 1]]}, "gemv_one_token_shapes must be rows"),
                     ({"gemv_one_token_shapes": [[0, 0, 16, 24, 2, 1, 1]]}, "power of two"),
                     ({"gemm_shapes": [[0, 0, 256, 16, 16, 64]]}, "gemm_shapes must be rows of 7 ints"),
                     ({"gemm_shapes": [[0, 0, -1, 16, 16, 64, 4]]}, "gemm_shapes must be rows"),
                     ({"gemm_shapes": [[0, 0, 256, 16, 16, 48, 4]]}, "power of two")):
        with pytest.raises(ValueError, match=msg):
            serving_tuning("cpu", override=bad)


def test_gemm_rows_per_layer_shape_and_slot_rows():
    """A layer's tiled-kernel rows: its shape's ``gemm_shapes`` rows where its slots hold at least min_slot_rows
    rank rows per slice, then ``gemm_tiles``. The H200 groups tokens by slot (``gemm_sorted``): 16 x 64 tiles on 4
    warps to 128 tokens for every shape, and TP=4's gate_up and down with 4 slots of rank 64 (256 rows) 32 x 64 from
    65 to 128 (measured). The H100, on tokens as batched (its own sweep): 16 x 32 with one
    warp to 32 tokens (gate_up: 16), then 32 x 64 (o: 2 warps; gate_up 32 x 64 to 32 and 64 x 64 to 64). One slot,
    TP=8's shapes and 8 slots of rank 32 keep the table's rows."""
    small, big = ExpandTiles(16, 32, 1), ExpandTiles(32, 64, 4)
    mid = ExpandTiles(16, 64, 4)
    h200_rows = {(4096, 1536): ((128, mid),), (1024, 4096): ((128, mid),),
                 (4096, 7168): ((64, mid), (128, big)), (3584, 4096): ((64, mid), (128, big))}
    h100_rows = {(4096, 1536): ((32, small), (128, big)), (1024, 4096): ((32, small), (128, ExpandTiles(32, 64, 2))),
                 (3584, 4096): ((32, small), (128, big)),
                 (4096, 7168): ((16, small), (32, big), (64, ExpandTiles(64, 64, 4)), (128, big))}
    for name, own_rows in (("NVIDIA H200", h200_rows), ("NVIDIA H100 80GB HBM3", h100_rows)):
        t, _ = serving_tuning("cuda", name)
        assert t.gemm_sorted == (name == "NVIDIA H200")
        table = t.gemm_rows()
        for (d_in, d_out), rows in own_rows.items():  # TP=4's qkv, o, gate_up, down
            four = t.gemm_rows(d_in, d_out, 4, 64)
            low = 1
            for max_t, tiles in rows:  # each row serves its whole token range, from the row before's end
                assert four.tiles_for(low) == four.tiles_for(max_t) == tiles, (name, d_in, d_out, max_t)
                assert tiles in four.tiles_between(low, max_t)
                low = max_t + 1
            assert four.tiles_for(1000) == table.tiles_for(1000) and four.tiles_for(10 ** 7) == table.tiles_for(10 ** 7)
            assert t.gemm_rows(d_in, d_out, 8, 64).tiles_for(64) == four.tiles_for(64)
            one = t.gemm_rows(d_in, d_out, 1, 64)
            assert one.tiles_for(64) == table.tiles_for(64) == ExpandTiles(16, 64, 4)
            # the shadowed table row (16 x 64 up to 128 tokens) is never compiled for this layer's 17-128 tokens,
            # unless one of its own rows has that tile
            if ExpandTiles(16, 64, 4) not in [tiles for _, tiles in rows]:
                assert ExpandTiles(16, 64, 4) not in four.tiles_between(rows[0][0] + 1, 128)
        assert t.gemm_rows(4096, 768, 8, 32).tiles_for(64) == ExpandTiles(16, 64, 4)  # TP=8's qkv: 256 rows, kept
        assert t.gemm_rows(512, 4096, 4, 32) is t.gemm_rows()  # no row of its own: the table's rows themselves
    o, _ = serving_tuning("cpu", override={"fold": True, "fold_gemm_max": 64, "gemm_tiles": [[64, 16, 32, 1]],
                                           "gemm_shapes": [[0, 0, 32, 64, 32, 16, 1]]})
    assert o.gemm_rows(7, 9, 2, 16).tiles_for(5) == ExpandTiles(32, 16, 1)  # 0, 0: any shape, 32 rows
    assert o.gemm_rows(7, 9, 1, 16).tiles_for(5) == ExpandTiles(16, 32, 1)  # 16 rows: the table's


def test_tuning_files_are_named_rows_that_read_back_as_written(tmp_path):
    """Every tuning file names its rows' fields (no positional rows), says why for what it sets, and reads back to the
    same ServingTuning after a round trip through the named form; a row with a field of another row kind, or
    lacking one, is refused with the fields it takes; null is unlimited."""
    import json

    from bdlora.vllm_plugin.fast_path.tuning import ROW_FIELDS, config_file

    files = sorted(CONFIG_DIR.glob("*.json"))
    assert {f.name for f in files} >= {"NVIDIA_H200.json", "NVIDIA_H100_80GB_HBM3.json", "default_cuda.json",
                                       "cpu.json"}
    for f in files:
        raw = json.loads(f.read_text())
        assert isinstance(raw.pop("why"), dict) and raw, f
        for key, rows in raw.items():
            if key in ROW_FIELDS:
                assert all(isinstance(r, dict) and set(r) <= set(ROW_FIELDS[key]) for r in rows), (f, key)
        ServingTuning.from_dict(raw)
    assert config_file("cuda", "NVIDIA H200").name == "NVIDIA_H200.json"
    assert config_file("cuda", "Some Future GPU").name == "default_cuda.json" and config_file("cpu").name == "cpu.json"
    t = ServingTuning.from_dict({"gemv_shapes": [{"d_in": 0, "d_out": 0, "block_n": 16, "block_k": 16, "split_k": 2,
                                                  "warps": 1, "stages": 1, "local_shrink": True}],
                                 "fold_gemm_max": None, "gemm_tiles": [{"max_tokens": None, "block_m": 16,
                                                                         "block_n": 64, "warps": 4}]})
    assert t.gemv_shapes == ((0, 0, 16, 16, 2, 1, 1, True),) and t.fold_gemm_max == UNLIMITED
    assert t == ServingTuning.from_dict({"gemv_shapes": [[0, 0, 16, 16, 2, 1, 1, 1]], "fold_gemm_max": UNLIMITED,
                                         "gemm_tiles": [[UNLIMITED, 16, 64, 4]]})
    with pytest.raises(ValueError, match="gemm_tiles rows have the fields"):
        ServingTuning.from_dict({"gemm_tiles": [{"max_tokens": 8, "block_m": 16, "block_n": 64, "warps": 4,
                                                 "d_in": 1}]})
    with pytest.raises(ValueError, match="lacks \\['warps'\\]"):
        ServingTuning.from_dict({"gemm_tiles": [{"max_tokens": 8, "block_m": 16, "block_n": 64}]})
