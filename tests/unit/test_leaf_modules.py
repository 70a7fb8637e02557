"""DeepSpeed 0.19's leaf-module API and config form (zero3/leaf.py), without processes."""
import pytest
from torch import nn

import zerotrain.utils as U
from zerotrain.config import load_config
from zerotrain.stages.zero3.leaf import apply_leaf_module_config
from zerotrain.stages.zero3.unit_specs import build_units


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(4, 2)


def test_flags_by_class_name_suffix_and_unset_as_deepspeed():
    model = Net()
    assert U.set_z3_leaf_modules(model, [Block]) == list(model.layers)
    assert U.get_z3_leaf_modules(model) == list(model.layers)
    assert U.z3_leaf_module(model.layers[0]) and not U.z3_leaf_module(model.head)
    U.unset_z3_leaf_modules(model, ["Block"])
    assert U.get_z3_leaf_modules(model) == []
    found, missing = U.set_z3_leaf_modules_by_name(model, ["layers.1", "nope"],
                                                   raise_if_not_found=False)
    assert found == [model.layers[1]] and missing == ["nope"]
    found, missing = U.set_z3_leaf_modules_by_suffix(model, ["head"])
    assert found == [model.head] and missing == []
    with pytest.raises(ValueError, match="No modules of type"):
        U.set_z3_leaf_modules(model, [nn.Conv2d])
    with pytest.raises(ValueError, match="No modules named"):
        U.set_z3_leaf_modules_by_name(model, ["missing"])
    assert U.set_z3_leaf_modules(model, [f"{__name__}.Block"]) == list(model.layers)


def test_a_leaf_is_one_unit_and_its_experts_none():
    model = Net()
    plain = {u.name for u in build_units(model, unit_numel=10 ** 9, persistence_threshold=0)}
    assert "layers.0.experts.1" in plain
    U.set_z3_leaf_modules(model, [Block])
    units = build_units(model, unit_numel=1, persistence_threshold=0)
    names = [u.name for u in units if not u.persistent]
    assert "layers.0" in names and not any("experts" in n for n in names), names
    leaf = next(u for u in units if u.name == "layers.0" and not u.persistent)
    assert leaf.leaf and len(leaf.params) == 6
    assert all(U.z3_leaf_parameter(p) for p in model.layers[0].parameters())
    assert not U.z3_leaf_parameter(model.head.weight)


def test_leaf_module_config_form_and_defaults():
    zero = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "leaf_module": {"names": "layers.0", "name_suffixes": ["head"]}}},
        world_size=1).zero_optimization
    assert any("MixtralSparseMoeBlock" in c for c in zero.leaf_module.classes)
    model = Net()
    flagged = apply_leaf_module_config(model, zero.leaf_module.model_dump())
    assert flagged == [model.layers[0], model.head]
    with pytest.raises(Exception, match="leaf_module"):
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "leaf_module": {"clases": ["Block"]}}}, world_size=1)


def test_deepspeed_utils_under_the_switch_and_accelerates_moe_route(monkeypatch):
    from types import SimpleNamespace

    import accelerate.utils.dataclasses as accelerate_dataclasses
    # Accelerate asks the installed deepspeed's version first; that metadata is not this
    # test's subject
    monkeypatch.setattr(accelerate_dataclasses, "compare_versions", lambda *a: False)

    from zerotrain import as_deepspeed
    as_deepspeed.install()
    try:
        import deepspeed.utils as du
        for name in ("set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules",
                     "z3_leaf_module", "z3_leaf_parameter", "set_z3_leaf_module",
                     "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix"):
            assert getattr(du, name) is getattr(U, name), name
        from accelerate.utils import DeepSpeedPlugin
        model = Net()
        plugin = SimpleNamespace(transformer_moe_cls_names="Block")
        DeepSpeedPlugin.set_moe_leaf_modules(plugin, model)   # what Accelerate runs
        assert U.get_z3_leaf_modules(model) == list(model.layers)
    finally:
        as_deepspeed.uninstall()


def test_the_model_itself_as_a_leaf_is_one_unit():
    """DeepSpeed's tests mark the model's own class a leaf so that ranks may run different
    submodules of it: nothing under it starts a unit then."""
    model = Net()
    U.set_z3_leaf_modules(model, [Net])
    units = [u for u in build_units(model, unit_numel=1, persistence_threshold=0)
             if not u.persistent]
    assert [(u.name, u.leaf, len(u.params)) for u in units] == [("", True, 14)]
