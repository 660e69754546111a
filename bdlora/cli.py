"""``bdlora`` command line: inspect and convert adapters, train, serve.

    bdlora inspect ADAPTER
    bdlora convert to-dense IN OUT
    bdlora convert to-bd IN OUT --nblocks N [--rank R] [--preset llama | --column ... --row ...]
    bdlora convert reblock IN OUT --tp M
    bdlora train --config job.yaml          (same as python -m bdlora.train)
    bdlora serve MODEL [vllm serve args]    (vllm serve with --enable-lora --enable-bdlora)
"""

from __future__ import annotations

import argparse
import sys

from .spec import COLUMN, PRESETS, ROW, BDLoraError


def _divisors_and_multiples(n: int, limit: int = 16) -> list[int]:
    return sorted({m for m in range(1, limit + 1) if n % m == 0 or m % n == 0})


def inspect_text(path: str) -> str:
    from .adapter import load_adapter

    ad = load_adapter(path)
    cfg = ad.config
    layouts = {COLUMN: 0, ROW: 0, None: 0}
    for f in ad.modules.values():
        layouts[f.layout] += 1
    lines = [f"adapter:        {path}"]
    if cfg.is_bd:
        n = cfg.nblocks
        lines += [
            "type:           BD-LoRA (block-diagonal, PEFT use_bdlora)",
            f"nblocks:        {n}  (serve at tensor-parallel size {_divisors_and_multiples(n)} without LoRA "
            "communication)",
            f"rank r:         {cfg.r}  (rank per block r/N = {cfg.r // n})",
            f"column-parallel (B block-diagonal): {cfg.column_modules}  [{layouts[COLUMN]} modules]",
            f"row-parallel    (A block-diagonal): {cfg.row_modules}  [{layouts[ROW]} modules]",
        ]
    else:
        lines += ["type:           dense LoRA (no use_bdlora)", f"rank r:         {cfg.r}",
                  f"modules:        {layouts[None]}"]
    alpha_note = ""
    if cfg.is_bd and cfg.use_rslora:
        alpha_note = f"  (= block alpha {cfg.lora_alpha / cfg.nblocks ** 0.5:g} x sqrt(N))"
    stored = ad.num_parameters()
    dense = ad.dense_num_parameters()
    lines += [
        f"lora_alpha:     {cfg.lora_alpha:g}{alpha_note}",
        f"use_rslora:     {cfg.use_rslora}",
        f"scale:          {cfg.scale:.6g}  ({'lora_alpha/sqrt(r)' if cfg.use_rslora else 'lora_alpha/r'})",
        f"parameters:     {stored:,} stored (all non-zero)"
        + (f"; a dense LoRA of rank {cfg.r} on the same modules has {dense:,} ({stored / dense:.3f}x)"
           if cfg.is_bd else ""),
    ]
    return "\n".join(lines)


def _convert(args) -> None:
    from .adapter import load_adapter, save_adapter
    from .convert import bd_to_dense, dense_to_bd, reblock

    ad = load_adapter(args.input)
    if args.kind == "to-dense":
        out = bd_to_dense(ad)
    elif args.kind == "reblock":
        out = reblock(ad, args.tp)
    else:
        if args.column or args.row:
            cols, rows = args.column or [], args.row or []
        else:
            cols, rows = PRESETS[args.preset][COLUMN], PRESETS[args.preset][ROW]
        out, report = dense_to_bd(ad, args.nblocks, args.rank, column_modules=cols, row_modules=rows)
        worst = max(report.per_module.items(), key=lambda kv: kv[1])
        print(f"relative error of the weight delta: {report.total:.3e} overall; worst module {worst[0]} "
              f"{worst[1]:.3e}")
    save_adapter(out, args.output)
    print(f"wrote {args.output}")
    print(inspect_text(args.output))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bdlora", description="Train, convert and serve Block-Diagonal LoRA adapters.")
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="print rank, blocks, parameter count and scale of an adapter folder")
    ins.add_argument("adapter")
    conv = sub.add_parser("convert", help="convert between dense LoRA and BD-LoRA, or re-block for another TP size")
    csub = conv.add_subparsers(dest="kind", required=True)
    td = csub.add_parser("to-dense", help="BD-LoRA -> standard LoRA of the same rank (zeros expanded)")
    tb = csub.add_parser("to-bd", help="standard LoRA -> BD-LoRA (exact at rank N*r, or truncated by SVD)")
    tb.add_argument("--nblocks", type=int, required=True, help="number of blocks = serving tensor-parallel size")
    tb.add_argument("--rank", type=int, default=None, help="target total rank (default: exact, nblocks*r)")
    tb.add_argument("--preset", default="llama", choices=sorted(PRESETS), help="column/row module names by model")
    tb.add_argument("--column", nargs="+", help="column-parallel module names (override the preset)")
    tb.add_argument("--row", nargs="+", help="row-parallel module names (override the preset)")
    rb = csub.add_parser("reblock", help="re-block an N-block adapter for serving at TP size M (M|N or N|M)")
    rb.add_argument("--tp", type=int, required=True, help="target tensor-parallel size M")
    for c in (td, tb, rb):
        c.add_argument("input")
        c.add_argument("output")
    sub.add_parser("train", help="fine-tune a BD-LoRA adapter (bdlora train --config job.yaml)", add_help=False)
    sub.add_parser("serve", help="vllm serve with the BD-LoRA plugin enabled", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # train/serve forward their arguments untouched to their own parsers.
    if argv and argv[0] == "train":
        from bdlora.train.trainer import main as train_main

        return train_main(argv[1:]) or 0
    if argv and argv[0] == "serve":
        from bdlora.vllm_plugin.serve import main as serve_main

        return serve_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            print(inspect_text(args.adapter))
        elif args.command == "convert":
            _convert(args)
    except BDLoraError as e:
        print(f"bdlora: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
