"""The serving kernels compiled for Hopper (sm90) on any machine, no GPU needed: the global loads of their PTX and
the registers and stack ptxas gives a thread. Whether a tile's loads are vectors and whether its registers spill is
known before a device call (BENCHMARKS.md, "Several slots in one tile": a B tile masked by a loaded rank compiled to
168 two-byte loads per thread).

    python bench/kernels/sm90_codegen.py [decode.py of another version]
        (the tiled expand, the per-tile-shrink kernel and the two-launch kernels at the table's tiles)

``compile_sm90`` compiles one kernel of a fresh copy of ``bdlora.kernels.decode`` through ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``, with ptxas from Triton's wheel, in a Python process of its own: once Triton's
interpreter has run a kernel (the CPU tests do), it leaves ``triton.language`` patched, and code built in that
process afterwards fails. ``codegen_why_not`` says why it cannot run here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from types import ModuleType

#: Integer arguments compiled as multiples of 16, as Triton specializes them when served (strides, widths, ranks).
DIVISIBLE = ("stride_x", "stride_y", "stride_h", "d_in", "d_out", "d_total", "R", "KA", "RB", "a_rows", "k_chunk",
             "O1", "O2", "O3", "O4")
#: Integer arguments that take any value (token and slot counts, grid sizes): no divisibility assumed. An argument
#: in neither list stops the compile, so a new one cannot silently compile as unaligned (O4 once did).
ANY_VALUE = ("T", "n_loras", "n_groups", "k_splits", "n_a_tiles", "n_w_tiles")
_I32_PTRS = ("idx_ptr", "ranks_ptr", "cnt_ptr", "sync_ptr", "soff_ptr")
_F32_PTRS = ("scales_ptr", "part_ptr")


def _triton_bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def codegen_why_not() -> str | None:
    """None when sm90 code can be built here (Triton with its NVIDIA backend's ptxas and cuobjdump), else why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means no codegen
        return f"triton does not import: {e}"
    missing = [t for t in ("ptxas", "cuobjdump") if not os.access(_triton_bin(t), os.X_OK)]
    return f"Triton's wheel has no {', '.join(missing)}" if missing else None


def compiled_decode(path: str | None = None) -> ModuleType:
    """A copy of ``bdlora.kernels.decode`` whose kernels are compiled Triton functions (JITFunction), even where
    TRITON_INTERPRET=1 made the imported module's kernels interpreted; ``path``: another version of that file (e.g.
    ``git show REV:bdlora/kernels/decode.py`` saved aside), to compare before and after a change."""
    import bdlora.kernels.decode as decode
    from triton import knobs

    path = os.path.abspath(path or decode.__file__)
    name = "bdlora.kernels._decode_sm90" + ("" if path == os.path.abspath(decode.__file__) else
                                            f"_{abs(hash(path)):x}")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # Triton resolves the kernels' globals through sys.modules
    with knobs.runtime.scope():
        knobs.runtime.interpret = False
        spec.loader.exec_module(mod)
    return mod


def compile_sm90(kernel: str, constexprs: dict, num_warps: int, num_stages: int = 3,
                 path: str | None = None) -> dict:
    """Compile the kernel named ``kernel`` of ``compiled_decode(path)`` for sm90 with bf16 tensors, int32 slot ids
    and ranks, fp32 scales and partials, in a fresh Python process (see the module docstring); returns {"loads":
    {PTX global load instruction: count}, "stores": {the same for stores}, "async_copies": cp.async instructions
    (a pipelined loop's loads), "registers": n, "stack": bytes per thread, "shared": shared memory bytes per
    program}. Constexprs the kernel does
    not take are left out."""
    job = json.dumps({"kernel": kernel, "constexprs": constexprs, "num_warps": num_warps, "num_stages": num_stages,
                      "path": path})
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile", job], capture_output=True,
                          text=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    if done.returncode != 0:
        raise RuntimeError(f"sm90_codegen: compiling {kernel} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compile_here(kernel: str, constexprs: dict, num_warps: int, num_stages: int = 3,
                  path: str | None = None) -> dict:
    """``compile_sm90`` in this process (no interpreted kernel may have run in it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(compiled_decode(path), kernel)
    names = list(kernel.arg_names)
    constexprs = {k: v for k, v in constexprs.items() if k in names}  # an older version may lack some
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*i32" if n in _I32_PTRS else "*fp32" if n in _F32_PTRS else "*bf16"
        elif n in DIVISIBLE or n in ANY_VALUE:
            sig[n] = "i32"
        else:
            raise ValueError(f"sm90_codegen: {kernel.fn.__name__}'s argument {n} is in neither DIVISIBLE nor ANY_VALUE")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n in DIVISIBLE}
    compiled = triton.compile(ASTSource(kernel, sig, dict(constexprs), attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    loads = Counter(re.findall(r"ld\.global[.\w]*", compiled.asm["ptx"]))
    stores = Counter(re.findall(r"st\.global[.\w]*", compiled.asm["ptx"]))
    async_copies = len(re.findall(r"cp\.async\.c[ag]", compiled.asm["ptx"]))  # a pipelined loop's loads
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_triton_bin("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return {"loads": dict(loads), "stores": dict(stores), "async_copies": async_copies, "registers": int(regs),
            "stack": int(stack), "shared": int(compiled.metadata.shared)}


def expand_config(n_loras: int, rank: int, block_m: int, block_n: int, warps: int) -> tuple[dict, int]:
    """The tiled expand kernel's constexprs and warps as ``FoldedLaunch`` launches it (bf16, PDL)."""
    from bdlora.kernels.decode import _expand_warps, all_slots_block
    from bdlora.kernels.dispatch import next_pow2

    w = _expand_warps(n_loras, rank, block_n, warps)
    return ({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_R": max(16, next_pow2(rank)), "ONE_SLOT": n_loras == 1,
             "PREC": "tf32", "USE_GDC": True, "BLOCK_J": all_slots_block(n_loras, rank, block_n, w)}, w)


def local_config(n_loras: int, rank: int, block_n: int, block_k: int, split_k: int, tokens: int,
                 stages: int = 3) -> dict:
    """The per-tile-shrink kernel's constexprs as ``decode_lora_folded`` launches it for ``tokens`` tokens (bf16,
    PDL; one token: ``GemvTiles(..., True, True)``, its slot's rows only); compile it with ``stages`` as
    num_stages too."""
    from bdlora.kernels.decode import GemvTiles

    tiles = GemvTiles(block_n, block_k, split_k, 4, stages, True, tokens == 1)
    return {"SPLIT_K": split_k, "BLOCK_M": tiles.block_m(tokens), "BLOCK_N": block_n, "BLOCK_K": block_k,
            "BLOCK_J": tiles.shrink_rows(tokens, n_loras, rank), "BLOCK_R": tiles.shrink_stride(tokens, n_loras, rank),
            "PREC": "tf32", "USE_GDC": True, "STAGES": stages}


def shared_gemv_config(n_loras: int, rank: int, block_n: int, block_k: int, split_k: int, warps: int) -> dict:
    """The shared-shrink one-launch kernel's constexprs as ``decode_lora_folded`` launches it for 16 tokens of one
    slice (bf16, PDL)."""
    from bdlora.kernels.decode import all_slots_block
    from bdlora.kernels.dispatch import next_pow2

    return {"N_SLICES": 1, "SPLIT_K": split_k, "BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": block_k,
            "BLOCK_R": max(16, next_pow2(rank)), "ONE_SLOT": n_loras == 1, "PREC": "tf32", "USE_GDC": True,
            "BLOCK_J": all_slots_block(n_loras, rank, block_n, warps)}


#: The one-token tiles of the H200 and H100 tables (``gemv_one_token_shapes``): (module, its rank per GPU) ->
#: (block_n, block_k, split_k, warps).
ONE_TOKEN_TILES = {("TP=8 qkv; gate_up, H200", 32): (64, 64, 8, 4), ("TP=8 o", 32): (32, 128, 1, 4),
                   ("TP=8 gate_up, H100", 32): (128, 128, 4, 8), ("TP=8 down", 32): (16, 256, 1, 8),
                   ("TP=4 qkv", 64): (64, 64, 16, 4), ("TP=4 o", 64): (128, 128, 4, 8),
                   ("TP=4 down", 64): (128, 64, 8, 8)}


def main() -> None:
    if sys.argv[1:2] == ["--compile"]:  # compile_sm90's child process: one kernel, its stats as the last line
        print(json.dumps(_compile_here(**json.loads(sys.argv[2]))))
        return
    why = codegen_why_not()
    if why:
        raise SystemExit(f"sm90_codegen: {why}")
    path = sys.argv[1] if len(sys.argv) > 1 else None
    runs = []  # (label, kernel, constexprs, warps, stages)
    for n_l, rank in ((1, 64), (4, 64), (4, 32), (8, 64)):
        for bm, bn, warps in ((16, 64, 4), (32, 64, 4), (64, 64, 4), (32, 128, 4)):
            cx, w = expand_config(n_l, rank, bm, bn, warps)
            runs.append((f"expand {n_l} slots rank {rank} tile {bm}x{bn} warps {w} BLOCK_J {cx['BLOCK_J']}",
                         "_fold_expand_gemm_kernel", cx, w, 3))
    for n_l, rank in ((1, 64), (4, 64), (4, 32)):  # TP=4 down's and TP=8 gate_up's one-launch tiles
        runs.append((f"shared shrink, 16 tokens, {n_l} slots rank {rank}, tiles 16x256 split 1 warps 2",
                     "_fold_gemv_kernel", shared_gemv_config(n_l, rank, 16, 256, 1, 2), 2, 4))
    for n_l in (1, 4):  # the per-token folded expand (fold_decode_max: unknown GPUs)
        runs.append((f"per-token folded expand, {n_l} slots rank 64", "_decode_folded_expand_kernel",
                     {"BLOCK_L": n_l, "BLOCK_R": 64, "BLOCK_N": 64, "ONE_SLOT": n_l == 1, "USE_GDC": True}, 4, 3))
    for nb, block_r in ((1, 64), (4, 16)):  # the two-launch kernels, a plain (NB 1) and a 4-block B
        runs.append((f"two-launch shrink, NB {nb}, BLOCK_R {block_r}", "_decode_shrink_kernel",
                     {"NA": 1, "NB": nb, "BLOCK_R": block_r, "BLOCK_K": 128, "USE_GDC": True}, 4, 3))
        runs.append((f"two-launch expand, NB {nb}, BLOCK_R {block_r}", "_decode_expand_kernel",
                     {"NB": nb, "K_SPLITS": 32, "BLOCK_R": block_r, "BLOCK_N": 64, "BLOCK_S": 16, "USE_GDC": True},
                     4, 3))
    for (module, rank), (bn, bk, sk, warps) in ONE_TOKEN_TILES.items():  # the K loop, not pipelined and pipelined
        for stages in (1, 3):
            runs.append((f"one token, {module} (rank {rank}), tiles {bn}x{bk} split {sk} warps {warps} stages "
                         f"{stages}", "_fold_gemv_local_kernel", local_config(1, rank, bn, bk, sk, 1, stages), warps,
                         stages))
    for n_l, rank, bn, bk, sk, warps, stages, tokens in ((4, 32, 32, 64, 1, 4, 4, 16), (4, 32, 32, 128, 1, 4, 4, 16),
                                                         (2, 32, 32, 128, 1, 4, 4, 4)):  # TP=8's o and down rows
        runs.append((f"per-tile shrink, {tokens} tokens, {n_l} slots rank {rank} tiles {bn}x{bk} split {sk} warps "
                     f"{warps} stages {stages}", "_fold_gemv_local_kernel",
                     local_config(n_l, rank, bn, bk, sk, tokens, stages), warps, stages))
    for label, kernel, cx, warps, stages in runs:
        print(f"{label}:", compile_sm90(kernel, cx, warps, stages, path))

if __name__ == "__main__":
    main()
