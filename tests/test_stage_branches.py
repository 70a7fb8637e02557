"""Only ``stages/factory.py`` turns the stage number into behaviour.

The code that runs a built stage (the engine, the stages, tensor parallelism, the
optimizer wrappers, DeepSpeed's helpers over them) asks the stage what it does
(``partitions_parameters``, ``reduces_every_micro_step``) or the factory's predicates
(``shards_optimizer``, ``partitions_gradients``, ``partitions_parameters``), never compares
``zero_optimization.stage`` with a number: a new stage, or a stage that changes what it
shards, then changes one place. Out of scope, because the number is their subject rather
than a switch on behaviour: the config's validation, the memory estimator and planner
(formulas per stage), the demo's report, and the checkpoint formats (DeepSpeed names its
files by stage).
"""
from __future__ import annotations

import ast
from typing import Iterator, Mapping

import pytest

from test_layers import load_modules, top_name

# top-level names whose modules run a built stage
RUNTIME = frozenset({"engine", "stages", "tp", "optim", "integrations", "utils", "zero",
                     "sequence", "muon", "moe", "recompute", "checkpointing", "comm", "core"})
FACTORY = "stages/factory"


def _names_the_stage(node: ast.AST) -> bool:
    """``x.stage``, ``stage``, ``zero_stage`` or ``zero_optimization_stage()``."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr in ("stage", "zero_stage", "zero_optimization_stage")
    return isinstance(node, ast.Name) and node.id in ("stage", "zero_stage")


def _is_stage_number(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_stage_number(e) for e in node.elts)
    return (isinstance(node, ast.Constant) and type(node.value) is int
            and 0 <= node.value <= 3)


def stage_number_branches(modules: Mapping[str, str]) -> Iterator[str]:
    """``path:line`` of every comparison of the stage with a stage number in runtime code."""
    for key, source in modules.items():
        if key == FACTORY or top_name(key) not in RUNTIME:
            continue
        for node in ast.walk(ast.parse(source, filename=key)):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if any(_names_the_stage(s) for s in sides) and any(_is_stage_number(s)
                                                                for s in sides):
                yield f"{key}.py:{node.lineno}"


def test_only_the_factory_compares_the_stage_with_a_number():
    found = list(stage_number_branches(load_modules()))
    assert not found, (f"{found} compare the ZeRO stage with a number: ask the stage "
                       "(partitions_parameters, reduces_every_micro_step) or stages/factory.py "
                       "(shards_optimizer, partitions_gradients, partitions_parameters)")


@pytest.mark.parametrize("source", [
    "if self.zero_optimization_stage() == 0:\n    pass\n",
    "x = config.zero_optimization.stage >= 2\n",
    "ok = stage in (1, 2)\n",
    "y = 3 == zero_stage\n",
])
def test_the_rule_flags_a_comparison_with_a_stage_number(source):
    assert list(stage_number_branches({"engine/fake": source})) == ["engine/fake.py:1"]


@pytest.mark.parametrize("key, source", [
    ("engine/fake", "x = partitions_parameters(config.zero_optimization.stage)\n"),
    ("engine/fake", "x = self.stage is None\n"),
    ("engine/fake", "x = stage_count == 3\n"),
    ("estimate/fake", "x = placement.stage == 3\n"),
    (FACTORY, "x = stage == 3\n"),
])
def test_the_rule_lets_predicates_and_out_of_scope_modules_be(key, source):
    assert list(stage_number_branches({key: source})) == []
