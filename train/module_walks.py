"""The Trainer's three walks of the model per step, taken from lists built once per training run.

Every step transformers' Trainer calls ``model.train()``, ``model.zero_grad()`` and, to clip gradients,
``model.parameters()``: each walks every module (2,665 of them in a 32-layer PEFT model: ~10 ms a step on one CPU core
together). A short-batch GPU step is bound by that host time. While training runs the model's structure does not
change, so :class:`CachedModuleWalks` (a ``TrainerCallback``) lists the modules and parameters at the start of
training and gives the model instance its own ``train``, ``zero_grad`` and ``parameters`` that read the lists, with
the same results as ``nn.Module``'s; at the end of training the instance's own methods are removed again.

It steps aside (the walks stay ``nn.Module``'s) where the lists could go stale or the methods mean more: a module
that overrides one of the three methods (other than transformers' ``PreTrainedModel.train``, which adds work only
when the mode changes, and is then called), and sharded parameters (FSDP, DeepSpeed replace them after wrapping).
"""
from __future__ import annotations

import torch
from transformers import TrainerCallback

#: the ``nn.Module`` methods given list-backed versions on the model instance
WALKS = ("train", "zero_grad", "parameters")


class CachedModuleWalks(TrainerCallback):
    """``model.train()``, ``model.zero_grad()`` and ``model.parameters()`` of the trained model from lists taken at
    ``on_train_begin`` (same modules, same parameters, same order, ties counted once as ``nn.Module`` does)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.model: torch.nn.Module | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.enabled and model is not None and self.install(model):
            self.model = model

    def on_train_end(self, args, state, control, **kwargs):
        self.uninstall()

    def install(self, model: torch.nn.Module) -> bool:
        """Gives ``model`` its list-backed methods; False (nothing changed) where a module has its own version of
        one of them."""
        from transformers import PreTrainedModel

        modules = list(model.modules())
        base = torch.nn.Module
        # transformers' train() re-applies hub kernels when the mode changes, and only then
        own_train_on_change = {base.train, PreTrainedModel.train}
        own = [m for m in modules for name in ("zero_grad", "parameters")
               if getattr(type(m), name) is not getattr(base, name)]
        if own or any(type(m).train not in own_train_on_change for m in modules):
            return False
        params = list(model.parameters())

        def train(mode: bool = True):
            if not isinstance(mode, bool):
                raise ValueError("training mode is expected to be boolean")
            for m in modules:  # parents before children: a PreTrainedModel's own train() sets its whole subtree
                if m.training is not mode:
                    if type(m).train is not base.train:
                        m.train(mode)
                    else:
                        # nn.Module.train sets the same attribute; object's setattr skips Module's checks for
                        # parameters, buffers and submodules, which a bool never is
                        object.__setattr__(m, "training", mode)
            return model

        def zero_grad(set_to_none: bool = True) -> None:
            if not set_to_none:  # zeroing in place detaches and zeroes each gradient: nn.Module's own
                return base.zero_grad(model, set_to_none=False)
            for p in params:
                p.grad = None

        def parameters(recurse: bool = True):
            return iter(params) if recurse else base.parameters(model, recurse=False)

        for name, fn in zip(WALKS, (train, zero_grad, parameters)):
            object.__setattr__(model, name, fn)
        return True

    def uninstall(self) -> None:
        if self.model is not None:
            for name in WALKS:
                self.model.__dict__.pop(name, None)
            self.model = None
