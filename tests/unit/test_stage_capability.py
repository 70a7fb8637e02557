"""Only the factory maps ``zero_optimization.stage`` to a class: initialize, the engine,
compile, the parameter readers and the optimizer's DeepSpeed kinds ask the stage
(``partitions_parameters``, ``factory.adopt``, ``factory.deepspeed_kinds``) instead of
comparing numbers."""
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


def _names_the_stage(node: ast.AST) -> bool:
    """``x.stage``, a name ``stage``, or ``engine.zero_optimization_stage()``."""
    if isinstance(node, ast.Attribute) and node.attr == "stage":
        return True
    if isinstance(node, ast.Name) and node.id == "stage":
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        return name == "zero_optimization_stage"
    return False


def _is_number(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(
        _is_number(e) for e in node.elts)


def _stage_number_comparisons(source: str) -> list[int]:
    """Lines comparing the stage number (``cfg.zero_optimization.stage``, a ``stage``
    argument, ``engine.zero_optimization_stage()``) with a number or a tuple of them."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_the_stage(s) for s in sides) and any(_is_number(s) for s in sides):
                lines.append(node.lineno)
    return lines


# Where a capability of the stage answers instead (``partitions_parameters``, the factory's
# ``stage_class`` and ``deepspeed_kinds``): set-up, the engine, compile, the parameter
# readers and the optimizer's DeepSpeed kinds.
ASKS_THE_STAGE = ["engine/build.py", "engine/engine.py", "engine/stepping.py",
                  "engine/window.py", "engine/compile.py",
                  "engine/full_params.py", "engine/group_gradients.py", "utils.py",
                  "optim/kinds.py", "optim/optimizer.py"]


@pytest.mark.parametrize("module", ASKS_THE_STAGE)
def test_set_up_the_engine_and_its_helpers_do_not_branch_on_the_stage_number(module):
    assert _stage_number_comparisons((SRC / module).read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("source", [
    "if cfg.zero_optimization.stage == 3:\n    pass\n",
    "graphs = settings.cuda_graphs() if stage == 3 else None\n",
    "if engine.zero_optimization_stage() != 3:\n    pass\n",
    "ok = stage in (1, 2)\n",
])
def test_the_detector_sees_a_branch_on_the_stage_number(source):
    assert _stage_number_comparisons(source) == [1]


def test_compile_refuses_cuda_graphs_where_the_stage_partitions_parameters():
    """engine/compile asks the factory's class, so the refusal follows the capability."""
    from zerotrain.engine.compile import Compilation, CompileSettings

    for stage in (0, 1, 2):
        Compilation([], CompileSettings(mode="reduce-overhead"), stage=stage)
    with pytest.raises(ConfigError, match="CUDA graphs"):
        Compilation([], CompileSettings(mode="reduce-overhead"), stage=3)


@pytest.mark.parametrize("stage,kinds", [
    (0, set()), (1, {"DeepSpeedZeroOptimizer", "ZeROOptimizer"}),
    (2, {"DeepSpeedZeroOptimizer", "ZeROOptimizer"}),
    (3, {"DeepSpeedZeroOptimizer_Stage3", "ZeROOptimizer"})])
def test_the_factory_names_deepspeeds_optimizer_classes_by_stage(stage, kinds):
    from zerotrain.config import load_config

    config = load_config({"train_batch_size": 1, "zero_optimization": {"stage": stage}},
                         world_size=1)
    assert factory.deepspeed_kinds(config) == frozenset(kinds)
