"""The serving kernels' Hopper (sm90) code, built on the CPU machine (``bench/kernels/sm90_codegen.py``: Triton's
compiler and the ptxas of its wheel, no GPU): the B tiles of the tiled expand and of the one-token kernel load as
16-byte vectors, and no tile the launchers pick spills registers. Both went wrong once where the interpreter's
float64 checks (test_kernels_serving.py) cannot see it: a B tile masked by each slot's loaded rank compiled to 168
two-byte loads per thread, and 4 slots' 256 rank rows by 64 columns at 4 warps took 255 registers and 48 bytes of
stack (BENCHMARKS.md, "Several slots in one tile"). No timing here.
"""
import pytest

from bench.kernels import sm90_codegen as cg

pytestmark = pytest.mark.skipif(cg.codegen_why_not() is not None, reason=str(cg.codegen_why_not()))


def _b16(stats: dict) -> int:
    return stats["loads"].get("ld.global.b16", 0)


def _scalar_bf16(stats: dict) -> int:
    """Two-byte loads and stores: bf16 elements moved one at a time."""
    return _b16(stats) + stats["stores"].get("st.global.b16", 0)


@pytest.mark.parametrize("n_loras,rank,block_m", [(4, 64, 16), (4, 64, 64), (4, 32, 32), (2, 64, 16)])
def test_all_slots_expand_tile_moves_vectors_and_does_not_spill(n_loras, rank, block_m):
    """Several slots in one tl.dot, at the table's 64-column tiles: the launcher's warps hold the B tile (no
    stack), and every bf16 tile (B, the GEMM's output, the shrink, y) moves in vectors: no two-byte load or store
    (the first version's B tile alone took 168 two-byte loads per thread)."""
    cx, warps = cg.expand_config(n_loras, rank, block_m, 64, 4)
    assert cx["BLOCK_J"] > 0
    stats = cg.compile_sm90("_fold_expand_gemm_kernel", cx, warps)
    assert stats["stack"] == 0, stats
    assert stats["loads"].get("ld.global.v4.b32", 0) > 0 and _scalar_bf16(stats) == 0, stats


@pytest.mark.parametrize("n_loras,block_n", [(1, 64), (1, 128), (8, 64), (8, 128)])
def test_one_slot_tile_and_slot_loop_move_vectors(n_loras, block_n):
    """One slot (its B loaded up front), and 8 slots of rank 64, which do not fit one tile: the per-slot loop. B
    rows are masked by R, not by the loaded rank, and so is each slot's shrink (then cut to the rank), so both come
    in vectors: a mask by the loaded rank made the shrink 8-16 two-byte loads per thread, and B 32 per slot."""
    cx, warps = cg.expand_config(n_loras, 64, 16, block_n, 4)
    assert cx["BLOCK_J"] == 0 and warps == 4
    stats = cg.compile_sm90("_fold_expand_gemm_kernel", cx, warps)
    assert stats["stack"] == 0 and _scalar_bf16(stats) == 0, stats


@pytest.mark.parametrize("tiles,max_stack", [((32, 64, 1, 4, 4), 0), ((32, 128, 1, 4, 4), 56)])
def test_per_tile_shrink_kernel_loads_b_as_vectors(tiles, max_stack):
    """The per-tile-shrink kernel at the Hopper tables' rows (TP=8's o and down: block_n, block_k, split_k, warps,
    stages) at 16 tokens on 4 slots of rank 32. B rows are masked per slot and by R only (S is 0 past the rank and
    for unused slots), BLOCK_R apart, so no B element comes in a two-byte load (before: 32 per thread). TP=8 down's
    tile still spills with 4 slots at its 4 stages: 56 bytes (at 8 warps it would not; the row was measured with one
    slot, and with 4 it loses 0.5 us to the tiled path, BENCHMARKS.md)."""
    from bdlora.kernels.tuning import TABLE

    assert tiles + (True,) in [tuple(r[2:]) for e in TABLE.values() for r in e["gemv_shapes"]]
    bn, bk, split_k, warps, stages = tiles
    stats = cg.compile_sm90("_fold_gemv_local_kernel", cg.local_config(4, 32, bn, bk, split_k, 16, stages), warps,
                            stages)
    assert stats["stack"] <= max_stack and _b16(stats) <= 2, stats


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("module", list(cg.ONE_TOKEN_TILES))
def test_one_token_kernel_vectors_and_its_k_loop_pipelined_when_stages_say_so(module, stages):
    """The one-token kernel at every one-token tile of the H100 and H200 tables (batch 1): no B element in a
    two-byte load (before: 32 per thread on TP=4's qkv and o), no stack, and its K loop, which has no tl.dot,
    pipelined (cp.async, loads issued ahead) exactly when ``stages`` > 1: Triton does so only when the loop says
    num_stages itself. Stages 1 is the code the tables were measured with."""
    rank, (bn, bk, split_k, warps) = module[1], cg.ONE_TOKEN_TILES[module]
    stats = cg.compile_sm90("_fold_gemv_local_kernel", cg.local_config(1, rank, bn, bk, split_k, 1, stages), warps,
                            stages)
    assert stats["stack"] == 0 and _b16(stats) <= 2, stats
    assert (stats["async_copies"] > 0) == (stages > 1), stats


