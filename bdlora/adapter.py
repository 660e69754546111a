"""Read and write BD-LoRA adapters as ordinary PEFT LoRA folders (SPEC §2).

A folder holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``use_rslora``,
``target_modules`` and ``use_bdlora: {target_modules_bd_a, target_modules_bd_b, nblocks}``) and
``adapter_model.safetensors`` with PEFT key names. Block-diagonal factors are stored packed, never with zeros.
Dense PEFT LoRA folders load through the same code (``nblocks`` is then ``None``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .sharding import packed_shapes, shape_of
from .spec import COLUMN, ROW, BDLoraError, BDLoraSpec, Layout, peft_scaling

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_A_SUFFIX = ".lora_A.weight"
_B_SUFFIX = ".lora_B.weight"


@dataclass
class AdapterConfig:
    """The fields of a PEFT ``adapter_config.json`` that decide how the weights are read and scaled."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str]
    nblocks: Optional[int] = None  # None: a dense (standard) LoRA adapter
    column_modules: list[str] = field(default_factory=list)  # PEFT target_modules_bd_b
    row_modules: list[str] = field(default_factory=list)  # PEFT target_modules_bd_a
    raw: dict = field(default_factory=dict)

    @property
    def is_bd(self) -> bool:
        return self.nblocks is not None

    @property
    def scale(self) -> float:
        return peft_scaling(self.lora_alpha, self.r, self.use_rslora)

    def layout_of(self, module_path: str) -> Optional[Layout]:
        """Layout of a module path (exact match of its last component); None for a dense adapter."""
        if not self.is_bd:
            return None
        leaf = module_path.rsplit(".", 1)[-1]
        if leaf in self.column_modules:
            return COLUMN
        if leaf in self.row_modules:
            return ROW
        raise BDLoraError(
            f"adapter module {module_path!r} is in neither use_bdlora.target_modules_bd_b (column-parallel: "
            f"{self.column_modules}) nor target_modules_bd_a (row-parallel: {self.row_modules}); bdlora matches "
            "module names exactly, so list its last name component in one of them"
        )

    @classmethod
    def from_dict(cls, raw: dict, source: str = "adapter config") -> "AdapterConfig":
        if raw.get("peft_type", "LORA") != "LORA":
            raise BDLoraError(f"{source}: peft_type is {raw.get('peft_type')!r}, expected 'LORA'")
        for key in ("r", "lora_alpha"):
            if key not in raw:
                raise BDLoraError(f"{source}: missing {key!r}")
        target = raw.get("target_modules") or []
        target = [target] if isinstance(target, str) else list(target)
        bd = raw.get("use_bdlora")
        cfg = cls(r=int(raw["r"]), lora_alpha=float(raw["lora_alpha"]), use_rslora=bool(raw.get("use_rslora")),
                  target_modules=target, raw=raw)
        if bd:
            nblocks = int(bd.get("nblocks", 1))
            cfg.nblocks = nblocks
            cfg.column_modules = list(bd.get("target_modules_bd_b") or [])
            cfg.row_modules = list(bd.get("target_modules_bd_a") or [])
            if cfg.r % nblocks:
                raise BDLoraError(f"{source}: r={cfg.r} is not divisible by use_bdlora.nblocks={nblocks}; "
                                  "every block needs rank r/nblocks")
            overlap = set(cfg.column_modules) & set(cfg.row_modules)
            if overlap:
                raise BDLoraError(f"{source}: {sorted(overlap)} listed as both block-diagonal A and B")
        return cfg

    @classmethod
    def from_spec(cls, spec: BDLoraSpec, base_model_name_or_path: Optional[str] = None) -> "AdapterConfig":
        raw = spec.to_peft_config(base_model_name_or_path=base_model_name_or_path).to_dict()
        return cls.from_dict(_jsonable(raw))


def _jsonable(d: dict) -> dict:
    """PEFT's to_dict leaves sets and dataclasses in; make a plain JSON dict the way PEFT saves it."""
    return json.loads(json.dumps(d, default=lambda o: sorted(o) if isinstance(o, set) else vars(o)))


def read_config(path: str | os.PathLike) -> AdapterConfig:
    path = Path(path)
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise BDLoraError(f"{path}: no {CONFIG_NAME}; expected a PEFT LoRA adapter folder")
    with open(cfg_file) as f:
        return AdapterConfig.from_dict(json.load(f), source=str(cfg_file))


