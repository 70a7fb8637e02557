"""Only the factory maps ``zero_optimization.stage`` to a class: initialize and the engine
ask the stage (``partitions_parameters``, ``factory.adopt``) instead of comparing numbers."""
import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from zerotrain.errors import ConfigError
from zerotrain.stages import factory

SRC = Path(__file__).resolve().parents[2] / "src" / "zerotrain"


@pytest.mark.parametrize("stage,partitions", [(0, False), (1, False), (2, False), (3, True)])
def test_the_stage_class_says_whether_it_partitions_parameters(stage, partitions):
    assert factory.stage_class(stage).partitions_parameters is partitions


def test_a_stage_that_does_not_exist_is_refused_by_name():
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        factory.stage_class(4)
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        factory.adopt(5, nn.Linear(2, 2), comm=None)


def test_adopt_leaves_whole_parameters_alone_and_asks_no_communicator():
    model = nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    for stage in (0, 3):  # nothing partitioned: nothing to gather, no collective
        factory.adopt(stage, model, comm=None)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _stage_number_comparisons(path: Path) -> list[int]:
    """Lines comparing something named ``stage`` (``cfg.zero_optimization.stage``,
    ``zero.stage``) with a number."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Attribute) and s.attr == "stage" for s in sides)
            number = any(isinstance(s, ast.Constant) and isinstance(s.value, int) for s in sides)
            if named and number:
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", ["engine/build.py", "engine/engine.py"])
def test_initialize_and_the_engine_do_not_branch_on_the_stage_number(module):
    assert _stage_number_comparisons(SRC / module) == []
