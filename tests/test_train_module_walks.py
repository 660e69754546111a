"""The trainer's list-backed ``train`` / ``zero_grad`` / ``parameters`` (train.module_walks): the same results as
``nn.Module``'s walks on a PEFT BD-LoRA model, stepping aside where a module has its own, gone after training, and a
trained adapter bit-identical to one trained with the Trainer's own walks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from bdlora.train.config import TrainConfig
from bdlora.train.module_walks import WALKS, CachedModuleWalks
from bdlora.train.tasks import toy_chat_records, write_jsonl
from bdlora.train.trainer import build_peft_model, run_training


@pytest.fixture()
def peft_model(tiny_llama_dir, tmp_path):
    cfg = TrainConfig(model=str(tiny_llama_dir), nblocks=2, r=8, train_file="unused.jsonl", output_dir=str(tmp_path))
    model = build_peft_model(cfg, tiny_llama_dir)
    return model[0] if isinstance(model, tuple) else model


def _modes(model):
    return [m.training for m in model.modules()]


def test_same_results_as_module_walks(peft_model):
    walks = CachedModuleWalks()
    assert walks.install(peft_model)
    assert all(name in peft_model.__dict__ for name in WALKS)
    expected = list(torch.nn.Module.parameters(peft_model))
    assert [id(p) for p in peft_model.parameters()] == [id(p) for p in expected]
    assert [id(p) for p in peft_model.parameters(recurse=False)] == \
        [id(p) for p in torch.nn.Module.parameters(peft_model, recurse=False)]

    peft_model.eval()  # nn.Module.eval calls the instance's train(False)
    assert not any(_modes(peft_model))
    peft_model.train()
    assert all(_modes(peft_model))
    # a sub-module switched by hand is switched back, as nn.Module.train does
    layer = peft_model.get_base_model().model.layers[1]
    layer.eval()
    assert not layer.self_attn.training
    assert peft_model.train() is peft_model and all(_modes(peft_model))
    with pytest.raises(ValueError):
        peft_model.train("yes")

    trainable = [p for p in expected if p.requires_grad]
    for p in trainable:
        p.grad = torch.ones_like(p)
    peft_model.zero_grad(set_to_none=False)  # nn.Module's in-place zeroing
    assert all(p.grad is not None and not p.grad.any() for p in trainable)
    peft_model.zero_grad()
    assert all(p.grad is None for p in expected)

    walks.model = peft_model
    walks.uninstall()
    assert not any(name in peft_model.__dict__ for name in WALKS)
    assert peft_model.train.__func__ is torch.nn.Module.train


def test_steps_aside_for_a_module_with_its_own_train(peft_model):
    class OwnTrain(torch.nn.Identity):
        calls = 0

        def train(self, mode: bool = True):
            OwnTrain.calls += 1
            return super().train(mode)

    peft_model.get_base_model().model.extra = OwnTrain()
    assert not CachedModuleWalks().install(peft_model)
    assert not any(name in peft_model.__dict__ for name in WALKS)
    peft_model.train()
    assert OwnTrain.calls == 1


def test_trained_adapter_identical_without_the_lists(tiny_llama_dir, tmp_path, monkeypatch):
    data = write_jsonl(toy_chat_records(24, seed=5), tmp_path / "d.jsonl")
    seen = []
    install = CachedModuleWalks.install

    def spy(self, model):
        seen.append(install(self, model))
        return seen[-1]

    def job(out):
        return TrainConfig.from_dict(dict(model=str(tiny_llama_dir), nblocks=2, r=8, train_file=str(data),
                                          eval_fraction=0.25, eval_every=2, batch_size=2, max_steps=5, lr=1e-3,
                                          output_dir=str(tmp_path / out), progress=False, report_to=[]))

    monkeypatch.setattr(CachedModuleWalks, "install", spy)
    listed = run_training(job("listed"))
    assert seen == [True]  # the lists were used; an evaluation ran in between (eval, then train again)
    monkeypatch.setattr(CachedModuleWalks, "install", lambda self, model: False)
    walked = run_training(job("walked"))
    a = load_file(str(listed.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(walked.adapter_dir / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert listed.train_loss == walked.train_loss
