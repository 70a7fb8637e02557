"""Splitting a model over the tensor-parallel group: ``parallelize`` (DeepSpeed's
``tp_model_init``, AutoTP training).

Order (``engine/build.py`` calls it after rank 0's weights are broadcast, before the stage):
1. find the linear layers the rules split (``rules.py``) and check, on every rank before
   any change, that each split dimension and the model's head counts divide evenly;
2. replace each by a :class:`~zerotrain.tp.layers.TensorParallelLinear` holding this
   rank's slice (Note "fused sections" in ``split.py``);
3. give each attention module that lost heads its per-rank counts (GPT-2 splits its fused
   ``c_attn`` output by ``split_size``; Llama-style attention infers heads from shapes);
4. check, on the first forward, that the ranks of the group were given the same inputs
   (``inputs.py``, as DeepSpeed's AutoTP training does).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm.mesh import Mesh
from ..errors import ConfigError
from .inputs import check_first_inputs
from .layers import SharedInput, TensorParallelLinear
from .rules import Rule, Rules
from .split import SplitSpec, local_slice

logger = logging.getLogger(__name__)

SIZE_KEY = "tensor_parallel.autotp_size"
# per-rank counts an attention module may keep as attributes
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "split_size")
# the model config's head counts that must divide by T
_CONFIG_HEADS = ("num_attention_heads", "num_key_value_heads", "n_head")


@dataclass
class TensorParallelPlan:
    """What ``parallelize`` did: the split parameters' specs by name, and the mesh."""

    mesh: Mesh
    specs: dict[str, SplitSpec] = field(default_factory=dict)   # parameter name -> spec
    layers: dict[str, str] = field(default_factory=dict)        # module name -> kind

    def spec_of(self, name: str):
        """The parameter's split, or None when it is whole on every rank."""
        return self.specs.get(name)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(
        module, "weight", None) is not None and module.weight.dim() == 2


def _splittable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _specs(module: nn.Module, rule: Rule, size: int) -> tuple[SplitSpec, SplitSpec | None]:
    """(weight spec, bias spec or None when the bias stays whole)."""
    out_dim = 1 if _is_conv1d(module) else 0   # Conv1D keeps (in, out)
    if rule.kind == "column":
        return SplitSpec(out_dim, size, rule.sections), SplitSpec(0, size, rule.sections)
    return SplitSpec(1 - out_dim, size, 1), None


def parallelize(model: nn.Module, mesh: Mesh, config) -> TensorParallelPlan:
    """Split ``model``'s linear layers over ``mesh.tp`` by ``config``'s rules (a
    ``TensorParallelConfig``). Every rank calls it with the same (whole) model; raises
    ConfigError naming the layer or head count that does not divide."""
    size, rank = mesh.tp_size, mesh.tp_rank
    try:
        rules = Rules(config.partition_config)
    except ValueError as exc:
        raise ConfigError("tensor_parallel.partition_config", str(exc)) from exc
    chosen: list[tuple[str, nn.Module, Rule]] = []
    for name, module in model.named_modules():
        rule = rules.rule_for(name) if name else None
        if rule is None:
            continue
        if not _splittable(module):
            if rules.user and any(p.search(f"{name}.weight") for p, _ in rules.user):
                raise ConfigError("tensor_parallel.partition_config",
                                  f"{name} is a {type(module).__name__}; only nn.Linear and "
                                  "Conv1D layers can be split")
            continue
        chosen.append((name, module, rule))
    if not chosen:
        raise ConfigError(SIZE_KEY, f"{size}, but no layer of the model matches the AutoTP "
                          "rules (q/k/v/o, up/gate/down, c_attn/c_fc/c_proj); add "
                          "tensor_parallel.partition_config.layer_specs", value=size)
    _check_divisible(model, chosen, size)
    plan = TensorParallelPlan(mesh)
    shared: dict[str, SharedInput] = {}   # one f per module: its column layers share it
    for name, module, rule in chosen:
        weight_spec, bias_spec = _specs(module, rule, size)
        bias = getattr(module, "bias", None)
        with torch.no_grad():
            weight = local_slice(module.weight.detach(), weight_spec, rank)
            if bias is not None:
                bias = (local_slice(bias.detach(), bias_spec, rank) if bias_spec
                        else bias.detach().clone())
        weight.requires_grad_(module.weight.requires_grad)
        if bias is not None:
            bias.requires_grad_(module.bias.requires_grad)
        parent = name.rpartition(".")[0]
        if rule.kind == "column" and parent not in shared:
            shared[parent] = SharedInput(mesh.tp, f"{parent} input")
            owner = model.get_submodule(parent) if parent else model
            owner.register_forward_pre_hook(shared[parent].clear)
            owner.register_forward_hook(shared[parent].clear)
        layer = TensorParallelLinear(kind=rule.kind, weight=weight, bias=bias,
                                     transposed=_is_conv1d(module), comm=mesh.tp, name=name,
                                     shared_input=shared.get(parent) if rule.kind == "column"
                                     else None)
        _replace(model, name, layer)
        plan.layers[name] = rule.kind
        plan.specs[f"{name}.weight"] = weight_spec
        if bias is not None and bias_spec is not None:
            plan.specs[f"{name}.bias"] = bias_spec
    _divide_heads(model, plan.layers, size)
    check_first_inputs(model, mesh.tp)
    logger.info("tensor parallel: %d layers split over %d ranks", len(chosen), size)
    return plan


def _check_divisible(model: nn.Module, chosen, size: int) -> None:
    config = getattr(model, "config", None)
    for key in _CONFIG_HEADS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value % size:
            raise ConfigError(SIZE_KEY, f"{size} does not divide the model's {key} ({value}): "
                              "each rank must hold whole attention heads", value=size)
    for name, module, rule in chosen:
        spec, _ = _specs(module, rule, size)
        shape = tuple(module.weight.shape)
        if not spec.divides(shape):
            what = f"{rule.sections} fused sections of " if rule.sections > 1 else ""
            raise ConfigError(SIZE_KEY, f"{size} does not divide {name}.weight: shape {shape}, "
                              f"{what}dimension {spec.dim} ({rule.kind}-parallel)", value=size)


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)


def _divide_heads(model: nn.Module, layers: dict[str, str], size: int) -> None:
    """Per-rank head counts on each module with a column-parallel child (Note in the module
    docstring: step 3)."""
    parents = {name.rpartition(".")[0] for name, kind in layers.items() if kind == "column"}
    for parent in parents:
        module = model.get_submodule(parent) if parent else model
        for attr in _HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attr, value // size)
