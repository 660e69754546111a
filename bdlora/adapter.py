"""Read and write BD-LoRA adapters as ordinary PEFT LoRA folders (README.md, "Adapter format").

A folder holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``use_rslora``,
``target_modules`` and ``use_bdlora: {target_modules_bd_a, target_modules_bd_b, nblocks}``) and
``adapter_model.safetensors`` with PEFT key names. Block-diagonal factors are stored packed, never with zeros.
Dense PEFT LoRA folders load through the same code (``nblocks`` is then ``None``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .layout import COLUMN, ROW, Layout, LoraFactors, layout_by_name, packed_shapes
from .moe import (EXPERT_TENSORS, PEFT_TARGET_PARAMETERS, ExpertFactors, check_target_parameters, expert_key_prefixes,
                  from_peft_layout, to_peft_layout, trained_expert_factors)
from .sharding import shape_of
from .spec import BDLoraError, BDLoraSpec, peft_scaling

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
#: PEFT's tensor names of a module's factors (the one place they are spelled; the plugin's loader and checks use them)
PEFT_A_SUFFIX = ".lora_A.weight"
PEFT_B_SUFFIX = ".lora_B.weight"
_A_SUFFIX, _B_SUFFIX = PEFT_A_SUFFIX, PEFT_B_SUFFIX


class AdapterFileError(BDLoraError):
    """An adapter folder that cannot be read as a PEFT LoRA adapter (missing, truncated or malformed files, bad
    values, factors that do not fit together)."""


class UnsupportedAdapterError(BDLoraError):
    """A valid PEFT adapter using a feature bdlora cannot read or convert exactly (the message names it)."""


class OutputPathError(BDLoraError):
    """An output path bdlora refuses to write (it would replace something that is not ours to replace)."""


def _positive_int(value, what: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterFileError(f"{source}: {what} must be a positive integer, got {value!r}")
    return value


def _name_list(value, what: str, source: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise AdapterFileError(f"{source}: {what} must be a list of module names, got {value!r}")
    return list(value)


@dataclass
class AdapterConfig:
    """The fields of a PEFT ``adapter_config.json`` that decide how the weights are read and scaled."""

    r: int
    #: the file's ``lora_alpha`` (PEFT's alpha). For a BD adapter it is the block alpha x sqrt(N), as
    #: ``BDLoraSpec.peft_lora_alpha`` writes it; ``block_alpha`` gives the per-block one back.
    peft_lora_alpha: float
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
        return peft_scaling(self.peft_lora_alpha, self.r, self.use_rslora)

    @property
    def block_alpha(self) -> float:
        """The alpha of one block (``BDLoraSpec.lora_alpha``): the file's alpha / sqrt(N); a dense adapter's own."""
        return self.peft_lora_alpha / math.sqrt(self.nblocks or 1)

    def layout_of(self, module_path: str) -> Optional[Layout]:
        """Layout of a module path (exact match of its last component); None for a dense adapter."""
        if not self.is_bd:
            return None
        layout = layout_by_name(module_path, self.column_modules, self.row_modules)
        if layout is not None:
            return layout
        raise BDLoraError(
            f"adapter module {module_path!r} is in neither use_bdlora.target_modules_bd_b (column-parallel: "
            f"{self.column_modules}) nor target_modules_bd_a (row-parallel: {self.row_modules}); bdlora matches "
            "module names exactly, so list its last name component in one of them"
        )

    @classmethod
    def from_dict(cls, raw: dict, source: str = "adapter config") -> "AdapterConfig":
        """Parses and type-checks a PEFT config dict; raises :class:`AdapterFileError` naming ``source``."""
        if not isinstance(raw, dict):
            raise AdapterFileError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        if raw.get("peft_type", "LORA") != "LORA":
            raise AdapterFileError(f"{source}: peft_type is {raw.get('peft_type')!r}, expected 'LORA'")
        for key in ("r", "lora_alpha"):
            if key not in raw:
                raise AdapterFileError(f"{source}: missing {key!r}")
        r = _positive_int(raw["r"], "'r' (the LoRA rank)", source)
        alpha = raw["lora_alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise AdapterFileError(f"{source}: 'lora_alpha' must be a finite number, got {alpha!r}")
        target = _name_list(raw.get("target_modules"), "'target_modules'", source)
        bd = raw.get("use_bdlora")
        if bd is not None and not isinstance(bd, dict):
            raise AdapterFileError(f"{source}: 'use_bdlora' must be an object "
                                   "{target_modules_bd_a, target_modules_bd_b, nblocks} or null, got {bd!r}")
        cfg = cls(r=r, peft_lora_alpha=float(alpha), use_rslora=bool(raw.get("use_rslora")), target_modules=target, raw=raw)
        if bd:
            nblocks = _positive_int(bd.get("nblocks", 1), "use_bdlora.nblocks (the number of blocks)", source)
            cfg.nblocks = nblocks
            cfg.column_modules = _name_list(bd.get("target_modules_bd_b"), "use_bdlora.target_modules_bd_b", source)
            cfg.row_modules = _name_list(bd.get("target_modules_bd_a"), "use_bdlora.target_modules_bd_a", source)
            if cfg.r % nblocks:
                raise AdapterFileError(f"{source}: r={cfg.r} is not divisible by use_bdlora.nblocks={nblocks}; "
                                       "every block needs rank r/nblocks")
            overlap = set(cfg.column_modules) & set(cfg.row_modules)
            if overlap:
                raise AdapterFileError(f"{source}: {sorted(overlap)} listed as both block-diagonal A and B")
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
    try:
        with open(cfg_file, encoding="utf-8") as f:
            raw = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise AdapterFileError(f"{cfg_file}: not valid JSON ({e}); the file is truncated or corrupt, re-save the "
                               "adapter") from None
    return AdapterConfig.from_dict(raw, source=str(cfg_file))


@dataclass
class Adapter:
    """An adapter in memory: its config and ``{module path: LoraFactors}`` (:class:`bdlora.layout.LoraFactors`: each
    module's layout, block count, scale and packed factors, agreeing with the config).

    Module paths are PEFT's key prefixes, e.g. ``base_model.model.model.layers.0.self_attn.q_proj``.
    """

    config: AdapterConfig
    modules: dict[str, LoraFactors]
    #: LoRA on fused MoE expert tensors (``target_parameters``), {``<experts module path>.<tensor>``: factors}
    experts: dict[str, ExpertFactors] = field(default_factory=dict)

    def num_parameters(self) -> int:
        return (sum(f.lora_A.numel() + f.lora_B.numel() for f in self.modules.values())
                + sum(f.numel() for f in self.experts.values()))

    def dense_num_parameters(self) -> int:
        """Parameters of a standard LoRA of the same rank on the same modules and expert tensors."""
        return (sum(f.rank * (f.d_in + f.d_out) for f in self.modules.values())
                + sum(f.dense_numel() for f in self.experts.values()))


def module_paths(keys) -> list[str]:
    """Module paths that carry a LoRA pair, sorted; raises on a half pair. Other keys are ignored here (see
    :func:`check_tensor_names`)."""
    a = {k[: -len(_A_SUFFIX)] for k in keys if k.endswith(_A_SUFFIX)}
    b = {k[: -len(_B_SUFFIX)] for k in keys if k.endswith(_B_SUFFIX)}
    if a != b:
        raise AdapterFileError(f"adapter has lora_A without lora_B (or the reverse) for {sorted(a ^ b)[:4]}")
    if not a:
        raise AdapterFileError("adapter_model.safetensors holds no '*.lora_A.weight' / '*.lora_B.weight' tensors")
    return sorted(a)


# Tensors PEFT writes beside lora_A/lora_B for features bdlora does not read: why each is refused.
_EXTRA_TENSOR_REASONS = (
    (".lora_B.bias", "a LoRA bias (PEFT lora_bias=True)"),
    (".lora_magnitude_vector", "a DoRA magnitude vector (PEFT use_dora=True)"),
    (".lora_embedding_A", "an embedding LoRA"),
    (".lora_embedding_B", "an embedding LoRA"),
    ("modules_to_save", "a fully trained module (PEFT modules_to_save)"),
    ("trainable_tokens", "trainable token embeddings (PEFT trainable_token_indices)"),
)


def check_tensor_names(keys, source: str) -> None:
    """Refuses tensors that are not a ``lora_A.weight``/``lora_B.weight`` factor: bdlora's conversions would drop
    them and change the adapter's outputs (or leave a config PEFT cannot load)."""
    extra = sorted(k for k in keys if not (k.endswith(_A_SUFFIX) or k.endswith(_B_SUFFIX)))
    if not extra:
        return
    first = extra[0]
    why = next((what for key, what in _EXTRA_TENSOR_REASONS if key in first), "not a LoRA factor")
    more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
    raise UnsupportedAdapterError(
        f"{source}: tensor {first!r} ({why}){more} is not a lora_A/lora_B factor; bdlora reads, converts and serves "
        "only the LoRA factors and would silently drop it. Remove it from the file (and the feature from "
        "adapter_config.json) if the adapter works without it; otherwise use the adapter with PEFT directly")


def check_supported_features(cfg: AdapterConfig, source: str) -> None:
    """Refuses PEFT config features bdlora cannot reproduce exactly (empty ``rank_pattern``/``alpha_pattern`` are
    fine). Each would otherwise change the adapter's outputs after a conversion or leave a folder PEFT cannot load."""
    raw = cfg.raw or {}
    reasons = []
    if raw.get("rank_pattern"):
        reasons.append(f"rank_pattern={raw['rank_pattern']!r} (per-module ranks; bdlora reads one rank r per adapter)")
    if raw.get("alpha_pattern"):
        reasons.append(f"alpha_pattern={raw['alpha_pattern']!r} (per-module scales; bdlora's conversions write one "
                       "scale for all modules and would change the outputs)")
    if raw.get("lora_bias"):
        reasons.append("lora_bias=true (lora_B biases; bdlora's conversions would drop them)")
    if raw.get("use_dora"):
        reasons.append("use_dora=true (DoRA magnitude vectors; not a plain LoRA)")
    if raw.get("modules_to_save"):
        reasons.append(f"modules_to_save={raw['modules_to_save']!r} (fully trained modules; bdlora would drop their "
                       "weights and keep the config, which PEFT then cannot load)")
    if raw.get("trainable_token_indices"):
        reasons.append("trainable_token_indices (trained embedding rows; bdlora would drop them)")
    if raw.get("target_parameters"):
        why = check_target_parameters(raw["target_parameters"])
        if why:
            reasons.append(why)
    if reasons:
        raise UnsupportedAdapterError(
            f"{source}: bdlora does not support " + "; ".join(reasons) + ". Use this adapter with PEFT directly, or "
            "retrain it without these options")


def check_factor_shapes(cfg: AdapterConfig, path: str, a_shape: tuple, b_shape: tuple) -> Optional[Layout]:
    """Validates one module's stored shapes against the config; returns its layout."""
    if len(a_shape) != 2 or len(b_shape) != 2 or 0 in a_shape or 0 in b_shape:
        raise AdapterFileError(f"{path}: factor shapes A{tuple(a_shape)} B{tuple(b_shape)} are not two non-empty "
                               "matrices; the adapter was written for a layer or tensor-parallel size it does not fit")
    layout = cfg.layout_of(path)
    if a_shape[0] != cfg.r or b_shape[1] * (cfg.nblocks if layout == COLUMN else 1) != cfg.r:
        if layout == COLUMN and b_shape[1] == cfg.r and cfg.nblocks > 1:
            raise AdapterFileError(
                f"{path}: lora_B has shape {b_shape}, a dense (d_out, r) factor, but use_bdlora says it is "
                f"block-diagonal and packed (d_out, r/nblocks)=({b_shape[0]}, {cfg.r // cfg.nblocks}): this is a "
                "dense adapter with a BD config; convert it with `bdlora convert to-bd`"
            )
        raise AdapterFileError(f"{path}: factor shapes A{a_shape} B{b_shape} do not fit r={cfg.r}"
                               + (f", nblocks={cfg.nblocks} ({layout} layout)" if layout else ""))
    if layout is not None:
        n = cfg.nblocks
        d_out = b_shape[0]
        d_in = a_shape[1] * (n if layout == ROW else 1)
        if d_out % n:
            raise AdapterFileError(f"{path}: d_out={d_out} is not divisible by nblocks={n}")
        expect = packed_shapes(layout, d_in, d_out, cfg.r, n)
        if (tuple(a_shape), tuple(b_shape)) != expect:
            raise AdapterFileError(f"{path}: stored shapes A{a_shape} B{b_shape}, expected packed {expect} "
                                   f"for a {layout}-parallel layer with nblocks={n}")
    return layout


def layer_dims(cfg: AdapterConfig, path: str, a_shape: tuple, b_shape: tuple) -> tuple[int, int]:
    """(d_in, d_out) of the layer a (packed) factor pair adapts."""
    return a_shape[1] * (cfg.nblocks if cfg.layout_of(path) == ROW else 1), b_shape[0]


# Llama-style projection names: which read the residual stream (d_in = hidden) and which write it (d_out = hidden).
_READS_HIDDEN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_WRITES_HIDDEN = ("o_proj", "down_proj")
_LAYER_INDEX = re.compile(r"\.\d+\.")  # the first numeric path component is the layer index


def check_layer_widths(dims: dict[str, tuple[int, int]], source: str) -> None:
    """Factors that must agree on a width do: every q/k/v/gate/up input and o/down output is the model's hidden size,
    and in one block gate/up outputs equal down's input and q's output equals o's input. ``dims`` maps module paths to
    (d_in, d_out). The hidden size is compared within one stack of layers (the path before its layer index), so a
    vision tower may differ from the language model. Other module names are not checked (their widths are not known
    from the names)."""
    # One hidden size per stack of layers: a VLM's vision tower and its language model have their own.
    stacks: dict[str, dict[int, list[str]]] = {}
    for p, (d_in, d_out) in dims.items():
        leaf = p.rsplit(".", 1)[-1]
        m = _LAYER_INDEX.search(p)
        hidden = stacks.setdefault(p[: m.start()] if m else "", {})
        if leaf in _READS_HIDDEN:
            hidden.setdefault(d_in, []).append(f"{p} input")
        elif leaf in _WRITES_HIDDEN:
            hidden.setdefault(d_out, []).append(f"{p} output")
    for hidden in stacks.values():
        if len(hidden) > 1:
            common = max(hidden, key=lambda w: len(hidden[w]))
            odd_w = next(w for w in hidden if w != common)
            raise AdapterFileError(
                f"{source}: {hidden[odd_w][0]} is {odd_w} wide but {hidden[common][0]} (and "
                f"{len(hidden[common]) - 1} more) is {common}: all of them are the model's hidden size. The factors "
                "come from different models or the file is corrupt; re-export the adapter")
    pairs = (("gate_proj", 1, "down_proj", 0), ("up_proj", 1, "down_proj", 0), ("q_proj", 1, "o_proj", 0))
    for p, d in dims.items():
        parent, leaf = p.rsplit(".", 1) if "." in p else ("", p)
        for src, si, dst, di in pairs:
            other = f"{parent}.{dst}"
            if leaf == src and other in dims and d[si] != dims[other][di]:
                raise AdapterFileError(
                    f"{source}: {p} has {d[si]} outputs but {other} reads {dims[other][di]} inputs; in one block they "
                    "are the same width. The factors come from different models or the file is corrupt")


def _read_expert_factors(tensors: dict, target_parameters, r: int, nblocks: int, scale: float, source: str
                         ) -> dict[str, ExpertFactors]:
    """Takes every expert factor out of ``tensors`` (PEFT key names, :func:`expert_key_prefixes`) and returns them
    as {``<experts module path>.<tensor name>``: ExpertFactors}, unflattened and checked: a lora_A/lora_B pair per
    layer and tensor, rows that split into r per expert, and B's width matching A's experts and blocks."""
    prefixes = expert_key_prefixes(target_parameters)
    by_depth = sorted(prefixes.items(), key=lambda kv: -len(kv[1]))  # deepest first: ".base_layer" ends the other
    out = {}
    for key in [k for k in tensors if k.endswith((PEFT_A_SUFFIX, PEFT_B_SUFFIX))]:
        stem = key[: -len(PEFT_A_SUFFIX)]
        name = next((n for n, pre in by_depth if stem.endswith("." + pre)), None)
        if name is None or not key.endswith(PEFT_A_SUFFIX):
            continue
        path = stem[: -len(prefixes[name])] + "mlp.experts." + name
        b_key = stem + PEFT_B_SUFFIX
        if b_key not in tensors:
            raise AdapterFileError(f"{source}: {key} has no {b_key}")
        flat_a, flat_b = tensors.pop(key), tensors.pop(b_key)
        if flat_a.dim() != 2 or flat_b.dim() != 2 or flat_a.shape[0] % r or flat_a.shape[0] == 0:
            raise AdapterFileError(f"{source}: {path}: lora_A {tuple(flat_a.shape)} is not (r x experts, d_in) "
                                   f"with r={r}")
        e = flat_a.shape[0] // r
        layout, _ = EXPERT_TENSORS[name]
        b_rank = r // nblocks if layout == COLUMN else r
        if flat_b.shape[1] != b_rank * e:
            raise AdapterFileError(f"{source}: {path}: lora_B {tuple(flat_b.shape)} should have {b_rank} x {e} "
                                   f"columns for {e} experts of rank {r} in {nblocks} block(s)")
        a, b = from_peft_layout(flat_a, flat_b, e)
        out[path] = ExpertFactors(name, a, b, nblocks, scale)
    return out


def _expert_tensors(experts: dict[str, ExpertFactors], target_parameters) -> dict[str, torch.Tensor]:
    """The PEFT-named, flattened tensors of ``experts`` (the inverse of :func:`_read_expert_factors`)."""
    prefixes = expert_key_prefixes(target_parameters)
    out = {}
    for path, f in experts.items():
        stem = path[: -len("mlp.experts." + f.name)] + prefixes[f.name]
        a, b = to_peft_layout(f.lora_A.detach(), f.lora_B.detach())
        out[stem + PEFT_A_SUFFIX], out[stem + PEFT_B_SUFFIX] = a.contiguous().cpu(), b.contiguous().cpu()
    return out


def load_adapter(path: str | os.PathLike, device: str = "cpu") -> Adapter:
    """Loads and validates a PEFT LoRA folder (BD or dense); the strict reader every bdlora command uses.

    Refused, with :class:`AdapterFileError` or :class:`UnsupportedAdapterError` naming the file and the problem:
    unreadable or malformed config/weights, tensors that are not lora_A/lora_B factors, non-floating or NaN/Inf
    factors, zero-sized or mis-shaped factors, widths that disagree between modules (:func:`check_layer_widths`),
    and config features bdlora cannot reproduce (:func:`check_supported_features`).
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_config(path)
    check_supported_features(cfg, str(path / CONFIG_NAME))
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        hint = (" (found adapter_model.bin: re-save it with safe_serialization=True)"
                if (path / "adapter_model.bin").is_file() else "")
        raise AdapterFileError(f"{path}: no {WEIGHTS_NAME}{hint}")
    try:
        tensors = load_file(str(weights), device=device)
    except Exception as e:  # safetensors raises its own SafetensorError, OSError or ValueError on a bad file
        raise AdapterFileError(f"{weights}: cannot read it as safetensors ({type(e).__name__}: {e}); the file is "
                               "truncated or corrupt, re-save or re-download the adapter") from None
    experts = {}
    if cfg.raw.get("target_parameters"):
        experts = _read_expert_factors(tensors, cfg.raw["target_parameters"], cfg.r, cfg.nblocks or 1, cfg.scale,
                                      str(weights))
    check_tensor_names(tensors, str(weights))
    modules, dims = {}, {}
    for p in module_paths(tensors) if tensors or not experts else []:
        a, b = tensors[p + _A_SUFFIX], tensors[p + _B_SUFFIX]
        for name, t in ((p + _A_SUFFIX, a), (p + _B_SUFFIX, b)):
            _check_finite(t, name, weights)
        layout = check_factor_shapes(cfg, p, tuple(a.shape), tuple(b.shape))
        dims[p] = layer_dims(cfg, p, tuple(a.shape), tuple(b.shape))
        modules[p] = LoraFactors(a, b, layout, cfg.nblocks or 1, cfg.scale)
    check_layer_widths(dims, str(weights))
    for path, f in experts.items():
        _check_finite(f.lora_A, path + ".lora_A", weights)
        _check_finite(f.lora_B, path + ".lora_B", weights)
    return Adapter(cfg, modules, experts)


def _check_finite(t: torch.Tensor, name: str, weights: Path) -> None:
    if not t.is_floating_point():
        raise AdapterFileError(f"{weights}: tensor {name!r} has dtype {t.dtype}; LoRA factors are floating point "
                               "(quantized factors are not supported)")
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise AdapterFileError(f"{weights}: tensor {name!r} has {bad} NaN/Inf values; the adapter is broken "
                               "(training diverged?), use an earlier checkpoint")


# Temporary and replaced folders of the atomic writer: `.{name}.bdlora-tmp-{host}-{pid}-{hex}` (and `-old-`). The
# host hash and pid say who owns one, so a later write can remove those whose process is gone, and nothing else.
_NAME_KEEP = 100  # characters of the destination name kept in these names (file names are limited to 255 bytes)


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's live process / not a pid we can ask about
        return pid > 0
    return True


def _work_name(dest: Path, kind: str) -> str:
    return f".{dest.name[:_NAME_KEEP]}.bdlora-{kind}-{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


def clean_stale_work_dirs(dest: str | os.PathLike) -> list[Path]:
    """Removes the temporary/replaced folders that interrupted atomic writes of ``dest`` left next to it: only folders
    named by this writer, on this host, whose process is no longer running. Returns what it removed."""
    dest = Path(os.path.abspath(dest))
    pattern = re.compile(rf"^\.{re.escape(dest.name[:_NAME_KEEP])}\.bdlora-(?:tmp|old)-{_host_tag()}-(\d+)-[0-9a-f]+$")
    removed = []
    try:
        entries = list(dest.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if not m or entry.is_symlink() or not entry.is_dir():
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _remove(path: Path) -> None:
    """Removes a replaced destination: a folder's tree, or a symlink itself (never what it points to)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _contains(outer: Path, inner: Path) -> bool:
    """True when ``inner`` is ``outer`` or lies inside it (both absolute, symlinks resolved)."""
    return inner == outer or outer in inner.parents


class _AtomicDir:
    """Temporary sibling directory renamed onto ``dest`` on success; never leaves a half-written folder or a
    temporary one behind (on failure or interrupt the temporary folder is removed; stale ones of dead writers are
    removed on the next write)."""

    def __init__(self, dest: str | os.PathLike, overwrite: bool):
        self.dest = Path(os.path.abspath(dest))
        self.overwrite = overwrite

    def __enter__(self) -> Path:
        dest = self.dest
        real = Path(os.path.realpath(dest))
        if dest.parent == dest or _contains(real, Path(os.path.realpath(os.getcwd()))):
            raise OutputPathError(f"refusing to write to {dest}: it is the current directory or contains it; give a "
                                  "new folder name as the output")
        if os.path.lexists(dest):
            if not dest.is_dir():
                raise OutputPathError(f"refusing to write to {dest}: it exists and is not a folder; remove it or "
                                      "choose another output path")
            if not self.overwrite:
                raise OutputPathError(f"refusing to write to {dest}: it already exists; choose a new output path")
        dest.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_work_dirs(dest)
        self.tmp = dest.parent / _work_name(dest, "tmp")
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        dest, old = self.dest, None
        try:
            if exc_type is None:
                _follow_umask(self.tmp)
                if os.path.lexists(dest):
                    old = dest.parent / _work_name(dest, "old")
                    os.replace(dest, old)
                try:
                    os.replace(self.tmp, dest)
                except BaseException:
                    if old is not None:
                        os.replace(old, dest)  # put the previous folder back
                        old = None
                    raise
        finally:
            if self.tmp.exists():
                shutil.rmtree(self.tmp, ignore_errors=True)
            if old is not None:
                _remove(old)
        return False


def _follow_umask(folder: Path) -> None:
    """Modes of a finished folder as ``open``/``mkdir`` give under the umask (0644 / 0755 with the usual 022): some
    writers (safetensors) create their files 0600, which a server running as another user cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def atomic_output_dir(dest: str | os.PathLike, overwrite: bool = True):
    """Context manager yielding a temp dir (next to ``dest``) that atomically becomes ``dest`` when the block succeeds.

    ``overwrite=True`` (the trainer's and model cache's outputs) replaces an existing ``dest`` folder;
    ``overwrite=False`` refuses an existing ``dest``. Always refused (:class:`OutputPathError`): a ``dest`` that
    exists and is not a folder, and one that is or contains the current directory. Callers that replace user
    folders check them first with :func:`check_output_path`.
    """
    return _AtomicDir(dest, overwrite)


# errno values of a write the user can fix: disk full, quota, read-only file system, permission
_WRITE_ERRNOS = {28: "no space left on device", 122: "disk quota exceeded", 30: "read-only file system",
                 13: "permission denied"}


def disk_write_error(exc: BaseException, folder: str | os.PathLike) -> Optional[str]:
    """A message for a write under ``folder`` that failed for a reason the user fixes (disk full, quota, read-only,
    permission), naming the reason and the free space there; None for any other error. ``exc``: an ``OSError``, or
    an error whose text carries the OS's: safetensors' "(os error N)", a spawned process's traceback "[Errno N]",
    torch.save's "file write failed" (which names no reason)."""
    code = exc.errno if isinstance(exc, OSError) else None
    text = str(exc)
    if code is None:
        found = re.search(r"\(os error (\d+)\)|\[Errno (\d+)\]", text)
        code = int(found.group(1) or found.group(2)) if found else None
    if code in _WRITE_ERRNOS:
        reason = _WRITE_ERRNOS[code]
    elif code is None and "file write failed" in text:
        reason = "a file write failed"
    else:
        return None
    where = Path(os.path.abspath(folder))
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free / 2**30
    return f"could not write under {folder}: {reason} ({free:.1f} GiB free there)"


def check_output_path(output: str | os.PathLike, inputs=(), force: bool = False) -> None:
    """Refuses an output path a conversion must not replace; raises :class:`OutputPathError` saying why.

    A missing ``output`` is fine. An existing one is refused unless ``force``; with ``force`` it is replaced only if it
    is an adapter folder (has ``adapter_config.json``, no subfolders) that is not the current directory or one of its
    ancestors, and is neither one of ``inputs`` nor contains one of them.
    """
    out = Path(os.path.abspath(output))
    if not os.path.lexists(out):
        return
    if not force:
        raise OutputPathError(f"output {output} already exists; bdlora does not overwrite it. Choose a new path, or "
                              "pass --force to replace an existing adapter folder")
    real = Path(os.path.realpath(out))
    if not out.is_dir():
        raise OutputPathError(f"output {output} is a file, not an adapter folder; --force replaces only adapter "
                              "folders, remove it yourself if it should go")
    if _contains(real, Path(os.path.realpath(os.getcwd()))):
        raise OutputPathError(f"output {output} is the current directory or contains it; --force never replaces "
                              "that, give a new folder name")
    for inp in inputs:
        if _contains(real, Path(os.path.realpath(inp))):
            what = "is the input adapter" if real == Path(os.path.realpath(inp)) else "contains the input adapter"
            raise OutputPathError(f"output {output} {what} {inp}; --force never replaces an input, write to a new "
                                  "folder")
    if not (out / CONFIG_NAME).is_file():
        raise OutputPathError(f"output {output} is not an adapter folder (no {CONFIG_NAME}); --force replaces only "
                              "adapter folders, choose another path")
    subdirs = sorted(p.name for p in out.iterdir() if p.is_dir())
    if subdirs:
        raise OutputPathError(f"output {output} holds subfolders {subdirs[:4]}, so it is more than an adapter folder; "
                              "--force does not replace it, choose another path")


#: the PEFT config fields of a folder bdlora writes from scratch (beside the decisive ones)
CONFIG_DEFAULTS = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "lora_dropout": 0.0,
                   "fan_in_fan_out": False}


