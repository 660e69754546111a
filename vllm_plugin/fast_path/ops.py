"""The fast path's custom ops, each with its implementation and fake (shape) function.

torch.compile treats the ops as opaque: a compiled graph calls them with the layer's op key (a one-element tensor,
a graph input, so that every layer of a kind traces to the same graph) and the output width, and the op picks the path
of the forward's token count when it runs (:mod:`.ladder`), so every captured CUDA-graph size holds its own kernels.
The key leads to the layer through vLLM's forward context: ``no_compile_layers`` is the running engine's
``compilation_config.static_forward_context``, where :meth:`.state.LayerBuild.register` entered it under the key's
name, so two engines in one process never see each other's layers.

* ``bdlora::lora_linear(y!, x, key)``: y += the LoRA term of a layer that does not fold (vLLM's
  ``_apply_lora_to_output`` hook);
* ``bdlora::fold_linear(x, bias, key, d_out) -> y``: a fold layer's whole output (its ``_apply_sync``);
* ``bdlora::fold_linear_split(x, bias, key, d_out) -> (y, term)``: the same in two parts, the add left to the caller's
  traced code (``side_defer``).
"""

from __future__ import annotations

from typing import Optional

import torch

from bdlora.spec import BDLoraError

from .. import vllm_api as api
from . import ladder
from .state import op_key_name

_forward_context = api.resolve("forward_context.get_forward_context")
_has_forward_context = api.resolve("forward_context.is_forward_context_available")


def find_layer(key: torch.Tensor):
    """The running engine's fast-path layer whose op key is ``key``."""
    if not _has_forward_context():
        raise BDLoraError("torch.ops.bdlora ops run inside a vLLM forward (vllm.forward_context.set_forward_context);"
                          " this one was called outside one")
    return _forward_context().no_compile_layers[op_key_name(key)]


def _lora_linear(y: torch.Tensor, x: torch.Tensor, key: torch.Tensor) -> None:
    ladder.add_lora_term(find_layer(key), y, x)


def _fold_linear(x: torch.Tensor, bias: Optional[torch.Tensor], key: torch.Tensor, d_out: int) -> torch.Tensor:
    return ladder.folded_output(find_layer(key), x, bias)


def _fold_linear_split(x: torch.Tensor, bias: Optional[torch.Tensor], key: torch.Tensor, d_out: int) -> tuple:
    return ladder.split_output(find_layer(key), x, bias)


def _fold_linear_fake(x: torch.Tensor, bias: Optional[torch.Tensor], key: torch.Tensor, d_out: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], d_out)


def _fold_linear_split_fake(x: torch.Tensor, bias: Optional[torch.Tensor], key: torch.Tensor, d_out: int) -> tuple:
    return x.new_empty(x.shape[0], d_out), x.new_empty(1, d_out)


def _define() -> torch.library.Library:
    lib = torch.library.Library("bdlora", "FRAGMENT")
    lib.define("lora_linear(Tensor(a!) y, Tensor x, Tensor key) -> ()")
    lib.impl("lora_linear", _lora_linear, "CompositeExplicitAutograd")
    torch.library.register_fake("bdlora::lora_linear", lambda y, x, key: None, lib=lib)
    lib.define("fold_linear(Tensor x, Tensor? bias, Tensor key, int d_out) -> Tensor")
    lib.impl("fold_linear", _fold_linear, "CompositeExplicitAutograd")
    torch.library.register_fake("bdlora::fold_linear", _fold_linear_fake, lib=lib)
    lib.define("fold_linear_split(Tensor x, Tensor? bias, Tensor key, int d_out) -> (Tensor, Tensor)")
    lib.impl("fold_linear_split", _fold_linear_split, "CompositeExplicitAutograd")
    torch.library.register_fake("bdlora::fold_linear_split", _fold_linear_split_fake, lib=lib)
    return lib


#: torch's op registry is process-wide: the ops are defined once, when this module is first imported, and the
#: Library object must live as long as the process for them to stay defined.
_LIB = _define()