@dataclass
class LoraFactors:
    """One module's LoRA factors in PEFT orientation (packed when block-diagonal)."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    layout: Optional[Layout] = None


@dataclass
class Adapter:
    """An adapter in memory: its config and ``{module path: LoraFactors}``.

    Module paths are PEFT's key prefixes, e.g. ``base_model.model.model.layers.0.self_attn.q_proj``.
    """

    config: AdapterConfig
    modules: dict[str, LoraFactors]

    def num_parameters(self) -> int:
        return sum(f.lora_A.numel() + f.lora_B.numel() for f in self.modules.values())

    def dense_num_parameters(self) -> int:
        """Parameters of a standard LoRA of the same rank on the same modules."""
        total = 0
        for f in self.modules.values():
            r, d_out = f.lora_A.shape[0], f.lora_B.shape[0]
            d_in = f.lora_A.shape[1] * (self.config.nblocks if f.layout == ROW else 1)
            total += r * (d_in + d_out)
        return total


def module_paths(keys) -> list[str]:
    """Module paths that carry a LoRA pair, in file order; raises on a half pair."""
    a = {k[: -len(_A_SUFFIX)] for k in keys if k.endswith(_A_SUFFIX)}
    b = {k[: -len(_B_SUFFIX)] for k in keys if k.endswith(_B_SUFFIX)}
    if a != b:
        raise BDLoraError(f"adapter has lora_A without lora_B (or the reverse) for {sorted(a ^ b)[:4]}")
    if not a:
        raise BDLoraError("adapter_model.safetensors holds no '*.lora_A.weight' / '*.lora_B.weight' tensors")
    return sorted(a)


def check_factor_shapes(cfg: AdapterConfig, path: str, a_shape: tuple, b_shape: tuple) -> Optional[Layout]:
    """Validates one module's stored shapes against the config; returns its layout."""
    layout = cfg.layout_of(path)
    if a_shape[0] != cfg.r or b_shape[1] * (cfg.nblocks if layout == COLUMN else 1) != cfg.r:
        if layout == COLUMN and b_shape[1] == cfg.r and cfg.nblocks > 1:
            raise BDLoraError(
                f"{path}: lora_B has shape {b_shape}, a dense (d_out, r) factor, but use_bdlora says it is "
                f"block-diagonal and packed (d_out, r/nblocks)=({b_shape[0]}, {cfg.r // cfg.nblocks}): this is a "
                "dense adapter with a BD config; convert it with `bdlora convert to-bd`"
            )
        raise BDLoraError(f"{path}: factor shapes A{a_shape} B{b_shape} do not fit r={cfg.r}"
                          + (f", nblocks={cfg.nblocks} ({layout} layout)" if layout else ""))
    if layout is not None:
        n = cfg.nblocks
        d_out = b_shape[0]
        d_in = a_shape[1] * (n if layout == ROW else 1)
        if d_out % n:
            raise BDLoraError(f"{path}: d_out={d_out} is not divisible by nblocks={n}")
        expect = packed_shapes(layout, d_in, d_out, cfg.r, n)
        if (tuple(a_shape), tuple(b_shape)) != expect:
            raise BDLoraError(f"{path}: stored shapes A{a_shape} B{b_shape}, expected packed {expect} "
                              f"for a {layout}-parallel layer with nblocks={n}")
    return layout


def load_adapter(path: str | os.PathLike, device: str = "cpu") -> Adapter:
    """Loads and validates a PEFT LoRA folder (BD or dense)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_config(path)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise BDLoraError(f"{path}: no {WEIGHTS_NAME}")
    tensors = load_file(str(weights), device=device)
    modules = {}
    for p in module_paths(tensors):
        a, b = tensors[p + _A_SUFFIX], tensors[p + _B_SUFFIX]
        layout = check_factor_shapes(cfg, p, tuple(a.shape), tuple(b.shape))
        modules[p] = LoraFactors(a, b, layout)
    return Adapter(cfg, modules)


def _atomic_dir(dest: Path):
    """Temporary sibling directory renamed onto ``dest`` on success; never leaves a half-written folder."""

    class _Ctx:
        def __enter__(self):
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
            return self.tmp

        def __exit__(self, exc_type, exc, tb):
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return False
            old = None
            if dest.exists():
                old = dest.parent / f".{dest.name}.old-{os.getpid()}"
                os.replace(dest, old)
            os.replace(self.tmp, dest)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            return False

    return _Ctx()


def atomic_output_dir(dest: str | os.PathLike):
    """Context manager yielding a temp dir that atomically becomes ``dest`` when the block succeeds."""
    return _atomic_dir(Path(dest))


def config_dict(cfg: AdapterConfig) -> dict:
    """The JSON dict to save: the original PEFT dict with the decisive fields rewritten."""
    raw = dict(cfg.raw) if cfg.raw else {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none",
                                         "lora_dropout": 0.0, "fan_in_fan_out": False}
    raw.update(r=cfg.r, lora_alpha=cfg.lora_alpha, use_rslora=cfg.use_rslora,
               target_modules=sorted(cfg.target_modules), peft_type="LORA")
    if cfg.is_bd:
        raw["use_bdlora"] = {
            "target_modules_bd_a": list(cfg.row_modules),
            "target_modules_bd_b": list(cfg.column_modules),
            "nblocks": cfg.nblocks,
            "match_strict": True,
        }
    else:
        raw["use_bdlora"] = None
    return raw


def save_adapter(adapter: Adapter, path: str | os.PathLike) -> Path:
    """Writes a PEFT folder atomically. Validates shapes first so a bad adapter is never written."""
    from safetensors.torch import save_file

    cfg = adapter.config
    tensors = {}
    for p, f in adapter.modules.items():
        check_factor_shapes(cfg, p, tuple(f.lora_A.shape), tuple(f.lora_B.shape))
        tensors[p + _A_SUFFIX] = f.lora_A.detach().contiguous().cpu()
        tensors[p + _B_SUFFIX] = f.lora_B.detach().contiguous().cpu()
    path = Path(path)
    with atomic_output_dir(path) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        with open(tmp / CONFIG_NAME, "w") as fh:
            json.dump(config_dict(cfg), fh, indent=2, sort_keys=True)
    return path


__all__ = [
    "Adapter", "AdapterConfig", "LoraFactors", "CONFIG_NAME", "WEIGHTS_NAME", "atomic_output_dir",
    "check_factor_shapes", "config_dict", "load_adapter", "module_paths", "read_config", "save_adapter",
    "shape_of",
]
