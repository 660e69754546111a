"""bdlora.vllm_plugin.vllm_api: every touch point of the table that applies to the installed vLLM resolves (attribute,
dataclass field or instance attribute present; the parameters we pass accepted), so a vLLM upgrade fails here with the
touch point's name. No engine is started."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from bdlora.vllm_plugin import vllm_api as api  # noqa: E402

pytestmark = pytest.mark.vllm

_APPLICABLE = [tp.key for tp in api.TOUCH_POINTS if tp.present_in(api.checked_version())]


def test_table_is_well_formed():
    keys = [tp.key for tp in api.TOUCH_POINTS]
    assert len(keys) == len(set(keys))
    for tp in api.TOUCH_POINTS:
        assert tp.use in ("wrap", "replace", "subclass", "override", "call", "read", "write", "swap", "rely"), tp.key
        assert tp.kind in ("attr", "instance", "field"), tp.key
        assert set(tp.versions) <= set(api.CHECKED_VERSIONS), tp.key
        assert tp.present_in("0.32") or tp.optional, tp.key  # everything required is on the CI version
        assert tp.why, tp.key


@pytest.mark.parametrize("key", _APPLICABLE)
def test_touch_point_resolves(key):
    assert api.check_installed({key}) == []


def test_plugin_patches_go_through_the_table():
    import bdlora.vllm_plugin as plugin

    plugin.register()
    table = {tp.key for tp in api.TOUCH_POINTS}
    assert api.PATCHED, "register() patched nothing through vllm_api.patch"
    for key, rec in api.PATCHED.items():
        assert key in table, f"{key} was patched but is not in vllm_api.TOUCH_POINTS"
    for key in ("EngineArgs.add_cli_args", "Executor.add_lora", "WorkerLoRAManager._load_adapter",
                "PEFTHelper._validate_features", "OpenAIServingModels.load_lora_adapter"):
        owner, attr = api.owner_of(key)
        assert api.is_patched(api.current(owner, attr)), key


def test_patch_is_idempotent_keeps_descriptors_and_names_missing_points():
    class Owner:
        @staticmethod
        def s(x):
            return x

        @classmethod
        def c(cls, x):
            return x

    assert api.patch(Owner, "s", lambda x: x + 1, point="test.s")
    assert not api.patch(Owner, "s", lambda x: x + 2, point="test.s")  # already patched: kept
    assert Owner.s(1) == 2 and isinstance(Owner.__dict__["s"], staticmethod)
    assert api.wrap("test.c", lambda orig: (lambda cls, x: orig(cls, x) * 10), owner=Owner, attr="c")
    assert Owner.c(2) == 20 and isinstance(Owner.__dict__["c"], classmethod)
    assert api.PATCHED["test.s"].original(1) == 1
    with pytest.raises(api.TouchPointMissing, match=r"vLLM \S+ has no .*Owner\.nope"):
        api.patch(Owner, "nope", lambda: None)
    api.PATCHED.pop("test.s"), api.PATCHED.pop("test.c")


def test_missing_touch_point_names_version_and_attribute(monkeypatch):
    import dataclasses

    fake = dataclasses.replace(api.touch_point("Executor.add_lora"), key="fake", attr="Executor.add_lora_v2")
    monkeypatch.setitem(api._BY_KEY, "fake", fake)
    with pytest.raises(api.TouchPointMissing) as e:
        api.resolve("fake")
    msg = str(e.value)
    assert api.installed_version() in msg and "vllm.v1.executor.abstract.Executor.add_lora_v2" in msg
    assert "0.26, 0.32, 0.33" in msg
    assert api.resolve("fake", None) is None


def test_layer_build_state_travels_with_the_classes():
    from bdlora.vllm_plugin import layers

    build = layers.LayerBuild(rank=4)
    classes = layers.layer_classes(build)
    assert [c.__qualname__ for c in classes] == [c.__qualname__ for c in layers.BD_LORA_CLASSES]
    # vLLM builds its warm-up LoRA by the layer's class name: the BD expert layers answer to vLLM's names
    names = {c.__qualname__: c.__name__ for c in classes}
    assert names["BDFusedMoEWithLoRA"] == "FusedMoEWithLoRA" and names["BDFusedMoE3DWithLoRA"] == "FusedMoE3DWithLoRA"
    assert names["BDRowParallelLinearWithLoRA"] == "BDRowParallelLinearWithLoRA"
    assert all(c._bd_build is build and issubclass(c, b) for c, b in zip(classes, layers.BD_LORA_CLASSES))
    assert all(c._bd_build is None for c in layers.BD_LORA_CLASSES)
    assert not any(n.startswith("_BUILD") for n in vars(layers))


def test_source_checker_reads_the_installed_tree():
    import os

    import vllm

    rows = dict(api.check_source(os.path.dirname(vllm.__file__), api.checked_version()))
    bad = {k: v for k, v in rows.items() if v.startswith(("MISSING", "SIGNATURE"))}
    assert not bad
