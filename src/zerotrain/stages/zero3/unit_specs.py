"""Unit specs: which parameters are gathered together, the module tree cut into units.

Note: units
    One all-gather serves a unit: every child of an ``nn.ModuleList`` (a transformer block),
    any other module whose not-yet-claimed parameters reach ``unit_numel`` elements (a big
    embedding), and the root for whatever is left. A parameter belongs to exactly one unit,
    the first that reaches it in ``named_modules`` order, so a tied or shared parameter is
    partitioned and gathered once. A module that uses a parameter owned by another unit (a
    head tied to the embedding, or a parameter announced by ``register_external_parameter``)
    makes that unit a *dependency*: it is gathered whenever the module's unit is. A
    parameter a module returns to its caller is not planned here: the hooks keep its unit
    gathered from that return on (``scheduler.py``, Note: returned parameters).

    Parameters smaller than the persistence threshold are not gathered per use: they form a
    persistent unit beside their unit, kept whole on every rank. Frozen parameters belong to
    no unit: they stay whole and replicated, like buffers.

    A leaf module (``leaf.py``, Note: leaf modules) is a unit, and nothing under it starts
    one: not the children of an ``nn.ModuleList`` inside it (its experts), nor a module
    past ``unit_numel``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .ds_attrs import ds_param
from .leaf import z3_leaf_module
from .partition import full_numel


@dataclass(eq=False)
class UnitSpec:
    """The static description of one unit."""

    index: int
    name: str                      # the module path of the unit's root ('' for the model)
    module: nn.Module
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)
    deps: set[int] = field(default_factory=set)
    persistent: bool = False
    leaf: bool = False             # rooted at a leaf module (Note: leaf modules)

    @property
    def numel(self) -> int:
        return sum(full_numel(p) for p in self.params)


def inside_leaves(root: nn.Module) -> set[nn.Module]:
    """Modules strictly under a leaf module (Note: units): none of them starts a unit. The
    model itself may be the leaf (DeepSpeed's rule too): then it is one unit, gathered
    whole, which lets ranks run different submodules of it."""
    inside: set[nn.Module] = set()
    for module in root.modules():
        if module not in inside and z3_leaf_module(module):
            inside.update(list(module.modules())[1:])
    return inside


def _unit_roots(root: nn.Module, unit_numel: int) -> dict[nn.Module, str]:
    """Modules that start a unit, by module path, chosen bottom-up."""
    roots: dict[nn.Module, str] = {root: ""}
    inside = inside_leaves(root)
    for _, module in root.named_modules():
        if z3_leaf_module(module) and module not in inside:
            roots.setdefault(module, "")
        if isinstance(module, nn.ModuleList) and module not in inside:
            for child_name, child in module.named_children():
                if child not in inside:
                    roots.setdefault(child, "")
    names = {m: n for n, m in root.named_modules()}
    for module in roots:
        roots[module] = names[module]

    claimed: set[int] = set()

    def visit(module: nn.Module) -> int:
        """Unclaimed parameter elements under ``module`` after its descendants decided."""
        total = sum(visit(child) for child in module.children())
        own = 0
        for p in module.parameters(recurse=False):
            if id(p) not in claimed:
                claimed.add(id(p))
                own += full_numel(p)
        total += own
        if module is not root and module not in inside and (
                module in roots or total >= unit_numel):
            roots[module] = names[module]
            return 0
        return total

    visit(root)
    return roots


def build_units(root: nn.Module, *, unit_numel: int, persistence_threshold: int) -> list[UnitSpec]:
    """Cut ``root`` into units (each unit's persistent sibling comes right after it)."""
    roots = _unit_roots(root, unit_numel)
    unit_of_module: dict[nn.Module, tuple[UnitSpec, UnitSpec]] = {}
    units: list[UnitSpec] = []
    owner: dict[int, UnitSpec] = {}

    def open_units(module: nn.Module, name: str) -> tuple[UnitSpec, UnitSpec]:
        leaf = z3_leaf_module(module)
        main = UnitSpec(len(units), name, module, leaf=leaf)
        keep = UnitSpec(len(units) + 1, name, module, persistent=True, leaf=leaf)
        units.extend([main, keep])
        return main, keep

    for name, module in root.named_modules():
        if module in roots:
            pair = open_units(module, name)
        else:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            pair = unit_of_module[root.get_submodule(parent)]
        unit_of_module[module] = pair
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in owner:   # frozen parameters are partitioned too (no optimizer state)
                continue
            small = full_numel(p) < persistence_threshold
            unit = pair[1] if small else pair[0]
            owner[id(p)] = unit
            unit.names.append(f"{name}.{pname}" if name else pname)
            unit.params.append(p)

    for module, (main, _) in unit_of_module.items():
        used = list(module.parameters(recurse=False))
        used += getattr(module, "_zerotrain_external_params", [])
        for p in used:
            owning = owner.get(id(p))
            if owning is None:
                raise ValueError(f"module {names_of(root, module)!r} uses an external parameter "
                                 "that is not part of the model given to initialize")
            if owning is not main and not owning.persistent:
                main.deps.add(owning.index)
    for spec in units:   # DeepSpeed's mark, read by z3_leaf_parameter
        if spec.leaf:
            for p in spec.params:
                ds_param(p).ds_z3_leaf_module = spec.module
    # a unit without parameters of its own still matters when it gathers others for its modules
    return _renumber([u for u in units if u.params or u.deps])


def names_of(root: nn.Module, module: nn.Module) -> str:
    return next((n for n, m in root.named_modules() if m is module), "?")


def _renumber(units: list[UnitSpec]) -> list[UnitSpec]:
    new_index = {u.index: i for i, u in enumerate(units)}
    for u in units:
        u.index = new_index[u.index]
    for u in units:
        u.deps = {new_index[d] for d in u.deps if d in new_index}
    return units
