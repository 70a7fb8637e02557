"""Only the factory maps ``zero_optimization.stage`` to behaviour: the code that runs a
built stage (initialize, the engine, the stages, tensor parallelism, the optimizer, the
integrations, DeepSpeed's helpers) asks the stage (``partitions_parameters``) or the
factory (``stage_class``, ``shards_optimizer``, ``partitions_gradients``,
``partitions_parameters``, ``deepspeed_kinds``) instead of comparing numbers."""
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
    """``x.stage``, a name ``stage`` or ``zero_stage``, or a call of
    ``zero_optimization_stage()`` / ``zero_stage(config)``."""
    if isinstance(node, ast.Attribute) and node.attr in ("stage", "zero_stage"):
        return True
    if isinstance(node, ast.Name) and node.id in ("stage", "zero_stage"):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        return name in ("zero_optimization_stage", "zero_stage")
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


# Every module that runs a built stage asks a capability instead (the stage's
# ``partitions_parameters``, ``reduces_every_micro_step``; the factory's ``stage_class``,
# ``shards_optimizer``, ``partitions_gradients``, ``partitions_parameters``,
# ``deepspeed_kinds``). Out of scope, because the number is their subject rather than a
# switch on behaviour: the config's validation, the memory estimator and planner (formulas
# per stage), the demo's report, the offload plan's checks of the config, and the
# checkpoint formats (DeepSpeed names its files by stage).
RUNTIME = ("engine", "stages", "tp", "optim", "integrations", "zero", "sequence", "muon",
           "moe", "comm", "core")
ASKS_THE_STAGE = sorted(
    [p.relative_to(SRC).as_posix() for top in RUNTIME for p in (SRC / top).rglob("*.py")
     if p.relative_to(SRC).as_posix() != "stages/factory.py"]
    + ["utils.py", "recompute.py", "checkpointing.py"])


def test_the_runtime_modules_are_found():
    assert {"engine/engine.py", "engine/stepping.py", "stages/zero3/stage.py",
            "tp/stage.py", "utils.py"} <= set(ASKS_THE_STAGE)
    assert "stages/factory.py" not in ASKS_THE_STAGE


@pytest.mark.parametrize("module", ASKS_THE_STAGE)
def test_runtime_modules_do_not_branch_on_the_stage_number(module):
    assert _stage_number_comparisons((SRC / module).read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("source", [
    "if cfg.zero_optimization.stage == 3:\n    pass\n",
    "graphs = settings.cuda_graphs() if stage == 3 else None\n",
    "if engine.zero_optimization_stage() != 3:\n    pass\n",
    "ok = stage in (1, 2)\n",
    "y = 3 == config.zero_optimization.stage\n",
    "if hf_config.zero_stage(config) != 3:\n    pass\n",
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


@pytest.mark.parametrize("source", [
    "x = partitions_parameters(config.zero_optimization.stage)\n",
    "x = self.stage is None\n",
    "x = stage_count == 3\n",
])
def test_the_detector_lets_predicates_and_other_names_be(source):
    assert _stage_number_comparisons(source) == []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_factory_predicates_follow_the_stages(stage):
    assert factory.shards_optimizer(stage) is (stage >= 1)
    assert factory.partitions_gradients(stage) is (stage >= 2)
    assert factory.partitions_parameters(stage) is (stage == 3)