def config_dict(cfg: AdapterConfig) -> dict:
    """The JSON dict to save: the original PEFT dict with the decisive fields rewritten."""
    raw = dict(cfg.raw) if cfg.raw else dict(CONFIG_DEFAULTS)
    raw.update(r=cfg.r, lora_alpha=cfg.peft_lora_alpha, use_rslora=cfg.use_rslora,
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


def adapter_tensors(adapter: Adapter) -> dict[str, torch.Tensor]:
    """The adapter's tensors by their file keys, after checking shapes, and each module's layout and block count,
    against the config (so a bad adapter is never written)."""
    cfg = adapter.config
    tensors = {}
    for p, f in adapter.modules.items():
        layout = check_factor_shapes(cfg, p, tuple(f.lora_A.shape), tuple(f.lora_B.shape))
        if (f.layout, f.nblocks) != (layout, cfg.nblocks or 1):
            raise AdapterFileError(
                f"{p}: its factors are {f.layout or 'dense'} with nblocks={f.nblocks} but the config makes it "
                f"{layout or 'dense'} with nblocks={cfg.nblocks or 1}; the factors do not belong to this config")
        tensors[p + _A_SUFFIX] = f.lora_A.detach().contiguous().cpu()
        tensors[p + _B_SUFFIX] = f.lora_B.detach().contiguous().cpu()
    if adapter.experts:
        target = cfg.raw.get("target_parameters")
        listed = {t.rsplit(".", 1)[-1] for t in target} if not check_target_parameters(target) else set()
        if {f.name for f in adapter.experts.values()} - listed:
            raise AdapterFileError(f"the adapter has expert factors but its config's target_parameters={target!r} "
                                   "does not list their tensors")
        for path_, f in adapter.experts.items():
            if f.nblocks != (cfg.nblocks or 1):
                raise AdapterFileError(f"{path_}: its factors have nblocks={f.nblocks} but the config "
                                       f"{cfg.nblocks or 1}; the factors do not belong to this config")
        tensors.update(_expert_tensors(adapter.experts, target))
    return tensors


def _write_files(tensors: dict[str, torch.Tensor], cfg: AdapterConfig, folder: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    with open(folder / CONFIG_NAME, "w") as fh:
        json.dump(config_dict(cfg), fh, indent=2, sort_keys=True)


def write_adapter_files(adapter: Adapter, folder: str | os.PathLike) -> None:
    """Writes the adapter's two files into ``folder`` (an :func:`atomic_output_dir` staging folder: not atomic by
    itself), replacing what is there."""
    _write_files(adapter_tensors(adapter), adapter.config, Path(folder))


def save_adapter(adapter: Adapter, path: str | os.PathLike, overwrite: bool = True) -> Path:
    """Writes a PEFT folder atomically (:func:`atomic_output_dir`, ``overwrite`` as there), validated first
    (:func:`adapter_tensors`) so a bad adapter never starts a write."""
    tensors = adapter_tensors(adapter)
    path = Path(path)
    with atomic_output_dir(path, overwrite=overwrite) as tmp:
        _write_files(tensors, adapter.config, tmp)
    return path


def add_experts(adapter: Adapter, factors: dict[str, ExpertFactors]) -> Adapter:
    """``adapter`` with BD-LoRA on fused expert tensors added (``{<experts module path>.<tensor>: ExpertFactors}``,
    PEFT's module paths such as ``base_model.model.model.layers.0.mlp.experts.gate_up_proj``): the config lists the
    tensors in ``target_parameters`` and their names in ``use_bdlora`` beside the dense layers'. The factors must
    share the adapter's N, r and scale (a dense-free adapter takes theirs)."""
    fs = list(factors.values())
    n, scale = fs[0].nblocks, fs[0].scale
    r = fs[0].lora_A.shape[1]
    if any((f.nblocks, f.lora_A.shape[1], f.scale) != (n, r, scale) for f in fs):
        raise BDLoraError("add_experts: the expert factors differ in nblocks, r or scale; one adapter has one of each")
    cfg = adapter.config
    if adapter.modules and ((cfg.nblocks or 1) != n or cfg.r != r or not math.isclose(cfg.scale, scale, rel_tol=1e-9)):
        raise BDLoraError(f"add_experts: expert factors of nblocks={n}, r={r}, scale={scale:g} do not belong to an "
                          f"adapter of nblocks={cfg.nblocks or 1}, r={cfg.r}, scale={cfg.scale:g}")
    bd = dict(cfg.raw.get("use_bdlora") or {})
    for key, layout in (("target_modules_bd_a", ROW), ("target_modules_bd_b", COLUMN)):
        names = [t for t, (lay, _) in EXPERT_TENSORS.items() if lay == layout]
        bd[key] = list(bd.get(key) or []) + [t for t in names if t not in (bd.get(key) or [])]
    alpha = cfg.peft_lora_alpha if adapter.modules else scale * math.sqrt(r)  # PEFT's rsLoRA: scale = alpha/sqrt(r)
    raw = {**(cfg.raw or CONFIG_DEFAULTS), "r": r, "lora_alpha": alpha, "use_rslora": True,
           "target_modules": sorted(cfg.target_modules), "target_parameters": list(PEFT_TARGET_PARAMETERS),
           "use_bdlora": {**bd, "nblocks": n, "match_strict": True}}
    return Adapter(AdapterConfig.from_dict(raw), dict(adapter.modules), {**adapter.experts, **factors})


def expert_adapter(experts: dict, base_model_name_or_path: Optional[str] = None) -> Adapter:
    """The :class:`Adapter` (a BD expert adapter folder once saved with :func:`save_adapter`) of trained
    :class:`bdlora.moe.BDLoraExperts` modules, keyed by their experts module paths as PEFT names them
    (``base_model.model.model.layers.0.mlp.experts``); all must share N, r and alpha."""
    state = {f"{path}.{n}": t for path, m in experts.items() for n, t in m.named_parameters(recurse=False)}
    factors = trained_expert_factors(state, experts)
    empty = Adapter(AdapterConfig.from_dict({**CONFIG_DEFAULTS, "r": 1, "lora_alpha": 1, "target_modules": [],
                                             "base_model_name_or_path": base_model_name_or_path}), {})
    return add_experts(empty, factors)


__all__ = [
    "Adapter", "AdapterConfig", "AdapterFileError", "CONFIG_DEFAULTS", "CONFIG_NAME", "OutputPathError",
    "UnsupportedAdapterError", "WEIGHTS_NAME", "adapter_tensors", "add_experts", "atomic_output_dir",
    "check_factor_shapes", "check_layer_widths", "check_output_path", "check_supported_features",
    "check_tensor_names", "clean_stale_work_dirs", "config_dict", "disk_write_error", "expert_adapter", "layer_dims",
    "load_adapter", "module_paths", "read_config", "save_adapter", "shape_of", "write_adapter_files",
]
