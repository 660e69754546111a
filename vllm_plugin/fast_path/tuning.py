"""Which serving kernel runs which token count, per GPU: measured cut-offs and tiles as data, one named-key JSON file
per device name (``configs/<torch.cuda.get_device_name with _ for spaces>.json``, like vLLM's tuned kernel configs),
``configs/default_cuda.json`` for unknown GPUs and ``configs/cpu.json``. Each file's ``why`` says what measurement
chose its values; the numbers themselves are in BENCHMARKS.md.

A BD layer served with ``--enable-bdlora`` (:mod:`bdlora.vllm_plugin.fast_path`) looks its device up once, when
it is built, and then picks per forward, inside its opaque custom op (so per captured CUDA-graph size), by the
number of tokens T of that forward:

    fold layers (A stored under the base weight, ``fold``):
        T == 1                 (only layers whose (d_in, d_out) has a ``gemv_one_token_shapes`` row whose tiles fit
                               the layer's slices) the same one launch for one token (``GemvTiles.one_token``:
                               the shrink per output tile, products summed in fp32 without tl.dot's 16-row tiles),
                               with that row's tiles (block_n, block_k, split_k, warps, stages)
        T <= fold_gemv_max     (only layers whose base weight's (d_in, d_out) has a ``gemv_shapes`` row whose
                               tiles fit the layer's slices)
                               ``decode_lora_folded(kernel="gemv")``: base GEMM, shrink and expand in ONE launch,
                               with that row's tiles (block_n, block_k, split_k, warps, stages[, local_shrink])
        T <= fold_decode_max   one GEMM with [W; A] + ``decode_lora_folded(kernel="decode")`` (per-token programs)
        T <= fold_gemm_max     one GEMM with [W; A] + ``decode_lora_folded(kernel="gemm")`` (token tiles, tl.dot),
                               tiles from the layer's ``gemm_shapes`` rows, then ``gemm_tiles``: the first
                               (max_tokens, block_m, block_n, warps) row with T <= max_tokens (``gemm_rows``);
                               with ``gemm_sorted`` and several slots, on the tokens grouped by slot
        above                  the base GEMM (on W's view) + vLLM's punica kernels
    layers that cannot fold (quantized base, dtype mismatch, or LoRA rows above ``fold_max_extra`` x d_out), and
    fold layers above their cut-offs (after the base GEMM on W's view):
        T <= two_launch_max    ``decode_lora`` (two launches: partial shrinks, expand)
        above                  vLLM's punica kernels

Before all of these, a fold layer whose (d_in, d_out) has a ``side_shapes`` row ((0, 0): any shape) runs forwards
of 2 <= T <= ``side_max`` tokens with the base GEMM on W's view while a second CUDA stream computes the LoRA term
(``decode_lora`` into a zeroed buffer), then one add: the term runs beside the GEMM, not after it. A row whose third
entry is 1 (``defer``) also runs one-token forwards so (with ``side_max`` >= 1) and leaves their add to the model's
next compiled kernel (SiLU-and-mul, add + RMSNorm, rotary: the layer returns base output + a one-row term as a traced
add, which Inductor fuses into that kernel); its other forwards return their whole output and a zero row. A
row-parallel layer at TP > 1 adds before its all-reduce, so there ``defer`` is ignored. Off in every entry
(``side_max`` 0): served on an H100 the deferred path gains at TP=8's
gate_up at batch 1 only, its zero term costs at batch 16, and at TP=4 the second stream's kernels slow beside the GEMMs.

A layer whose LoRA rows (slices x max_loras x rank) exceed ``fold_max_extra`` x d_out (a wide fold: many slots of a
high rank, e.g. qkv with ``--max-loras`` 4) still folds:
    T == 1                 its one-token tiles, where it has them (one token reads its own slot's A rows alone)
    T <= two_launch_max    as a layer that cannot fold (base GEMM on W's view, the two-launch kernel)
    T <= fold_gemm_max     the tiled fold kernel: its GEMM reads every slot's A rows, which costs less than vLLM's
                           punica kernels do above two_launch_max
    above                  as a layer that cannot fold (vLLM's punica kernels)

A per-tile-shrink row (local_shrink, and every one-token row) reads its slice's A rows in every tile: every slot's
(max_loras x the per-device rank) at T > 1, the token's own slot's (the rank) at T == 1. It applies only while those
rows (``GemvTiles.shrink_rows``) are at most ``gemv_local_max_rows``: beyond, its tiles lose to the tiled path or no
longer fit in shared memory, and the next row of the shape, or the path below, serves instead. A shared-shrink row
(``gemv_shapes`` without local_shrink) likewise applies only while the slots' rank rows per slice (max_loras x the
per-device rank) are at most ``gemv_shared_max_rows``: its A tiles grow with them, and past it the tiled path won.
A ``gemv_shape_max_rows`` row (d_in, d_out, max_rows) replaces both limits for the rows of its shape, where that
shape's crossover lies lower than the others' (TP=8's down with four slots, H200).

With ``pdl`` the folded and the two-launch kernels are launched with programmatic dependent launch: each starts
while the kernel before it drains, and reads the LoRA weights and slot ids before it waits for that kernel's output.

Entries are measured with ``bench/kernels/bench_serving_kernels.py`` (per-module times of every path at each T, at
the per-GPU shapes of TP=4 and TP=8 Llama-3.1-8B shards) and checked in serving with
``bench/serve/auto_proxy.py``; BENCHMARKS.md ("One flag: the serving path picked per token count") has the numbers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

from bdlora.kernels.decode import GEMV_MAX_TOKENS, ExpandTiles, GemvTiles

UNLIMITED = 1 << 30
#: LoRA rows folded under a base weight, as a fraction of its output rows, above which every forward's GEMM pays
#: more for them than the two-launch path costs (a wide fold: see the module docstring).
FOLD_MAX_EXTRA = 0.25


@dataclass(frozen=True)
class GemmRows:
    """A layer's kernel="gemm" tiles by token count: (max_tokens, ExpandTiles) rows, the first with T <= max_tokens
    serving a forward of T tokens (the last row above its max_tokens)."""

    rows: tuple

    def tiles_for(self, tokens: int) -> ExpandTiles:
        """The tiles of a forward of ``tokens`` tokens."""
        for max_t, tiles in self.rows:
            if tokens <= max_t:
                return tiles
        return self.rows[-1][1]

    def tiles_between(self, lo: int, hi: int) -> tuple:
        """The distinct tiles that forwards of ``lo`` to ``hi`` tokens take (the rows whose token range meets
        lo..hi), in row order: what a layer compiles before serving."""
        out, prev = [], 0
        for max_t, tiles in self.rows:
            if prev < hi and max_t >= lo and max_t > prev and tiles not in out:  # this row serves prev + 1 .. max_t
                out.append(tiles)
            prev = max(prev, max_t)
        return tuple(out)


@dataclass(frozen=True)
class ServingTuning:
    """One device's cut-offs (token counts per forward) and tiles; see the module docstring."""

    fold: bool = True
    fold_decode_max: int = 8
    fold_gemm_max: int = UNLIMITED
    two_launch_max: int = 8
    fold_max_extra: float = FOLD_MAX_EXTRA
    gemm_tiles: tuple = ((UNLIMITED, 16, 64, 4),)
    # rows (d_in, d_out, min_slot_rows, max_tokens, block_m, block_n, warps): a layer of base weight (d_in, d_out;
    # 0, 0: any) whose slots hold at least min_slot_rows rank rows per slice (max_loras x rank, the B rows a tiled
    # expand program reads) takes these rows before gemm_tiles
    gemm_shapes: tuple = ()
    # the tiled kernel with several slots runs on the tokens grouped by slot (SlotSegments, once per slot map):
    # each token tile then reads one slot's B, not every slot's
    gemm_sorted: bool = False
    fold_gemv_max: int = 0
    # rows (d_in, d_out, block_n, block_k, split_k, warps, stages[, local_shrink 0/1]); d_in = d_out = 0: any shape
    gemv_shapes: tuple = ()
    # rows (d_in, d_out, block_n, block_k, split_k, warps, stages): T == 1 on the one-launch kernel, one_token tiles
    gemv_one_token_shapes: tuple = ()
    # the most A rows per slice a per-tile-shrink row reads (max_loras x rank; one token: rank), see above
    gemv_local_max_rows: int = 64
    # the most slot rank rows per slice (max_loras x rank) for which a shared-shrink gemv_shapes row applies
    gemv_shared_max_rows: int = UNLIMITED
    # rows (d_in, d_out, max_rows): for the gemv_shapes and gemv_one_token_shapes rows of that base weight, the most
    # rows (as gemv_local_max_rows / gemv_shared_max_rows count them) instead of those two
    gemv_shape_max_rows: tuple = ()
    pdl: bool = False  # serving kernels launched with programmatic dependent launch (decode_lora*(pdl=True))
    # forwards of 2..side_max tokens on a layer whose (d_in, d_out) has a side_shapes row (0, 0: any): the LoRA term
    # on a second CUDA stream beside the base GEMM (see above); 0: never. Rows (d_in, d_out[, defer 0/1]).
    side_max: int = 0
    side_shapes: tuple = ()

    def __post_init__(self):
        for name in ("fold_decode_max", "fold_gemm_max", "two_launch_max", "fold_gemv_max", "gemv_local_max_rows",
                     "gemv_shared_max_rows",
                     "side_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                what = "a row count" if name.endswith("_rows") else "a token count"
                raise ValueError(f"serving tuning: {name} must be {what} >= 0, got {v!r}")
        for name in ("fold", "pdl", "gemm_sorted"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"serving tuning: {name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.fold_max_extra, (int, float)) or self.fold_max_extra < 0:
            raise ValueError(f"serving tuning: fold_max_extra must be a fraction >= 0, got {self.fold_max_extra!r}")
        rows = tuple(tuple(r) for r in self.gemm_tiles)
        if not rows or any(len(r) != 4 for r in rows) or rows[-1][0] < self.fold_gemm_max:
            raise ValueError("serving tuning: gemm_tiles must be rows (max_tokens, block_m, block_n, warps) whose last "
                             f"max_tokens covers fold_gemm_max ({self.fold_gemm_max}), got {self.gemm_tiles!r}")
        # built once (each raises on a bad tile): GemmRows.tiles_for runs in every served forward
        object.__setattr__(self, "_gemm_tiles", GemmRows(tuple((r[0], ExpandTiles(*r[1:])) for r in rows)))
        object.__setattr__(self, "gemm_tiles", rows)
        shaped = tuple(tuple(r) for r in self.gemm_shapes)
        if any(len(r) != 7 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in r) for r in shaped):
            raise ValueError("serving tuning: gemm_shapes must be rows of 7 ints (d_in, d_out, min_slot_rows, "
                             f"max_tokens, block_m, block_n, warps), got {self.gemm_shapes!r}")
        for r in shaped:
            ExpandTiles(*r[4:])  # raises on a bad tile
        object.__setattr__(self, "gemm_shapes", shaped)
        if self.fold_gemv_max > GEMV_MAX_TOKENS:
            raise ValueError(f"serving tuning: fold_gemv_max is at most {GEMV_MAX_TOKENS} (the one-launch kernel's "
                             f"token tile), got {self.fold_gemv_max}")
        gemv = tuple(tuple(r) for r in self.gemv_shapes)
        def bad_row(r) -> bool:  # 7 ints, then optionally local_shrink as 0 / 1 (or false / true)
            ints = r[:7]
            return (len(r) not in (7, 8) or any(isinstance(v, bool) or not isinstance(v, int) for v in ints)
                    or any(not isinstance(v, int) or v not in (0, 1) for v in r[7:]))

        if any(bad_row(r) for r in gemv):
            raise ValueError("serving tuning: gemv_shapes must be rows of 7 ints (d_in, d_out, block_n, block_k, "
                             f"split_k, warps, stages) and an optional 0/1 (local_shrink), got {self.gemv_shapes!r}")
        gemv = tuple(r[:7] + tuple(bool(v) for v in r[7:]) for r in gemv)
        for r in gemv:
            GemvTiles(*r[2:])  # raises on a bad tile
        object.__setattr__(self, "gemv_shapes", gemv)
        one = tuple(tuple(r) for r in self.gemv_one_token_shapes)
        if any(len(r) != 7 or bad_row(r) for r in one):
            raise ValueError("serving tuning: gemv_one_token_shapes must be rows of 7 ints (d_in, d_out, block_n, "
                             f"block_k, split_k, warps, stages), got {self.gemv_one_token_shapes!r}")
        for r in one:
            GemvTiles(*r[2:], local_shrink=True, one_token=True)
        object.__setattr__(self, "gemv_one_token_shapes", one)
        side = tuple(tuple(r) for r in self.side_shapes)
        if any(len(r) not in (2, 3) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in r[:2])
               or any(not isinstance(v, int) or v not in (0, 1) for v in r[2:]) for r in side):
            raise ValueError("serving tuning: side_shapes must be rows of 2 ints (d_in, d_out; 0, 0: any shape) and an "
                             "optional 0/1 (defer: the add left to the next compiled kernel), got "
                             f"{self.side_shapes!r}")
        object.__setattr__(self, "side_shapes", tuple(r[:2] + tuple(bool(v) for v in r[2:]) for r in side))
        limits = tuple(tuple(r) for r in self.gemv_shape_max_rows)
        if any(len(r) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in r) for r in limits):
            raise ValueError("serving tuning: gemv_shape_max_rows must be rows of 3 ints (d_in, d_out, max_rows), got "
                             f"{self.gemv_shape_max_rows!r}")
        object.__setattr__(self, "gemv_shape_max_rows", limits)

    def side_for(self, d_in: int, d_out: int) -> tuple[int, bool]:
        """(most tokens, defer) of the side-stream path for a layer of base weight (d_in, d_out): ``side_max`` and
        the row's defer flag where a ``side_shapes`` row names the shape (else a 0, 0 row), else (0, False)."""
        rows = ([r for r in self.side_shapes if r[:2] == (d_in, d_out)]
                or [r for r in self.side_shapes if r[:2] == (0, 0)])
        if not rows or self.side_max == 0:
            return 0, False
        return self.side_max, bool(rows[0][2:] and rows[0][2])

    def gemm_rows(self, d_in: int = 0, d_out: int = 0, n_loras: int = 1, rank: int = 0) -> "GemmRows":
        """The kernel="gemm" rows of a layer of base weight (d_in, d_out) with ``n_loras`` slots of rank ``rank``
        (the per-device buffer rank): its ``gemm_shapes`` rows (that shape's, or 0, 0's, with min_slot_rows <=
        n_loras x rank), then ``gemm_tiles`` (no arguments: ``gemm_tiles`` alone, unless a 0, 0 row applies)."""
        own = tuple((r[3], ExpandTiles(*r[4:])) for r in self.gemm_shapes
                    if r[:2] in ((d_in, d_out), (0, 0)) and n_loras * rank >= r[2])
        return GemmRows(own + self._gemm_tiles.rows) if own else self._gemm_tiles

    def gemv_tiles_for(self, d_in: int, d_out: int, slice_offsets: Optional[tuple] = None, n_loras: int = 1,
                       rank: int = 0) -> Optional[GemvTiles]:
        """The one-launch kernel's tiles for a base weight of (d_in, d_out) with ``n_loras`` slots of rank ``rank``
        (the per-device buffer rank), or None: that shape does not take it (the first ``gemv_shapes`` row of that
        shape, or of 0, 0, whose tiles fit ``slice_offsets`` when given and, with local_shrink, whose shrink rows
        are at most ``gemv_local_max_rows``, without it whose slots' rows are at most ``gemv_shared_max_rows``)."""
        if self.fold_gemv_max == 0:
            return None
        return self._first_fitting(self.gemv_shapes, d_in, d_out, slice_offsets, self.fold_gemv_max, n_loras, rank)

    def gemv_one_token_tiles_for(self, d_in: int, d_out: int, slice_offsets: Optional[tuple] = None,
                                 n_loras: int = 1, rank: int = 0) -> Optional[GemvTiles]:
        """The one-launch kernel's tiles for a ONE-token forward on a base weight of (d_in, d_out), or None (the
        first ``gemv_one_token_shapes`` row of that shape, or of 0, 0, that fits as in ``gemv_tiles_for``)."""
        rows = tuple(r + (True, True) for r in self.gemv_one_token_shapes)
        return self._first_fitting(rows, d_in, d_out, slice_offsets, 1, n_loras, rank)

    def _first_fitting(self, rows: tuple, d_in: int, d_out: int, slice_offsets: Optional[tuple], tokens: int,
                       n_loras: int, rank: int) -> Optional[GemvTiles]:
        """The tiles of the first row (d_in, d_out, *GemvTiles fields) of this shape, or of 0, 0, that fit the
        slices and, with the shrink per tile, read at most ``gemv_local_max_rows`` A rows per tile in a call of
        ``tokens`` tokens (the largest call the rows serve); a shared-shrink row, whose slots hold at most
        ``gemv_shared_max_rows`` rank rows per slice (both: the shape's ``gemv_shape_max_rows`` where it has one)."""
        own_limit = next((r[2] for r in self.gemv_shape_max_rows if r[:2] == (d_in, d_out)), None)
        local_max = self.gemv_local_max_rows if own_limit is None else own_limit
        shared_max = self.gemv_shared_max_rows if own_limit is None else own_limit
        for row in rows:
            if (row[0], row[1]) in ((d_in, d_out), (0, 0)):
                tiles = GemvTiles(*row[2:])
                if slice_offsets is not None and not tiles.fits_slices(slice_offsets):
                    continue
                if tiles.local_shrink and tiles.shrink_rows(tokens, n_loras, rank) > local_max:
                    continue
                if not tiles.local_shrink and n_loras * rank > shared_max:
                    continue
                return tiles
        return None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base: Optional["ServingTuning"] = None) -> "ServingTuning":
        """``base`` (default: the dataclass defaults) with the keys of ``d`` replaced; unknown keys raise. Rows may be
        named (``{"d_in": 4096, ...}``, as the JSON files write them) or positional; null is unlimited."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"serving tuning: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        return replace(base or cls(), **{k: _from_json(k, v) for k, v in d.items()})


#: The fields of each kind of row, in the order the rows hold them (named-key rows in the JSON files).
ROW_FIELDS: Mapping[str, tuple] = MappingProxyType({
    "gemm_tiles": ("max_tokens", "block_m", "block_n", "warps"),
    "gemm_shapes": ("d_in", "d_out", "min_slot_rows", "max_tokens", "block_m", "block_n", "warps"),
    "gemv_shapes": ("d_in", "d_out", "block_n", "block_k", "split_k", "warps", "stages", "local_shrink"),
    "gemv_one_token_shapes": ("d_in", "d_out", "block_n", "block_k", "split_k", "warps", "stages"),
    "gemv_shape_max_rows": ("d_in", "d_out", "max_rows"),
    "side_shapes": ("d_in", "d_out", "defer"),
})
_OPTIONAL_ROW_FIELDS = ("local_shrink", "defer")  # trailing flags a row may leave out (false)


def _unlimited(v):
    return UNLIMITED if v is None else v


def _from_json(key: str, value):
    """A tuning value as ServingTuning holds it: named rows to tuples in ``ROW_FIELDS`` order, null to UNLIMITED."""
    if key not in ROW_FIELDS:
        return _unlimited(value)
    names = ROW_FIELDS[key]
    rows = []
    for row in value:
        if isinstance(row, Mapping):
            extra = set(row) - set(names)
            if extra:
                raise ValueError(f"serving tuning: {key} rows have the fields {list(names)}, got {sorted(extra)}")
            missing = [n for n in names if n not in row and n not in _OPTIONAL_ROW_FIELDS]
            if missing:
                raise ValueError(f"serving tuning: a {key} row lacks {missing}: {dict(row)}")
            row = [int(row[n]) if isinstance(row.get(n), bool) else _unlimited(row[n]) for n in names if n in row]
        rows.append(tuple(_unlimited(v) for v in row))
    return tuple(rows)


CONFIG_DIR = Path(__file__).parent / "configs"


def config_file(device_type: str, device_name: Optional[str] = None) -> Path:
    """The JSON file of a device: ``<name with _ for spaces>.json`` where one exists for a CUDA device's name, else
    ``default_cuda.json`` or ``cpu.json``."""
    if device_type == "cuda":
        own = CONFIG_DIR / f"{(device_name or '').replace(' ', '_')}.json"
        return own if device_name and own.is_file() else CONFIG_DIR / "default_cuda.json"
    return CONFIG_DIR / "cpu.json"


def read_config(path: Path) -> dict:
    """A tuning file's keys (its ``why`` notes dropped)."""
    entry = json.loads(Path(path).read_text())
    entry.pop("why", None)
    return entry


def serving_tuning(device_type: str, device_name: Optional[str] = None,
                   override: Optional[Mapping[str, Any]] = None) -> tuple[ServingTuning, str]:
    """The tuning of a device and where it came from: (ServingTuning, source), source the file's name
    (``NVIDIA_H200.json``, ``default_cuda.json``, ``cpu.json``), with " + override" when ``override`` (a dict of
    ServingTuning keys, e.g. from ``additional_config``) replaced some of its keys."""
    path = config_file(device_type, device_name)
    tuning, source = ServingTuning.from_dict(read_config(path)), path.name
    if override:
        tuning = ServingTuning.from_dict(override, tuning)
        source += " + override"
    return tuning, source


def device_tuning(device, override: Optional[Mapping[str, Any]] = None) -> tuple[ServingTuning, str]:
    """``serving_tuning`` for a torch device (its CUDA name looked up here)."""
    import torch

    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return serving_tuning(device.type, name, override)


__all__ = ["CONFIG_DIR", "ROW_FIELDS", "UNLIMITED", "ServingTuning", "config_file", "device_tuning", "read_config",
           "serving_tuning"]