def test_codegen_tool_covers_the_tables_one_token_tiles():
    """Every one-token row of the GPU tables is one of ``ONE_TOKEN_TILES`` at a stages compiled above (1, or 3:
    the H100's pipelined rows), and every entry of ``ONE_TOKEN_TILES`` is some table's row."""
    from bdlora.kernels.tuning import TABLE

    rows = [(name, row) for name, entry in TABLE.items() for row in entry["gemv_one_token_shapes"]]
    for name, row in rows:
        assert tuple(row[2:6]) in cg.ONE_TOKEN_TILES.values() and row[6] in (1, 3), (name, row)
    assert set(cg.ONE_TOKEN_TILES.values()) == {tuple(row[2:6]) for _, row in rows}


@pytest.mark.parametrize("nb,block_r", [(1, 64), (4, 16)])
def test_two_launch_expand_loads_b_as_vectors(nb, block_r):
    """The two-launch kernel's expand (a wide layer's 2-8 token forwards, unfoldable layers): B masked by the buffer
    rank, not by the slot's loaded rank (its shrink is 0 past it), comes in vectors (before: 40 two-byte loads per
    thread with a plain B, 12 with a 4-block one)."""
    stats = cg.compile_sm90("_decode_expand_kernel", {"NB": nb, "K_SPLITS": 32, "BLOCK_R": block_r,
                                                            "BLOCK_N": 64, "BLOCK_S": 16, "USE_GDC": True}, 4)
    b_per_thread = 64 * block_r // (4 * 32)
    assert stats["stack"] == 0 and _b16(stats) <= b_per_thread // 2, stats


@pytest.mark.parametrize("n_loras,rank", [(4, 64), (4, 32)])
def test_shared_shrink_kernel_loads_b_as_vectors(n_loras, rank):
    """The shared-shrink one-launch kernel at TP=4 down's and TP=8 gate_up's tiles (16 x 256, 2 warps), 16 tokens
    on 4 slots: every used slot's B in one tile, masked per slot and by R (before: 16 + 16 two-byte loads of B and
    the shrink per thread with rank 64)."""
    stats = cg.compile_sm90("_fold_gemv_kernel", cg.shared_gemv_config(n_loras, rank, 16, 256, 1, 2), 2, 4)
    assert stats["stack"] == 0 and _b16(stats) == 0 and stats["loads"].get("ld.global.cg.b16", 0) == 0, stats


def test_per_token_folded_expand_loads_b_as_vectors():
    """The per-token folded expand (unknown GPUs' 1-8 token forwards) with 4 slots: B masked by R, not by the
    token's slot's loaded rank (before: 44 two-byte loads per thread; 32 B elements per thread)."""
    stats = cg.compile_sm90("_decode_folded_expand_kernel", {"BLOCK_L": 4, "BLOCK_R": 64, "BLOCK_N": 64,
                                                                   "ONE_SLOT": False, "USE_GDC": True}, 4)
    assert stats["stack"] == 0 and _b16(stats) <= 16, stats
