"""The attention kernels torch's sdpa may pick while training, shared by `bdlora train` and `bdlora sweep`."""

from __future__ import annotations

import contextlib


def sdpa_backends(cudnn_attention: bool):
    """A context in which sdpa picks among flash, memory-efficient and math attention, leaving cuDNN's out unless
    ``cudnn_attention``: cuDNN builds an execution plan per new input shape, and batches of varying length keep
    bringing new shapes, whose host time costs more than cuDNN's kernels save (TrainConfig.cudnn_attention)."""
    if cudnn_attention:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
